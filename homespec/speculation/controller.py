"""Adaptive speculation: pick the proposer and k that maximise measured goodput, k = 0 included.

Each step, for every candidate c = (proposer, k):

    E[emitted | c] = 1 + sum_{j=1..k} prod_{i=1..j} a_i          (a_i: P(position i accepted |
                                                                    positions < i accepted))
    E[seconds | c] = t_verify(k + 1) + t_propose(proposer, k)
    rate(c)        = E[emitted | c] / E[seconds | c]               tokens per second

and plain decoding is the candidate (none, 0) with rate 1 / t_verify(1). The controller picks the
highest rate, but speculation only when it beats plain by `min_gain` (speculation has variance
and small costs the model does not see).

Everything on the right-hand side is measured on this machine, not assumed:
- t_verify(n): the target's pass over n tokens, timed at warm-up for n = 1..k_max + 1 and
  updated from every live step (EWMA). A 2-core CPU is compute-bound (a pass over 5 tokens costs
  ~3x one), so the best k is small or 0; a GPU's flat curve makes large k pay.
- t_propose: seconds per proposed token for the draft model / MTP head (EWMA of live steps,
  catch-up batches excluded); ngram costs microseconds.
- a_i: per proposer, an EWMA of the outcome at each position, updated after every step; for
  ngram additionally keyed by the match's length (a 5-token match predicts far better than a
  2-token one) and by whether it copies the prompt or repeats the answer (an edit copying its
  input keeps ~13 of 16 tokens; prose repeating a phrase of its own, ~4).

Earned length: within a request, a proposer may draft at most max(k0, EARNED_GROWTH x its
longest accepted run in this request) tokens, k0 being the longest draft whose verification
costs at most UNEARNED_PASSES single passes. The acceptance estimates pool many requests, and requests differ
most exactly where a long draft is at stake: the same 6-token ngram match that an edit copies in
full, a chat answer leaves after one token. On 2 cores a 16-token draft rejected early costs ~6
passes; capped (k0 = 4-5 there), the loss is at most 3, while a real copy reaches k = 16 by its
second or third step. On a GPU's flat cost curve k0 is k_max: there a long draft risks little.

Exploration: a proposer that is never chosen is never measured, so a change of workload (prose
to code) would go unnoticed. A proposer not tried for `explore_every` steps gets one probe step,
but only while the time lost to probes stays under EXPLORE_BUDGET of the recent total — a bound
on what exploration can cost. A probe that finds the proposer still not paying doubles its
interval (up to MAX_BACKOFF doublings), so a proposer that loses on this workload costs ever
less, yet is retried within a bounded number of steps. The rule uses no randomness: the same
observations give the same decisions.

How this differs from transformers' assisted generation (`num_assistant_tokens` +2 on full
acceptance, -1 otherwise): that heuristic targets acceptance and ignores cost, so on a CPU it
happily speculates at a loss; here the objective is tokens per second and k = 0 is a candidate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np

from homespec.config import ControllerConfig
from homespec.speculation.engine import PLAIN, Decision, FixedPolicy, SpeculationPolicy, StepStats
from homespec.speculation.costs import AcceptanceModel, CostModel, expected_emitted
from homespec.speculation.proposers.ngram import MATCH_CAP, Match

# Share of recent generation time that probing unprofitable proposers may cost at most, over
# an exponential window of BUDGET_WINDOW steps (~50 s of generation on 2 cores).
EXPLORE_BUDGET = 0.03
BUDGET_WINDOW = 512
_BUDGET_DECAY = 1.0 - 1.0 / BUDGET_WINDOW
# Probes move the estimate faster than regular steps: a probe is rare, so each must count.
PROBE_EWMA = 0.35
# Probe only a proposer that would pay at this acceptance at every position: one that needs every
# single token accepted cannot repay its probes (the 0.5B draft on 2 cores: ~1.07x at 100 %, a
# loss at 90 %; its probes, with their catch-up, cost ~4 % of chat generation time in the bench).
PROBE_ACCEPTANCE = 0.9
# What a draft a request has not earned yet may cost to verify, in single target passes (see
# the docstring): bounds the loss of a long draft that this request's text does not support.
UNEARNED_PASSES = 3.0
# Each accepted run of r tokens allows drafts of EARNED_GROWTH * r. Replayed on 46 recorded outputs
# with three measured cost curves, doubling cost edits 3-6 % against no cap; 4x stays within 2 %
# and keeps chat's gain.
EARNED_GROWTH = 4
# Failed probes stretch a proposer's probe interval to at most explore_every * 2**MAX_BACKOFF
# steps (256 at the default 32: ~25 s of generation on 2 cores).
MAX_BACKOFF = 3


class AcceptanceKey(NamedTuple):
    """What acceptance is tracked by: outcomes under the same key are alike."""

    proposer: str
    match: int = 0  # ngram: match-length bucket (match_bucket); 0 for model proposers
    from_prompt: bool = False  # ngram: the match copies the prompt rather than the answer
    sampled: bool = False  # a temperature > 0 request


def match_bucket(length: int) -> int:
    """ngram match lengths 2..7 apart, then 8-15, 16-31 and 32+ (MATCH_CAP) by their lower end:
    past a few tokens, doubling the length is what changes the odds."""
    if length < 8:
        return length
    return 8 if length < 16 else 16 if length < MATCH_CAP else MATCH_CAP


@dataclass(frozen=True)
class Candidate:
    proposer: str
    k: int
    tokens: float  # expected emitted tokens
    seconds: float  # expected step time

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ControllerView:
    """What the daemon and the dashboard show: the choice, why, and the live figures."""

    proposer: str = PLAIN
    k: int = 0
    reason: str = "not calibrated yet"
    gains: dict[str, list[float]] = field(default_factory=dict)  # proposer -> [expected rate / plain] for k = 1..
    baseline_tps: float | None = None  # plain decoding, from the cost model
    effective_tps: float | None = None  # measured: emitted / step seconds (EWMA)
    speedup: float | None = None  # effective / baseline
    chosen: dict[str, int] = field(default_factory=dict)  # "ngram:4" -> steps
    probes: int = 0


class Controller:
    """A SpeculationPolicy that learns; one instance is shared by all requests of a daemon."""

    def __init__(
        self,
        proposers: Sequence[str],
        cfg: ControllerConfig = ControllerConfig(),
        k_max: int = 16,
        ngram_min: int = 2,
        ngram_peek: Callable[[Sequence[int], int], Match] | None = None,
        lag: Callable[[str, Sequence[int]], int] | None = None,
    ) -> None:
        self.proposers = [p for p in proposers if p != PLAIN]
        self.cfg = cfg
        self.k_max = k_max
        self.cost = CostModel(k_max + 1, cfg.cost_ewma)
        self.acc = AcceptanceModel(k_max, cfg.acceptance_ewma, self._prior)
        self.ngram_min = ngram_min
        self.ngram_peek = ngram_peek  # (context, k) -> the match ngram would propose from
        self.lag = lag  # (proposer, context) -> tokens it must catch up on before proposing
        self.step_no = 0
        self.last_tried: dict[str, int] = {p: 0 for p in self.proposers}
        self.failed_probes: dict[str, int] = {}  # proposer -> probes in a row that found it not paying
        # Both over an exponential window of the last ~BUDGET_WINDOW steps: a daemon's long history
        # (or a bench's fixed arms) must not bank a budget that probes then spend in a burst.
        self.total_s = 0.0  # seconds of generation
        self.explore_s = 0.0  # seconds lost to probes (beyond what plain decoding would have taken)
        self.view = ControllerView()
        self._probing: tuple[str, int] | None = None  # (proposer, k) of a decided probe step
        self.sampled = False  # the current request samples (temperature > 0); set per request
        self.earned: dict[str, int] = {}  # proposer -> longest accepted run in the current request

    # -- SpeculationPolicy -----------------------------------------------------------------

    def proposers_used(self) -> set[str]:
        return set(self.proposers)

    def begin(self, prompt: Sequence[int]) -> set[str]:
        """A request starts: draft lengths are earned afresh. Prefill ngram (indexing the prompt
        costs ~nothing, and tells it where the prompt ends), and model proposers only while they
        pay (a draft's prefill costs TTFT for nothing otherwise); the others catch up if a probe
        picks them."""
        self.earned = {}
        plain = self._plain()
        return {
            p
            for p in self.proposers
            if p == "ngram" or self._best(p, self.k_max, self._key(p)).rate >= self.cfg.min_gain * plain.rate
        }

    def decide(self, context: Sequence[int]) -> Decision:
        self.step_no += 1
        self._probing = None
        if not self.cost.calibrated():
            return Decision(PLAIN, 0)
        plain = self._plain()
        options = self._options(context)  # proposer -> (key, k available)
        best_of = {p: self._best(p, k_avail, key) for p, (key, k_avail) in options.items()}
        best = max([plain, *best_of.values()], key=lambda c: c.rate)
        if best.proposer != PLAIN and best.rate < self.cfg.min_gain * plain.rate:
            best = plain
        reason = self._reason(best, plain)
        probe = self._probe(best, options, context)
        if probe is not None:
            reason = f"probe {probe.proposer} k={probe.k} (untried for {self.step_no - self.last_tried[probe.proposer]} steps)"
            best = probe
            self._probing = (probe.proposer, probe.k)
        self._record(best, plain, options, reason)
        if best.proposer != PLAIN:
            self.last_tried[best.proposer] = self.step_no
            if probe is None:
                self.failed_probes.pop(best.proposer, None)  # chosen on merit
        return Decision(best.proposer, best.k)

    def observe(self, step: StepStats) -> None:
        """Learn from a step — whichever policy chose it (fixed-mode requests teach too)."""
        self.cost.observe_verify(step.proposed + 1, step.verify_s)
        catchup = float(step.info.get("catchup_s", 0.0))
        if catchup:
            self.cost.observe_catchup(step.proposer, int(step.info.get("catchup_tokens", 0)), catchup)
        probing = self._probing == (step.proposer, step.k)
        self._probing = None
        self.explore_s *= _BUDGET_DECAY
        self.total_s = self.total_s * _BUDGET_DECAY + step.seconds
        if step.proposer != PLAIN and step.proposed:
            self.cost.observe_propose(step.proposer, step.proposed, max(0.0, step.draft_s - catchup))
            key = self._key(step.proposer, int(step.info.get("match_len", 0)), bool(step.info.get("from_prompt", 0)))
            self.acc.observe(key, step.outcomes, PROBE_EWMA if probing else None)
            self.earned[step.proposer] = max(self.earned.get(step.proposer, 0), step.accepted)
            if probing:  # what the probe cost beyond plain decoding of the same tokens
                self.explore_s += max(0.0, step.seconds - step.emitted * self.cost.verify(1))
                self.view.probes += 1
                pays = self._best(step.proposer, self.k_max, key).rate >= self.cfg.min_gain * self._plain().rate
                fails = 0 if pays else self.failed_probes.get(step.proposer, 0) + 1
                self.failed_probes[step.proposer] = fails
        rate = step.emitted / step.seconds if step.seconds > 0 else 0.0
        v = self.view
        v.effective_tps = rate if v.effective_tps is None else v.effective_tps + 0.05 * (rate - v.effective_tps)
        if self.cost.calibrated():  # fresh also when fixed-mode requests never call decide()
            v.baseline_tps = 1.0 / self.cost.verify(1)
        if v.baseline_tps:
            v.speedup = v.effective_tps / v.baseline_tps
        choice = f"{step.proposer}:{step.k}"
        v.chosen[choice] = v.chosen.get(choice, 0) + 1

    # -- internals -------------------------------------------------------------------------

    def _key(self, proposer: str, match_len: int = 0, from_prompt: bool = False) -> AcceptanceKey:
        """Acceptance is tracked per proposer, and for ngram per match: a 32-token match into the
        prompt means the output is copying (an edit), a 2-token match is often a coincidence, and
        a long repeat of the answer's own words (a list, a refrain) breaks off sooner than a copy.
        Sampled requests are tracked apart: a token drawn at temperature 0.8 is accepted less
        often than an argmax, and mixing the two would mislead both."""
        if proposer != "ngram":
            return AcceptanceKey(proposer, sampled=self.sampled)
        return AcceptanceKey(proposer, match_bucket(max(match_len, self.ngram_min)), from_prompt, self.sampled)

    def _prior(self, key: AcceptanceKey) -> float:
        """Acceptance assumed before any observation. For ngram it rises with the match length
        (prior p at length 2, then 1 - (1 - p) * 2 / m): long matches get tried at once, which
        is what finds an editing workload quickly; data replaces the prior within a few steps."""
        p = self.cfg.prior_acceptance
        if key.proposer == "ngram" and key.match > 2:
            return 1.0 - (1.0 - p) * 2.0 / key.match
        return p

    def _options(self, context: Sequence[int]) -> dict[str, tuple[AcceptanceKey, int]]:
        """Proposers usable now: acceptance key and the largest k each may draft (what it has,
        and what it has earned in this request)."""
        out: dict[str, tuple[AcceptanceKey, int]] = {}
        unearned = self._unearned_k()
        for p in self.proposers:
            earned = max(unearned, EARNED_GROWTH * self.earned.get(p, 0))
            if p == "ngram":
                if self.ngram_peek is None:
                    continue
                m = self.ngram_peek(context, self.k_max)
                if m.tokens:  # no match: nothing to propose
                    out[p] = (self._key(p, m.length, m.from_prompt), min(len(m.tokens), earned))
            else:
                out[p] = (self._key(p), min(self.k_max, earned))
        return out

    def _unearned_k(self) -> int:
        """The longest draft whose verification costs at most UNEARNED_PASSES single passes."""
        limit = UNEARNED_PASSES * self.cost.verify(1)
        return max([1, *(k for k in range(1, self.k_max + 1) if self.cost.verify(k + 1) <= limit)])

    def _plain(self) -> Candidate:
        return Candidate(PLAIN, 0, 1.0, self.cost.verify(1))

    def _candidate(self, p: str, k: int, emitted: np.ndarray) -> Candidate:
        return Candidate(p, k, float(emitted[k]), self.cost.verify(k + 1) + self.cost.propose(p, k))

    def _best(self, p: str, k_avail: int, key: AcceptanceKey, rates: np.ndarray | None = None) -> Candidate:
        emitted = expected_emitted(self.acc.rates(key) if rates is None else rates)  # [k_max + 1]
        return max((self._candidate(p, k, emitted) for k in range(1, k_avail + 1)), key=lambda c: c.rate)

    def _probe(
        self, best: Candidate, options: Mapping[str, tuple[AcceptanceKey, int]], context: Sequence[int]
    ) -> Candidate | None:
        """One step with a proposer untried for explore_every steps, if (1) it could pay at all —
        at PROBE_ACCEPTANCE at every position it would beat plain (on a 2-core CPU a 0.5B draft
        cannot, and probing it would only waste time) — and (2) the exploration budget, EXPLORE_BUDGET of all
        generation time so far, covers what the probe is expected to cost: catching up (a draft
        that sat out must read what it missed) plus the step's expected loss against plain."""
        plain = self._plain()
        stale = [
            p
            for p, (key, k_avail) in options.items()
            if p != best.proposer
            and self.step_no - self.last_tried[p] >= self.cfg.explore_every << min(self.failed_probes.get(p, 0), MAX_BACKOFF)
            and self._best(p, k_avail, key, np.full(self.k_max, PROBE_ACCEPTANCE)).rate >= self.cfg.min_gain * plain.rate
        ]
        if not stale:
            return None
        p = min(stale, key=lambda q: (self.last_tried[q], q))  # the longest untried; ties by name
        key, k_avail = options[p]
        k = min(k_avail, 4)  # enough positions to learn from, cheaply
        probe = self._candidate(p, k, self.acc.expected_emitted(key))
        catchup = self.cost.catchup(p, self.lag(p, context) if self.lag else 0)
        expected_cost = catchup + max(0.0, probe.seconds - probe.tokens * plain.seconds)
        if self.explore_s + expected_cost > EXPLORE_BUDGET * self.total_s:
            return None
        return probe

    def _reason(self, best: Candidate, plain: Candidate) -> str:
        if best.proposer == PLAIN:
            return f"plain: no proposer beats {plain.rate:.1f} tok/s by {self.cfg.min_gain:.2f}x"
        return (
            f"{best.proposer} k={best.k}: expects {best.tokens:.2f} tokens in "
            f"{best.seconds * 1000:.0f} ms = {best.rate / plain.rate:.2f}x plain"
        )

    def _record(
        self, best: Candidate, plain: Candidate, options: Mapping[str, tuple[AcceptanceKey, int]], reason: str
    ) -> None:
        """The view: the choice, why, and each proposer's expected gain for every k (for ngram,
        under the current match, or the longest-match bucket when there is none)."""
        v = self.view
        v.proposer, v.k, v.reason = best.proposer, best.k, reason
        v.baseline_tps = plain.rate
        gains: dict[str, list[float]] = {}
        for p in self.proposers:
            key = options[p][0] if p in options else self._key(p, MATCH_CAP, from_prompt=True)
            emitted = self.acc.expected_emitted(key)
            gains[p] = [round(self._candidate(p, k, emitted).rate / plain.rate, 3) for k in range(1, self.k_max + 1)]
        v.gains = gains


def calibrate(
    controller: Controller,
    time_pass: Callable[[int], float],
    passes: int = 2,
    sizes: Sequence[int] | None = None,
) -> dict[int, float]:
    """Time the target's pass over n tokens (median of `passes`) and load the cost model.

    time_pass(n) runs one pass over n tokens and returns seconds. Sizes default to a spread over
    1..k_max + 1 (interpolated between), which keeps warm-up to a few seconds on a CPU.
    """
    n_max = controller.k_max + 1
    if sizes is None:
        sizes = sorted({1, 2, 3, 4, 5, 6, 8, 10, 12, n_max} & set(range(1, n_max + 1)))
    samples = {n: float(np.median([time_pass(n) for _ in range(passes)])) for n in sizes}
    controller.cost.set_verify(samples)
    return samples


class Observed(FixedPolicy):
    """A fixed mode whose steps still teach the controller (costs, acceptance)."""

    def __init__(self, proposer: str, k: int, controller: Controller) -> None:
        super().__init__(proposer, k)
        self.controller = controller

    def observe(self, step: StepStats) -> None:
        self.controller.observe(step)


def make_policy(mode: str, k: int, controller: Controller | None) -> SpeculationPolicy:
    """The policy for a request: the shared controller for auto, a fixed one otherwise (which
    still reports its steps to the controller when there is one)."""
    if mode == "auto":
        if controller is None:
            raise ValueError("auto mode needs a calibrated controller")
        return controller
    proposer, k = ("none", 0) if mode == "off" or k == 0 else (mode, k)
    return Observed(proposer, k, controller) if controller is not None else FixedPolicy(proposer, k)

