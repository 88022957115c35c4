"""The generation loop: prefill, then speculative steps until a stop condition.

The engine speaks tokens. It does not know about HTTP, chat templates or how the proposer and k
are chosen: a `SpeculationPolicy` decides each step, and is told what happened.

One step (DESIGN.md, "the four phases"), with ctx the committed tokens, whose last token the
target has not evaluated yet:

    proposal = proposer.propose(ctx, k)                  # d_1..d_k'   (k' <= k)
    logits   = target.eval([ctx[-1]] + d_1..d_k')         # [k' + 1, vocab] in one pass
    verdict  = verify(d, target view of logits, q)        # n accepted + 1 bonus
    target.truncate(len(ctx) + n)                         # drop the rejected tail
    ctx     += d_1..d_n + [bonus]

So the target's KV cache always holds ctx[:-1], also between steps and after a cancelled
generation; proposers resynchronise from ctx themselves. k = 0 is plain decoding through the
same code (one pass over the last token).

Constraints: with a grammar (constraints.py), every row's logits are masked by the grammar
state after the tokens before it, drafts are cut where they leave the grammar, and a step whose
next tokens the grammar forces verifies those instead of asking the policy (jump-forward: its
proposer is FORCED and no proposer runs).

Passes: the loop yields each target pass (`Pass`) instead of running it, and gets the logits
back, and so does a draft model's proposal for each of its passes (SteppedProposer); `run_alone`
runs them at once, batch.py packs the passes of several generations into one llama_decode (the
draft's into one of the draft's context). Either way a generation's tokens are decided from its
own rows.

Randomness: an unseeded request verifies with Leviathan's rule (rejection_verify) and one rng. A
seeded one draws the token at each context index from keys derived from (seed, index) alone
(seeded_verify), so its output is the same whichever proposer and k the policy picks: auto mode
is reproducible. The price is acceptance: a draft raced against the same keys is accepted
1-4 points less often than under Leviathan's rule (measured in verify.py's docstring).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Hashable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

import numpy as np

from homespec.speculation.constraints import Grammar, apply_masks
from homespec.speculation.proposers.base import Proposal, ProposalInfo, Proposer, SteppedProposer
from homespec.speculation.sampling import (
    SamplingParams,
    TokenLogprob,
    argmax_gaps,
    choose,
    make_rng,
    position_keys,
    target_view,
    token_logprobs,
    window,
)
from homespec.speculation.target import Pass, Target
from homespec.speculation.textstream import TextStream
from homespec.speculation.verify import Verdict, greedy_verify, rejection_verify, seeded_verify
from homespec.tokens import common_prefix

OFF = "off"  # the proposer name of a k = 0 step (plain decoding)
FORCED = "grammar"  # the proposer name of a jump-forward step: the grammar's only continuation
# The finish reason of an answer its grammar left with no way on before it was complete (a
# schema that never ends): not "stop", which would pass its unfinished text off as whole. The
# daemon's 400 for it carries the same code.
GRAMMAR_DEAD_END = "grammar_dead_end"


@dataclass(frozen=True)
class StepStats:
    proposer: str  # the proposer's name, or OFF (plain decoding)
    k: int  # draft length asked for
    proposed: int  # tokens actually proposed (<= k; ngram may find fewer)
    accepted: int  # proposed tokens kept
    draft_s: float  # seconds proposing
    verify_s: float  # seconds in the target pass + verification
    outcomes: tuple[bool, ...] = ()  # per tested position: accepted?
    info: ProposalInfo = ProposalInfo()  # the proposal's evidence and catch-up
    # The target pass this step was verified in: its rows (other requests' rows included when
    # batched) and its seconds — what the cost model learns t_verify(n) from. 0: proposed + 1
    # rows in verify_s (a pass of its own).
    pass_rows: int = 0
    pass_s: float = 0.0
    timed: bool = True  # False: the pass also read prompts, its time is no verify cost

    @property
    def emitted(self) -> int:
        return self.accepted + 1

    @property
    def seconds(self) -> float:
        return self.draft_s + self.verify_s


class Beside(NamedTuple):
    """What a batch driver tells a generation of the next pass, besides its own rows."""

    rows: int = 0  # the other requests' rows
    # The driver plans the pass for all its requests at once: ask it (`Ask`) rather than decide.
    joint: bool = False


@dataclass
class Ask:
    """A generation's next step, offered to the batch driver to decide with the others in the
    pass (SpeculationPolicy.offer, Controller.plan): send back a Decision, or a Beside to decide
    alone after all."""

    offer: object  # the policy's offer, opaque to the engine and the driver
    target: Target  # the sequence the step will run in (where its rows go in the pass)


@dataclass(frozen=True)
class Decision:
    proposer: Proposer | None  # None: plain decoding
    k: int

    @property
    def name(self) -> str:
        return self.proposer.name if self.proposer is not None and self.k > 0 else OFF


class SpeculationPolicy(Protocol):
    def begin(self, prompt: Sequence[int], sampled: bool, alongside: int = 0, tokens_left: int | None = None) -> list[Proposer]:
        """A generation over `prompt` starts (sampled: temperature > 0; alongside: as decide's,
        for its first step; tokens_left: the most tokens it may still emit): returns the
        proposers worth prefilling with it (the others catch up when first used)."""
        ...

    def decide(self, context: Sequence[int], alongside: int = 0) -> Decision:
        """The next step's proposer and k. alongside: rows other requests bring to the same
        target pass (batch.py, when it does not plan the pass: `offer`), so that this request's
        rows cost only what they add."""
        ...

    def offer(self, context: Sequence[int]) -> object | None:
        """What the next step could do, for a driver that decides the steps of several requests
        at once (Ask); None: this policy decides for itself."""
        ...

    def observe(self, step: StepStats) -> None: ...

    def end(self, context: Sequence[int], gaps: Sequence[float] = ()) -> None:
        """The generation ended with `context` (prompt + answer), having begun (it answered more
        than its first token), and its answer is greedy: what a later request with the same
        prompt and the same shaping (`shaping`) will be told again. gaps: [len(answer)] each
        answer token's argmax gap (sampling.argmax_gaps), or () when not known. The proposers
        keep what helps later ones (Proposer.end)."""
        ...


def shaping(params: SamplingParams, grammar: Grammar | None) -> Hashable:
    """What besides the prompt decides a greedy answer: the logit bias, the penalties (when they
    are on) and the grammar; () when nothing does (the target's own argmax). The same prompt
    under another shaping is another question: prompt lookup's memory files an answer under both
    (Proposer.begin). Jump-forward is not in it: forced tokens are verified like drafts."""
    penalties = (
        (params.repetition_penalty, params.presence_penalty, params.frequency_penalty, params.penalty_last_n)
        if params.has_penalties else ()
    )
    if not params.logit_bias and not penalties and grammar is None:
        return ()
    return (params.logit_bias, penalties, grammar.source if grammar is not None else None)


class FixedPolicy:
    """Always the same proposer and k (k = 0 or no proposer: plain decoding)."""

    def __init__(self, proposer: Proposer | None = None, k: int = 0) -> None:
        on = proposer is not None and k > 0
        self.decision = Decision(proposer if on else None, k if on else 0)

    def begin(self, prompt: Sequence[int], sampled: bool, alongside: int = 0, tokens_left: int | None = None) -> list[Proposer]:
        p = self.decision.proposer
        return [p] if p is not None else []

    def decide(self, context: Sequence[int], alongside: int = 0) -> Decision:
        return self.decision

    def offer(self, context: Sequence[int]) -> object | None:
        return None  # nothing to plan: its steps are fixed

    def observe(self, step: StepStats) -> None:
        pass

    def end(self, context: Sequence[int], gaps: Sequence[float] = ()) -> None:
        if self.decision.proposer is not None:
            self.decision.proposer.end(context, gaps)


@dataclass
class StepTally:
    """Sums over steps — what a request's stats, a bench arm and the live window all report."""

    steps: int = 0
    spec_steps: int = 0  # steps that proposed at least one token
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0  # accepted + one bonus per step (before stop truncation)
    draft_s: float = 0.0
    verify_s: float = 0.0
    by_choice: dict[str, int] = field(default_factory=dict)  # "ngram:4" -> steps
    pos_hits: list[int] = field(default_factory=list)  # [k] accepted at draft position i
    pos_tries: list[int] = field(default_factory=list)  # [k] reached at draft position i

    def add(self, s: StepStats) -> None:
        self.steps += 1
        self.spec_steps += s.proposed > 0
        self.proposed += s.proposed
        self.accepted += s.accepted
        self.emitted += s.emitted
        self.draft_s += s.draft_s
        self.verify_s += s.verify_s
        key = f"{s.proposer}:{s.k}"
        self.by_choice[key] = self.by_choice.get(key, 0) + 1
        for i, ok in enumerate(s.outcomes):
            if i == len(self.pos_tries):
                self.pos_hits.append(0)
                self.pos_tries.append(0)
            self.pos_tries[i] += 1
            self.pos_hits[i] += ok

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens emitted per step (>= 1)."""
        return self.emitted / self.steps if self.steps else None

    @property
    def position_acceptance(self) -> list[float]:
        """Per draft position: P(accepted | reached)."""
        return [h / t for h, t in zip(self.pos_hits, self.pos_tries) if t]


@dataclass
class GenerationStats(StepTally):
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV cache was reused from before
    completion_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0  # time to first token (prefill + first sample)
    total_s: float = 0.0
    finish_reason: str | None = None
    stop_word: str | None = None  # the stop string that ended the answer (finish "stop"), if one did

    @property
    def decode_tps(self) -> float | None:
        """Output tokens per second after the first token."""
        dt = self.total_s - self.ttft_s
        return (self.completion_tokens - 1) / dt if dt > 0 and self.completion_tokens > 1 else None


@dataclass
class Event:
    text: str  # new text, safe to show (stop strings and split characters held back)
    tokens: list[int]  # new tokens, counted in usage
    step: StepStats | None  # the step that produced them (None: the first token, from prefill)
    finish_reason: str | None = None  # "stop" | "length" | "context" | GRAMMAR_DEAD_END; None = more to come
    # With logprobs asked for: one per token whose text this event shows (not one per `tokens`:
    # text held back for a possible stop string brings its tokens' logprobs when it is shown,
    # and a stop string's own tokens and EOS are never shown).
    logprobs: list[TokenLogprob] = field(default_factory=list)


Steps = Generator["Event | Pass | Ask", "np.ndarray | Beside | Decision | None", None]  # the engine's coroutine


def run_alone(steps: Steps) -> Iterator[Event]:
    """Drive one generation by itself: each pass runs at once; events go to the caller.
    Closing the iterator closes the generation (its caches stay consistent)."""
    reply: np.ndarray | None = None
    try:
        while True:
            item = steps.send(reply)
            if isinstance(item, Pass):
                reply = item.run()
            elif isinstance(item, Ask):  # (not asked for: no pass of several to plan)
                reply = Beside()
            else:
                reply = None
                yield item
    except StopIteration:
        return
    finally:
        steps.close()


class PromptTooLong(ValueError):
    def __init__(self, n_prompt: int, n_ctx: int) -> None:
        super().__init__(f"prompt has {n_prompt} tokens; the context holds {n_ctx} (at least 1 must remain for the answer)")
        self.n_prompt, self.n_ctx = n_prompt, n_ctx


class Engine:
    """Drives one target (a KV sequence) through generations; the policy brings the proposers.
    `generate` runs one by itself; `steps` hands its passes to a driver that batches several
    engines' generations (batch.py)."""

    def __init__(self, target: Target) -> None:
        self.target = target

    def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams = SamplingParams(),
        max_tokens: int = 256,
        stop: Sequence[str] = (),
        policy: SpeculationPolicy | None = None,
        stats: GenerationStats | None = None,
        grammar: Grammar | None = None,
        logprobs: int | None = None,
    ) -> Iterator[Event]:
        """Yield events until EOS, a stop string, max_tokens or a full context.
        grammar: constrains every token (constraints.py); None: unconstrained.

        logprobs: None, or report each shown token's log-probability (sampling.token_logprobs)
        with that many likeliest alternatives, read from the rows that verified it.

        The generator may be closed at any event (a client went away): the caches stay
        consistent and the next generation reuses them.
        """
        return run_alone(self.steps(prompt, params, max_tokens, stop, policy, stats, grammar, logprobs))

    def steps(
        self,
        prompt: Sequence[int],
        params: SamplingParams = SamplingParams(),
        max_tokens: int = 256,
        stop: Sequence[str] = (),
        policy: SpeculationPolicy | None = None,
        stats: GenerationStats | None = None,
        grammar: Grammar | None = None,
        logprobs: int | None = None,
    ) -> Steps:
        """The same generation as a coroutine that yields its target passes (`Pass`: send back
        the logits) as well as its events (send back what other generations bring to the
        next pass, `Beside`, or None) — for a driver that batches several generations (batch.py)."""
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) >= self.target.n_ctx:
            raise PromptTooLong(len(prompt), self.target.n_ctx)
        policy = policy or FixedPolicy()
        st = stats if stats is not None else GenerationStats()
        return self._run(list(prompt), params, max_tokens, stop, policy, st, grammar, logprobs)

    def _run(
        self,
        ctx: list[int],
        params: SamplingParams,
        max_tokens: int,
        stop: Sequence[str],
        policy: SpeculationPolicy,
        st: GenerationStats,
        grammar: Grammar | None,
        top: int | None,
    ) -> Steps:
        t_start = time.perf_counter()
        rng = make_rng(params.seed)
        st.prompt_tokens = len(ctx)
        st.cached_tokens = min(common_prefix(self.target.tokens, ctx), len(ctx) - 1)
        self.target.truncate(st.cached_tokens)  # Target.sync, as a pass a driver may batch
        logits = yield Pass(self.target, ctx[st.cached_tokens :], "last")  # [1, vocab] after the prompt
        st.prefill_s = time.perf_counter() - t_start
        prompt = list(ctx)
        if grammar is not None:
            logits = apply_masks(logits, grammar.masks([]))
        first = choose(logits[0], params, window(ctx, params), rng, position=len(ctx))
        st.ttft_s = time.perf_counter() - t_start
        text = TextStream(self.target.piece, stop)
        out = _Emitter(self.target, text, max_tokens, st)

        lps = token_logprobs(logits[:1], params, ctx, [first], top) if top is not None else None
        event = out.emit(ctx, [first], None, lps)
        # Where the answer was a near-tie (sampling.argmax_gaps), for what remembers it: known for
        # greedy answers read off the raw rows; None when a bias or penalty shifted them.
        gaps: list[np.ndarray] | None = [argmax_gaps(logits, event.tokens)] if params.greedy and not params.shifts_logits else None
        if grammar is not None:
            grammar.commit(event.tokens)
        while True:
            if event.finish_reason is None and len(ctx) >= self.target.n_ctx:
                event.finish_reason = st.finish_reason = "context"
            if event.finish_reason is not None:
                out.finish(event)
                st.total_s = time.perf_counter() - t_start
                if not prompt and params.greedy:  # begun (after the first token), and the answer its question gets again
                    policy.end(ctx, np.concatenate(gaps) if gaps is not None else ())
                yield event
                return
            beside = (yield event) or Beside()
            alongside = beside.rows
            if prompt:  # the first token is out: a draft's prefill of the prompt is not in its TTFT
                left = max_tokens - st.completion_tokens
                for proposer in policy.begin(prompt, not params.greedy, alongside, tokens_left=left):
                    proposer.begin(prompt, shaping(params, grammar))
                prompt = []
            room = self.target.n_ctx - len(ctx) - 1  # a step may grow ctx by k + 1 <= n_ctx
            budget = max(0, min(room, max_tokens - st.completion_tokens - 1))
            forced = grammar.forced(budget) if grammar is not None else []
            if forced:  # free drafts; the policy's proposers sit this step out
                verdict, step = yield from self._step(ctx, None, len(forced), params, rng, grammar, forced)
            else:
                decision = yield from self._decide(policy, ctx, beside)
                k = min(decision.k, budget)
                verdict, step = yield from self._step(ctx, decision.proposer if k else None, k, params, rng, grammar)
            policy.observe(step)
            st.add(step)
            lps = None
            if top is not None and verdict.rows is not None:
                lps = token_logprobs(verdict.rows, params, ctx, verdict.tokens, top)
            event = out.emit(ctx, verdict.tokens, step, lps)
            if gaps is not None and verdict.rows is not None:
                gaps.append(argmax_gaps(verdict.rows, event.tokens))
            if grammar is not None:
                grammar.commit(event.tokens)
                if event.finish_reason == "stop" and grammar.dead_end:  # not complete: it could not go on
                    event.finish_reason = st.finish_reason = GRAMMAR_DEAD_END

    def _decide(self, policy: SpeculationPolicy, ctx: list[int], beside: Beside) -> Generator[Ask, object, Decision]:
        """The next step's proposer and k: the driver's, planned with the other requests in the
        pass (beside.joint, when the policy offers one), else the policy's own."""
        offer = policy.offer(ctx) if beside.joint else None
        if offer is not None:
            got = yield Ask(offer, self.target)
            if isinstance(got, Decision):
                return got
            beside = got if isinstance(got, Beside) else Beside(beside.rows)
        return policy.decide(ctx, beside.rows)

    def _step(
        self,
        ctx: list[int],
        proposer: Proposer | None,
        k: int,
        params: SamplingParams,
        rng: np.random.Generator,
        grammar: Grammar | None = None,
        forced: Sequence[int] = (),
    ) -> Generator[Pass, np.ndarray, tuple[Verdict, StepStats]]:
        """One speculative step over ctx (not modified here); k = 0 or no proposer: plain.
        forced: the grammar's jump-forward tokens, verified in place of a proposal."""
        if forced:
            proposal, name = Proposal(list(forced)), FORCED
        elif isinstance(proposer, SteppedProposer):  # its passes go through the driver (batch.py)
            proposal, name = (yield from proposer.propose_steps(ctx, k, params, rng)), proposer.name
        else:
            proposal = proposer.propose(ctx, k, params, rng) if proposer is not None else Proposal([])
            name = proposer.name if proposer is not None else OFF
        d = proposal.tokens[:k]
        if grammar is not None:
            # Only an unseeded sampled draft with a real q must keep its first invalid token.
            d = grammar.cut(d, keep_first_invalid=not params.greedy and params.seed is None and proposal.q is not None)
        t0 = time.perf_counter()
        verify = Pass(self.target, [ctx[-1], *d], "all")
        logits = yield verify  # [len(d) + 1, vocab]
        if grammar is not None:
            logits = apply_masks(logits, grammar.masks(d))
        view = target_view(logits, params, ctx, d)  # argmax [n] or probabilities [n, vocab]
        if params.greedy:
            verdict = greedy_verify(d, view)
        elif params.seed is not None:  # reproducible for every proposer and k (module docstring)
            keys = np.stack([position_keys(params.seed, len(ctx) + i, view.shape[1]) for i in range(len(d) + 1)])
            verdict = seeded_verify(d, view, keys)  # keys: [len(d) + 1, vocab]
        else:
            verdict = rejection_verify(d, view, proposal.q, rng)
        self.target.truncate(len(ctx) + verdict.accepted)
        verdict = replace(verdict, rows=logits[: verdict.accepted + 1])  # what logprobs read
        verify_s = time.perf_counter() - t0
        step = StepStats(name, k, len(d), verdict.accepted, proposal.draft_s, verify_s, tuple(verdict.outcomes),
                         proposal.info, verify.rows, verify.seconds, verify.timed)
        return verdict, step


