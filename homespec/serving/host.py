"""A loaded, warmed-up model set with its controller: what `run`, `bench` and the daemon drive.

Warm-up does two jobs: it touches the weights (the first pass after an mmap load pays the page
faults) and it calibrates the controller's cost model by timing the target over n = 1..k_max + 1
tokens and each model proposer (draft, MTP head) over the steps it drafts.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from homespec.config import Config
from homespec.speculation.controller import Controller, calibrate, make_policy
from homespec.speculation.engine import Event, GenerationStats
from homespec.errors import UserError
from homespec.models.loader import ModelSet, load_model_set
from homespec.llama.prefix_cache import PrefixCache
from homespec.speculation.sampling import SamplingParams

_GREEDY = SamplingParams()

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
    mode: str = "auto"  # auto | draft | ngram | mtp | off
    k: int | None = None  # fixed modes; None = config's speculation.k


@dataclass
class Generation:
    """An iterable of engine events with live stats; close() stops it at the next step."""

    events: Iterator[Event]
    stats: GenerationStats = field(default_factory=GenerationStats)
    mode: str = "auto"

    def __iter__(self) -> Iterator[Event]:
        return self.events

    def close(self) -> None:
        close = getattr(self.events, "close", None)
        if close:
            close()


class Session:
    def __init__(self, cfg: Config, models: ModelSet) -> None:
        self.cfg = cfg
        self.models = models
        spec = cfg.speculation
        names = list(models.engine.proposers)
        ngram = models.engine.proposers.get("ngram")
        self.controller = Controller(
            names,
            spec.controller,
            k_max=min(spec.k_max, models.target.n_ctx - 1),
            ngram_min=spec.ngram.n_min,
            ngram_peek=getattr(ngram, "match", None),
            lag=self._lag,
        )
        self.warmup_s = 0.0
        self.calibration: dict[str, dict[int, float]] = {}
        self.prefix_cache = PrefixCache(cfg.memory.prefix_cache_mib * 2**20) if cfg.runtime.prefix_reuse else None

    def _lag(self, proposer: str, context: Sequence[int]) -> int:
        lag = getattr(self.models.engine.proposers.get(proposer), "lag", None)
        return lag(context) if lag else 0

    @classmethod
    def open(
        cls, cfg: Config, *, calibrate: bool = True, with_draft: bool = True, n_ctx: int | None = None
    ) -> "Session":
        session = cls(cfg, load_model_set(cfg, with_draft=with_draft, n_ctx=n_ctx))
        if calibrate:
            session.warmup()
        return session

    # -- shedding the draft under memory pressure -----------------------------------------------

    def unload_draft(self) -> None:
        """Free the draft model; speculation continues with the other proposers (or off)."""
        self.models.unload_draft()
        self.controller.proposers = [p for p in self.controller.proposers if p != "draft"]

    def reload_draft(self) -> None:
        """Load the configured draft back (headroom returned) and hand it to the controller,
        whose measured draft costs are kept from before."""
        self.models.load_draft(self.cfg)
        if self.models.draft is not None and "draft" not in self.controller.proposers:
            self.controller.proposers.append("draft")
            self.controller.last_tried.setdefault("draft", self.controller.step_no)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.models.close()

    # -- warm-up -----------------------------------------------------------------------------

    def warmup(self) -> None:
        """Touch the weights and calibrate the controller (a few seconds on a CPU)."""
        t0 = time.perf_counter()
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
        samples = calibrate(self.controller, time_target, passes=self.cfg.speculation.controller.warmup_passes)
        self.calibration["target"] = samples
        draft = self.models.draft
        if draft is not None:
            self._calibrate_draft(draft, ctx, probe)
        if "mtp" in self.models.engine.proposers:
            self._calibrate_mtp(self.models.engine.proposers["mtp"], ctx, probe)
        target.reset()  # the first request should not find warm-up text in the cache
        if draft is not None:
            draft.reset()
        self.warmup_s = time.perf_counter() - t0
        log.info(
            "warm-up %.1f s: target pass 1 token %.0f ms, %d tokens %.0f ms%s",
            self.warmup_s,
            samples[1] * 1000,
            max(samples),
            samples[max(samples)] * 1000,
            "".join(f"; {p} {c[1] * 1000:.1f} ms/token" for p, c in self.calibration.items() if p != "target"),
        )

    def _calibrate_draft(self, draft, ctx: list[int], probe: list[int]) -> None:
        """The draft's cost per proposed token (one-token passes) and per caught-up token (a batch)."""
        draft.sync(ctx)
        dbase = len(draft.tokens)
        times = []
        for i in range(1 + self.cfg.speculation.controller.warmup_passes * 2):
            t = time.perf_counter()
            draft.eval(probe[i : i + 1], output="last")
            times.append(time.perf_counter() - t)
        draft.truncate(dbase)
        per_token = statistics.median(times[1:])
        t = time.perf_counter()
        draft.eval(probe, output="none")  # a catch-up batch: prefill speed
        catchup = (time.perf_counter() - t) / len(probe)
        draft.truncate(dbase)
        self._set_cost("draft", per_token, catchup, len(probe))

    def _calibrate_mtp(self, mtp, ctx: list[int], probe: list[int]) -> None:
        """The head's cost per proposed token, as a step drafts (one real entry rebuilt, then
        its own predictions fed forward), and per entry rebuilt after sitting steps out."""
        target = self.models.target
        base = len(target.tokens)
        context = [*ctx, probe[0]]  # the target holds ctx = context[:-1], as between steps
        rng = np.random.default_rng(0)
        first = mtp.propose(context, 1, _GREEDY, rng)  # builds the window: a catch-up
        built = max(first.info.get("catchup_tokens", 0.0), 1.0)
        k = max(1, min(4, self.controller.k_max))
        times = []
        for _ in range(1 + self.cfg.speculation.controller.warmup_passes * 2):
            # A target pass in between, as in a real step: back to back the head measured ~25%
            # cheaper (4.4 against 5.7 ms a token: warm caches and thread pools).
            target.eval(probe[:1], output="last")
            target.truncate(base)
            times.append(mtp.propose(context, k, _GREEDY, rng).draft_s)
        self._set_cost("mtp", statistics.median(times[1:]) / k, first.draft_s / built, int(built))

    def _set_cost(self, proposer: str, per_token: float, catchup: float, n_catchup: int) -> None:
        self.controller.cost.propose_s[proposer] = per_token
        self.controller.cost.catchup_s[proposer] = catchup
        self.calibration[proposer] = {1: per_token, n_catchup: catchup * n_catchup}

    # -- generation --------------------------------------------------------------------------

    def _prepare_cache(self, tokens: Sequence[int]) -> None:
        """Prefix reuse: the best saved conversation goes live; or, with reuse off, start cold."""
        if self.prefix_cache is not None:
            self.prefix_cache.prepare(self.models.target, tokens)
            return
        self.models.target.reset()
        if self.models.draft is not None:
            self.models.draft.reset()

    def check_mode(self, mode: str) -> None:
        if mode in ("auto", "off"):
            return
        if mode not in self.models.engine.proposers:
            have = ", ".join(["auto", "off", *sorted(self.models.engine.proposers)])
            raise UnknownMode(f"speculation mode {mode!r} is not available here (available: {have})")

    def generate(self, tokens: Sequence[int], req: GenerationRequest) -> Generation:
        self.check_mode(req.mode)
        k = self.cfg.speculation.k if req.k is None else req.k
        # Until warm-up has measured the costs, plain decoding is the safe choice for auto.
        mode = "off" if req.mode == "auto" and not self.controller.cost.calibrated() else req.mode
        policy = make_policy(mode, k, self.controller)
        self.controller.sampled = not req.params.greedy
        self._prepare_cache(tokens)
        stats = GenerationStats()
        events = self.models.engine.generate(tokens, req.params, req.max_tokens, req.stop, policy, stats)
        return Generation(events, stats, req.mode)


def request_from_args(cfg: Config, args: argparse.Namespace) -> GenerationRequest:
    """CLI flags over config defaults (flags left unset keep the config's value)."""
    s = cfg.sampling

    def pick(name: str, default):  # noqa: ANN001 - plain passthrough
        v = getattr(args, name, None)
        return default if v is None else v

    try:
        params = SamplingParams(
            temperature=pick("temperature", s.temperature),
            top_p=pick("top_p", s.top_p),
            top_k=pick("top_k", s.top_k),
            min_p=pick("min_p", s.min_p),
            repetition_penalty=s.repetition_penalty,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            seed=pick("seed", None),
        )
    except ValueError as e:
        raise UserError(str(e)) from None
    return GenerationRequest(
        params=params,
        max_tokens=pick("max_tokens", s.max_tokens),
        mode=pick("mode", cfg.speculation.mode),
        k=pick("k", None),
    )
