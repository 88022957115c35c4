"""The host: a loaded model set wired to its proposers, controller and engine; what `run`,
`bench` and the daemon drive.

Wiring is all it does: the loader opens models (models/loader.py), the proposers wrap them, the
controller owns the proposer registry and the measured costs, the engine runs the steps. Warm-up
touches the weights (the first pass after an mmap load pays the page faults) and has the
controller calibrate on this machine.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from homespec.config import Config, Mode, override
from homespec.errors import UserError
from homespec.llama import prefix_store
from homespec.llama.prefix_cache import PrefixCache
from homespec.models.loader import ModelSet, load_model_set
from homespec.serving.llama_options import sampling_order
from homespec.speculation.batch import Batch
from homespec.speculation.constraints import Grammar
from homespec.speculation.controller import Controller, make_policy
from homespec.speculation.engine import Engine, Event, GenerationStats, Steps
from homespec.speculation.infill_sampler import InfillVocab
from homespec.speculation.proposers.base import Proposer
from homespec.speculation.proposers.draft import DraftProposer
from homespec.speculation.proposers.mtp import MTPProposer
from homespec.speculation.proposers.ngram import NgramProposer
from homespec.speculation.proposers.ngram_memory import NgramMemory
from homespec.speculation.sampling import SamplingParams, with_logit_bias
from homespec.tokens import common_prefix

log = logging.getLogger("homespec.serving.host")

# A short chat-like context for timing passes: realistic positions, nothing cached from it.
_WARMUP_TEXT = (
    "<|im_start|>user\nWrite a Python function that parses an ISO date and returns the weekday."
    "<|im_end|>\n<|im_start|>assistant\nHere is a function that does it:\n\n```python\nimport datetime\n"
)


class UnknownMode(UserError):
    pass


@dataclass
class GenerationRequest:
    params: SamplingParams = SamplingParams()
    max_tokens: int = 256
    stop: Sequence[str] = ()
    mode: Mode = Mode.AUTO
    k: int | None = None  # fixed modes; None = config's speculation.k
    grammar: str | None = None  # llguidance grammar every token must follow (constraints.py)
    logprobs: int | None = None  # None: none; n: each token's logprob and its n likeliest alternatives
    infill: bool = False  # llama.cpp's infill sampler is one of the steps (`samplers`); see Host._params


def build_request(
    cfg: Config,
    *,
    mode: Mode | str | None = None,
    k: int | None = None,
    max_tokens: int | None = None,
    stop: Sequence[str] = (),
    grammar: str | None = None,
    logit_bias: Mapping[int, float] | None = None,
    logprobs: int | None = None,
    samplers: list[str] | None = None,
    **sampling: Any,
) -> GenerationRequest:
    """The one place a request is assembled: config.yaml's defaults, overridden by what the
    caller (CLI flags, an API body) set; None means "not set". Overrides are checked against
    the config's own bounds, so a bad one raises UserError naming the field. logit_bias and
    logprobs have no config default: they belong to one request; nor has llama.cpp's `samplers`
    (llama_options.sampler_chain's names), the order of the sampling steps."""
    s = cfg.sampling.model_copy()
    spec = cfg.speculation.model_copy()
    override(s, {**sampling, "max_tokens": max_tokens})
    override(spec, {"mode": mode, "k": k})
    try:
        params = SamplingParams(**{f: getattr(s, f) for f in SamplingParams.__dataclass_fields__ if f in type(s).model_fields})
        params = with_logit_bias(params, logit_bias)
        if samplers is not None:
            params = replace(params, order=sampling_order(samplers, params))
    except ValueError as e:
        raise UserError(str(e)) from None
    infill = "infill" in params.order and samplers is not None  # bound to the target's vocabulary in Host._params
    return GenerationRequest(params, s.max_tokens, stop, spec.mode, k, grammar, logprobs, infill)


@dataclass
class Generation:
    """An iterable of engine events with live stats; close() stops it at the next step."""

    events: Iterator[Event]
    stats: GenerationStats = field(default_factory=GenerationStats)

    def __iter__(self) -> Iterator[Event]:
        return self.events

    def close(self) -> None:
        close = getattr(self.events, "close", None)
        if close:
            close()


def build_proposers(cfg: Config, models: ModelSet, slot: int = 0, memory: NgramMemory | None = None) -> list[Proposer]:
    """Every proposer the loaded models allow for a request in KV sequence `slot` (ngram needs
    no model, and drafts from `memory`, the earlier answers every slot shares, too; a draft
    model reads along in its own sequence of the same number; the MTP head reads the hidden
    states the target keeps for slot 0 only)."""
    ngram = cfg.speculation.ngram
    lookup = NgramProposer(ngram.n_min, ngram.n_max, memory, piece=models.target.piece)
    out: list[Proposer] = [lookup]
    if models.draft is not None:
        out.append(draft_proposer(models, slot, lookup))
    if models.mtp_head is not None and slot == 0:
        out.append(MTPProposer(models.target, models.mtp_head))
    return out


def draft_proposer(models: ModelSet, slot: int = 0, lookup: NgramProposer | None = None) -> DraftProposer:
    """The draft model's proposer for a request in `slot`: its own sequence of the draft's
    context, whose passes a batch runs beside the other slots' (Runtime.eval_many); its
    guesses go on as the prompt does where they copy it (`lookup`: the same request's prompt
    lookup, DraftProposer.copy)."""
    assert models.draft is not None
    return DraftProposer(models.draft.slot(slot), models.target.n_vocab, together=models.draft.eval_many,
                         copy=lookup.copy if lookup is not None else None)


# prompt lookup's memory of answers, beside the saved histories (prefix_store.save_arrays)
ANSWERS = "answers"


class Kept(NamedTuple):
    """What was written to disk for the next start, or read back from it."""

    histories: int  # the prefix cache's conversations
    answers: int  # prompt lookup's remembered answers


class Host:
    def __init__(self, cfg: Config, models: ModelSet) -> None:
        self.cfg = cfg
        self.models = models
        spec = cfg.speculation
        k_max = min(self.k_limit, models.target.n_ctx - 1)
        self.ngram_memory = NgramMemory(spec.ngram.memory_tokens) if spec.ngram.memory_tokens else None
        self.controller = Controller(build_proposers(cfg, models, memory=self.ngram_memory), spec.controller, k_max=k_max,
                                     together_rows=max(cfg.server.prefill_chunk // 2, 2),
                                     split_steps=not models.target.shares_cells)
        self.engine = Engine(models.target)
        # Proposer instances of the slots other than 0 (slot 0 uses the controller's registry).
        self._slot_proposers: dict[int, dict[str, Proposer]] = {}
        self.warmup_s = 0.0
        self.calibration: dict[str, dict[int, float]] = {}  # "target" | proposer -> {n: seconds}
        self.prefix_cache = PrefixCache(cfg.memory.prefix_cache_mib * 2**20) if cfg.runtime.prefix_reuse else None

    @classmethod
    def open(
        cls, cfg: Config, *, calibrate: bool = True, with_draft: bool = True, n_ctx: int | None = None, slots: int = 1
    ) -> Host:
        host = cls(cfg, load_model_set(cfg, with_draft=with_draft, n_ctx=n_ctx, slots=slots))
        if calibrate:
            host.warmup()
        return host

    @property
    def proposers(self) -> list[str]:
        """Names of the proposers available now."""
        return sorted(self.controller.proposers)

    # -- shedding the draft under memory pressure -----------------------------------------------

    def unload_draft(self) -> None:
        """Free the draft model; speculation continues with the other proposers (or off)."""
        self.controller.remove_proposer(DraftProposer.name)
        self.models.unload_draft()
        self._slot_proposers.clear()

    def reload_draft(self) -> None:
        """Load the configured draft back (headroom returned) and hand it to the controller,
        whose measured draft costs are kept from before."""
        self.models.load_draft(self.cfg)
        if self.models.draft is not None and DraftProposer.name not in self.controller.proposers:
            lookup = self.controller.proposers.get(NgramProposer.name)
            self.controller.add_proposer(draft_proposer(self.models, 0, lookup if isinstance(lookup, NgramProposer) else None))
        self._slot_proposers.clear()

    def __enter__(self) -> Host:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for p in self.controller.proposers.values():
            p.close()
        self.models.close()

    # -- warm-up -----------------------------------------------------------------------------

    def warmup(self) -> None:
        """Touch the weights and the prefix cache's memory, calibrate the controller and build
        the grammar tokenizer (a few seconds on a CPU)."""
        t0 = time.perf_counter()
        # Said before, not only after: on 2 cores the warm-up is ~10 s in which nothing else shows.
        log.info("warm-up: timing the target's passes of 1-%d tokens and each proposer's cost", self.controller.k_max + 1)
        # Faulted in now, before the passes are timed, not by the saves of the first requests.
        cache_s = self.prefix_cache.touch() if self.prefix_cache is not None else 0.0
        target = self.models.target
        ctx = target.tokenize(_WARMUP_TEXT, add_special=True, parse_special=True)
        target.sync(ctx)  # also faults the weights in
        base = len(target.tokens)
        probe = (ctx * 4)[: self.controller.k_max + 1]

        def time_target(n: int) -> float:
            t = time.perf_counter()
            target.eval(probe[:n], output="all")
            dt = time.perf_counter() - t
            target.truncate(base)
            return dt

        time_target(1)  # the first pass after load is slow (page faults, allocations)
        self.calibration = self.controller.calibrate(
            time_target, context=[*ctx, probe[0]], probe=probe, passes=self.cfg.speculation.controller.warmup_passes
        )
        target.reset()  # the first request should not find warm-up text in the cache
        if self.models.draft is not None and self.slots > 1 and DraftProposer.name in self.controller.proposers:
            together = self._time_draft_together(ctx, self.cfg.speculation.controller.warmup_passes)
            self.controller.set_together_cost(DraftProposer.name, together)
            log.info("warm-up: a draft pass over a row of each of 1-%d requests %s ms", self.slots,
                     "/".join(f"{together[n] * 1000:.1f}" for n in sorted(together)))
        # Built now (~2 s for a 152k vocabulary), not by the first request with a schema or tools.
        target.grammar_tokenizer()
        self.warmup_s = time.perf_counter() - t0
        samples = self.calibration["target"]
        log.info(
            "warm-up %.1f s (prefix cache memory %.1f s): target pass 1 token %.0f ms, %d tokens %.0f ms%s",
            self.warmup_s,
            cache_s,
            samples[1] * 1000,
            max(samples),
            samples[max(samples)] * 1000,
            "".join(f"; {p} {c[1] * 1000:.1f} ms/token" for p, c in self.calibration.items() if p != "target"),
        )

    def _time_draft_together(self, ctx: Sequence[int], passes: int) -> dict[int, float]:
        """Seconds of a draft pass over one row each of n slots, n = 1..slots (median of
        `passes`; the plan prices drafting for several requests at once by it). The 0.5B Q4_0
        draft on a 2-core Xeon: 9.0, 18.0, 19.5 and 21.1 ms."""
        draft = self.models.draft
        assert draft is not None
        slots = [draft.slot(i) for i in range(self.slots)]
        for s in slots:
            s.sync(ctx[:-1], output="none")

        def time_rows(n: int) -> float:
            t = time.perf_counter()
            draft.eval_many([(s, ctx[-1:], "last") for s in slots[:n]])
            dt = time.perf_counter() - t
            for s in slots[:n]:
                s.truncate(len(ctx) - 1)
            return dt

        time_rows(self.slots)  # (the first pass of several sequences allocates)
        out = {n: statistics.median(time_rows(n) for _ in range(passes)) for n in range(1, self.slots + 1)}
        for s in slots:
            s.reset()
        return out

    # -- generation --------------------------------------------------------------------------

    def _prepare_cache(self, tokens: Sequence[int], slot: int = 0) -> None:
        """Prefix reuse: the best saved conversation goes live; or, with reuse off, start cold."""
        if self.prefix_cache is not None:
            target = self.models.target
            # Any slot may lend its prefix (Slot.share_prefix: copied across streams, shared in one buffer).
            peers = [target.slot(i) for i in range(self.slots) if i != slot]
            self.prefix_cache.prepare(target.slot(slot), tokens, peers)
            return
        self._empty(slot)

    def _empty(self, slot: int) -> None:
        """Drop what the target and the draft hold in `slot`."""
        self.models.target.slot(slot).reset()
        if self.models.draft is not None:
            self.models.draft.slot(slot).reset()

    # -- the prefix cache across restarts -----------------------------------------------------

    def persist_prefixes(self, root: Path, budget_s: float | None = None) -> Kept:
        """Write the saved histories, and the live ones of every KV sequence, under root for the
        next start (prefix_store.py; the most recent first, for at most budget_s seconds), and
        prompt lookup's memory of answers beside them."""
        key = self._state_key()
        histories = answers = 0
        if self.prefix_cache is not None:
            for s in range(self.slots):
                self.prefix_cache.stash(self.models.target.slot(s))
            histories = prefix_store.save(root, key, self.prefix_cache.saved(), budget_s)
        if self.ngram_memory is not None and self.ngram_memory.answers:
            prefix_store.save_arrays(root, key, ANSWERS, self.ngram_memory.dump())
            answers = self.ngram_memory.answers
        return Kept(histories, answers)

    def restore_prefixes(self, root: Path) -> Kept:
        """Read back what persist_prefixes wrote for this model, build and settings. llama.cpp
        checks a state only when it loads one, so the newest is loaded once here: a state it
        refuses is found now, not in a request."""
        key = self._state_key()
        histories = answers = 0
        if self.prefix_cache is not None:
            n_ctx = self.models.target.n_ctx
            for h in prefix_store.read(root, key):
                if len(h.tokens) < n_ctx:  # (a context made smaller since has no room for the others)
                    self.prefix_cache.adopt(h.tokens, h.size, h.fill)
            histories = len(self.prefix_cache)
            newest = self.prefix_cache.newest()
            if newest is not None:
                rt = self.models.target.slot(0)
                try:
                    rt.load_state(newest[1], newest[0])
                except RuntimeError as e:
                    log.warning("saved prompt caches under %s not used: %s", root, e)
                    self.prefix_cache.clear()
                    histories = 0
                finally:
                    rt.reset()
        if self.ngram_memory is not None and (arrays := prefix_store.read_arrays(root, key, ANSWERS)) is not None:
            try:
                answers = self.ngram_memory.load(arrays)
            except (KeyError, ValueError) as e:
                log.warning("prompt lookup's memory of answers under %s not used: %s", root, e)
        return Kept(histories, answers)

    def _state_key(self) -> str:
        ident = self.models.target.state_identity()
        ident["exact"] = self.cfg.runtime.exact
        return prefix_store.fingerprint(ident)

    # -- several requests at once ------------------------------------------------------------

    @property
    def slots(self) -> int:
        """KV sequences of the target: requests that can decode together."""
        return self.models.target.n_seq

    def pick_slot(self, tokens: Sequence[int], free: Sequence[int]) -> int:
        """The free slot that loses the least history to the prompt: one whose history the prompt
        continues (a chat's next turn: an ended request's history stays in its slot while others
        run, release_slot) or an empty one; among equals, the one sharing the longest prefix, then
        the lowest number. A prefix shared with a slot that would lose more (the chat template's
        system prompt, an edited turn) is borrowed from it instead (_prepare_cache), so that
        history stays for its own next turn rather than going through the prefix cache. With an
        MTP head, slot 0 whenever it is free: only there does the head draft (the prefix cache
        restores a history anyway)."""
        if self.models.mtp_head is not None and 0 in free:
            return 0

        def fit(i: int) -> tuple[int, int, int]:
            held = self.models.target.slot(i).tokens
            shared = common_prefix(held, tokens)
            return shared - len(held), shared, -i  # (minus the tokens lost, shared, lowest number)

        return max(free, key=fit)

    def release_slot(self, slot: int, busy: Collection[int]) -> None:
        """A request in `slot` ended; `busy`: the slots still generating. While several requests
        run, idle histories stay in their slots: the next request of a busy app usually continues
        one (pick_slot finds it, nothing to read again). In the unified cache every pass attends
        over all cells in use, though (7 % for a lone request beside three idle 1,500-token
        histories, runtime.py), so once at most one request runs, every idle slot but 0 hands its
        history to the prefix cache (~8 ms for 600 tokens) and empties. Slot 0 keeps its history:
        a lone user's next turn finds it there. (A stream per slot, the default: no such cost.)"""
        if len(busy) > 1 or not self.models.target.shares_cells:
            return
        for s in range(1, self.slots):
            if s not in busy and self.models.target.slot(s).tokens:
                if self.prefix_cache is not None:
                    self.prefix_cache.stash(self.models.target.slot(s))
                self._empty(s)

    @property
    def k_limit(self) -> int:
        """The longest draft this target may verify (Config.k_limit, for its kernels: exact mode's
        decode passes on the reference ones or not)."""
        return self.cfg.k_limit(self.models.target.opts.reference_decode)

    def batch(self, prefill_chunk: int, prefill_chunk_alone: int | None = None, top_priority: int | None = None) -> Batch:
        """A driver for generations running together on this target (prompts read in chunks of
        prefill_chunk tokens beside decodes, prefill_chunk_alone alone; top_priority: the highest
        priority an earlier batch saw, Batch)."""
        return Batch(self.models.target.eval_many, self.models.target.n_batch, prefill_chunk,
                     self.cfg.max_pass_rows(self.models.target.opts.reference_decode),
                     split_steps=not self.models.target.shares_cells,
                     plan=self.controller.plan, graphs=self.models.target.graphs, prefill_chunk_alone=prefill_chunk_alone,
                     top_priority=top_priority)

    def _proposers_of(self, slot: int) -> dict[str, Proposer] | None:
        if slot == 0:
            return None  # the registry's
        if slot not in self._slot_proposers:
            self._slot_proposers[slot] = {p.name: p for p in build_proposers(self.cfg, self.models, slot, self.ngram_memory)}
        return self._slot_proposers[slot]

    def use_ngram_memory(self, memory: NgramMemory | None) -> None:
        """Prompt lookup drafts from (and remembers into) `memory` from now on, in every slot:
        the bench gives each arm its own, as each llama-server it runs beside has its own."""
        self.ngram_memory = memory
        for p in [*self.controller.proposers.values(), *(p for s in self._slot_proposers.values() for p in s.values())]:
            if isinstance(p, NgramProposer):
                p.memory = memory

    def available_modes(self) -> list[Mode]:
        """auto, off, and a fixed mode per proposer loaded now, in Mode's order."""
        return [m for m in Mode if m in (Mode.AUTO, Mode.OFF) or m.value in self.controller.proposers]

    def check_mode(self, mode: Mode | str) -> None:
        if mode not in self.available_modes():
            have = ", ".join(m.value for m in self.available_modes())
            raise UnknownMode(f"speculation mode {str(mode)!r} is not available here (available: {have})")

    def generate(self, tokens: Sequence[int], req: GenerationRequest) -> Generation:
        """One generation by itself, in slot 0."""
        stats = GenerationStats()
        events = self.engine.generate(tokens, self._params(req), req.max_tokens, req.stop, stats=stats, **self._setup(tokens, req, 0))
        return Generation(events, stats)

    def steps(self, tokens: Sequence[int], req: GenerationRequest, slot: int, stats: GenerationStats) -> Steps:
        """The same generation in `slot`, as the coroutine a Batch drives (engine.Engine.steps)."""
        engine = Engine(self.models.target.slot(slot))
        return engine.steps(tokens, self._params(req), req.max_tokens, req.stop, stats=stats, **self._setup(tokens, req, slot))

    def _params(self, req: GenerationRequest) -> SamplingParams:
        """The request's sampling, with the infill sampler bound to this target's vocabulary."""
        return replace(req.params, infill=self._infill_vocab) if req.infill else req.params

    @functools.cached_property
    def _infill_vocab(self) -> InfillVocab:
        t = self.models.target
        # A token's text is looked up when it is first a candidate (~4 µs through ctypes), then kept.
        return InfillVocab(piece=functools.lru_cache(maxsize=None)(t.piece), is_eog=t.is_eog, eot=t.eot_id)

    def _setup(self, tokens: Sequence[int], req: GenerationRequest, slot: int) -> dict[str, Any]:
        """Check the request, build its policy and grammar, make its slot's cache ready."""
        self.check_mode(req.mode)
        check_logit_bias(req.params, self.models.target.n_vocab)
        k = self.cfg.speculation.k if req.k is None else req.k
        if self.cfg.runtime.exact:
            k = min(k, self.k_limit)  # a longer pass would not be batch-invariant
        # Until warm-up has measured the costs, plain decoding is the safe choice for auto.
        mode = Mode.OFF if req.mode == Mode.AUTO and not self.controller.cost.calibrated() else req.mode
        try:
            policy = make_policy(mode, k, self.controller, self._proposers_of(slot))
        except KeyError as e:  # a fixed mode whose proposer this slot lacks (the MTP head: slot 0)
            raise UnknownMode(f"speculation mode {str(mode)!r} is not available while other requests run ({e.args[0]})") from None
        target = self.models.target
        # Jump-forward tokens are drafts too: no longer than the longest verify pass allowed.
        grammar = Grammar(req.grammar, target.grammar_tokenizer(), target.n_vocab, self.k_limit) if req.grammar else None
        self._prepare_cache(tokens, slot)
        return {"policy": policy, "grammar": grammar, "logprobs": req.logprobs}


def check_logit_bias(params: SamplingParams, n_vocab: int) -> None:
    """The bias names tokens of this target's vocabulary (known only once it is loaded)."""
    bad = [t for t, _ in params.logit_bias if t >= n_vocab]
    if bad:
        raise UserError(f"logit_bias: token id {bad[0]} is not in the vocabulary (ids 0..{n_vocab - 1})", param="logit_bias")