class _Emitter:
    """Appends verified tokens to ctx and applies the stop conditions, token by token; hands
    out each token's logprob with the text it shows."""

    def __init__(self, target: Target, text: TextStream, max_tokens: int, st: GenerationStats) -> None:
        self.target, self.text, self.max_tokens, self.st = target, text, max_tokens, st
        self.shown = 0  # characters of text handed out so far
        self.pending: list[tuple[int, int, TokenLogprob]] = []  # (start, end) of a token's text, its logprob

    def emit(self, ctx: list[int], tokens: list[int], step: StepStats | None, lps: list[TokenLogprob] | None = None) -> Event:
        ev = Event("", [], step)
        for i, tok in enumerate(tokens):
            ctx.append(tok)
            ev.tokens.append(tok)
            self.st.completion_tokens += 1
            if self.target.is_eog(tok):
                ev.finish_reason = "stop"
                break
            start = self.text.decoded
            ev.text += self.text.push(tok)
            if lps is not None:
                self.pending.append((start, self.text.decoded, lps[i]))
            if self.text.stopped:
                ev.finish_reason = "stop"
                self.st.stop_word = self.text.stop_matched
                break
            if self.st.completion_tokens >= self.max_tokens:
                ev.finish_reason = "length"
                break
        if ev.finish_reason:
            self.st.finish_reason = ev.finish_reason
            # Tokens after the stop are dropped; the target cache must not hold them either.
            self.target.truncate(min(len(self.target.tokens), len(ctx) - 1))
        self._release(ev, len(ev.text), final=False)
        return ev

    def finish(self, ev: Event) -> None:
        """The last event: release the text held back for stop strings, and its logprobs."""
        tail = self.text.flush()
        ev.text += tail
        self._release(ev, len(tail), final=True)

    def _release(self, ev: Event, added: int, final: bool) -> None:
        """ev shows `added` more characters: move to it the logprobs of the tokens whose text is
        now shown in full — or, at the end, shown at all (a token cut by a stop string shows
        only its text before the stop)."""
        self.shown += added
        n = 0
        while n < len(self.pending) and self.pending[n][1] <= self.shown:
            n += 1
        if final:
            while n < len(self.pending) and self.pending[n][0] < self.shown:
                n += 1
            ev.logprobs += [lp for _, _, lp in self.pending[:n]]
            self.pending = []
            return
        ev.logprobs += [lp for _, _, lp in self.pending[:n]]
        del self.pending[:n]

