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
- t_propose: seconds per proposed token, per proposer (EWMA of live steps, catch-up batches
  excluded); a model proposer measures it at warm-up, prompt lookup costs microseconds.
- a_i: per proposer, an EWMA of the outcome at each position, updated after every step, and
  keyed by the evidence a proposal offers (Proposer.preview). For prompt lookup that is the
  match's length (a 5-token match predicts far better than a 2-token one), whether it copies
  the prompt or repeats the answer (an edit copying its input keeps ~13 of 16 tokens; prose
  repeating a phrase of its own, ~4), and whether a short match into the prompt resumes the
  answer's copy of it where that broke off (an edit after the lines it changed). The same
  question asked again is the exception: its draft is the remembered greedy answer, broken only
  where batch noise flips a near-tie, so each of its tokens is priced by its argmax gap in that
  answer (NearTieModel, `_rates`).

Earned length: within a request, a proposer may draft at most max(k0, EARNED_GROWTH x its
longest accepted run in this request) tokens, k0 being the longest draft whose verification
costs at most UNEARNED_PASSES single passes. The acceptance estimates pool many requests, and requests differ
most exactly where a long draft is at stake: the same 6-token prompt-lookup match that an edit copies in
full, a chat answer leaves after one token. On 2 cores a 16-token draft rejected early costs ~6
passes; capped (k0 = 4-5 there), the loss is at most 3, while a real copy reaches k = 16 by its
second or third step. On a GPU's flat cost curve k0 is k_max: there a long draft risks little.
Tokens of the output that a prompt-lookup proposal shows copying the prompt count as earned too:
where even 2 or 3 rows cost nearly as many passes (a 2-core EPYC), no unearned draft pays, and
an edit would otherwise never draft at all.

Exploration: a proposer that is never chosen is never measured, so a change of workload (prose
to code) would go unnoticed. A proposer not tried for `explore_every` steps gets one probe step,
but only while the time lost to probes stays under EXPLORE_BUDGET of the recent total — a bound
on what exploration can cost. A probe that finds the proposer still not paying doubles its
interval (up to MAX_BACKOFF doublings), so a proposer that loses on this workload costs ever
less, yet is retried within a bounded number of steps. Failures count under the evidence the
probe offered as well, and a choice on merit under other evidence does not clear them: in prose,
prompt lookup's rare long copies are drafted on merit, and its 2-token matches, probed and
rejected again and again, would otherwise come back every explore_every steps after each copy
(scripts/controller_replay.py on the 46 recorded outputs, three measured 2-core curves: code
+0.4 to +1.3 %, edit +0.3 to +1.5 %, chat -0.5 to +0.9 %). A proposer never observed is probed
at its first chance, outside the budget, when catching it up costs under UNSEEN_CATCHUP_S: its
acceptance is unknown rather than known to be low, and the budget, a share of the generation time
so far, is empty in the first answers after a start (the Q4_0 draft, accepted ~0.8 on code,
waited through most of the bench's first code answer). A new kind of evidence from a proposer
already observed starts from its prior instead (_unseen). The rule uses no randomness: the same
observations give the same decisions.

How this differs from transformers' assisted generation (`num_assistant_tokens` +2 on full
acceptance, -1 otherwise): that heuristic targets acceptance and ignores cost, so on a CPU it
happily speculates at a loss; here the objective is tokens per second and k = 0 is a candidate.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from homespec.config import ControllerConfig, Mode
from homespec.speculation.costs import AcceptanceModel, CostModel, NearTieModel, expected_emitted
from homespec.speculation.engine import OFF, Decision, FixedPolicy, SpeculationPolicy, StepStats
from homespec.speculation.proposers.base import IN_STEP_LAG, NO_GAPS, Evidence, Proposer

log = logging.getLogger(__name__)

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
# Rows of a pass of several requests the shared cost curve covers, in drafts of k_max + 1
# (beyond, it grows by the mean row).
SHARED_ROWS = 4
# Prompt-lookup matches into the prompt at least this long (tokens, a match bucket's lower end)
# are copies whose acceptance is pooled over positions (_pooled).
POOLED_COPY_MATCH = 8
# A proposer never observed under a key is probed at its first chance if catching it up costs at
# most this (seconds): the Q4_0 draft reads a 300-token prompt in ~1 s on 2 cores.
UNSEEN_CATCHUP_S = 1.0
# A pass planned for several requests (Controller.plan): the draft lengths each may take (and its
# longest), and the common lengths the search starts from besides all plain. Enough to find a
# pass where all draft a little (the 2-core Xeon, 300 tokens of history each: 4 x 3 rows 160 ms,
# 4 x 1 row 108) or one copies far beside plain rows (17, 1, 1, 1: 279 ms), and few enough that
# planning four requests takes 2-3 ms of Python (6 at most, measured in-process), in a pass of
# ~100-300.
PLAN_KS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
PLAN_LENGTHS = (2, 3, 5, 9, 17)
# Calibration times every pass of at most SMALL_ROWS rows beside a one-token pass PAIRED_SMALL times
# at least: plain decoding and the drafts most steps take (~0.1 s each on 2 cores), where a
# misjudged ratio decides most steps.
SMALL_ROWS = 8
PAIRED_SMALL = 4
# A size whose pass came out over BUMP x the line through its neighbours' (past the last, the line
# through the two before it) is timed PAIRED_SMALL times more: a size priced too dear is never
# chosen, so no live step ever corrects it. A 2-core VM's noise put 6 rows at 71 ms between 5 at
# 43 and 8 at 85, and 65 at 792 where the pass takes ~600 (2026-12-07, `homespec bench` warm-up):
# auto then drafted 4 tokens at a time in edits. A real step in the curve (a kernel's tile filling)
# is timed again and kept.
BUMP = 1.15
# Failed probes stretch a proposer's probe interval to at most explore_every * 2**MAX_BACKOFF
# steps (256 at the default 32: ~25 s of generation on 2 cores).
MAX_BACKOFF = 3


def _paired(ones: Sequence[float], ratios: Mapping[int, Sequence[float]]) -> dict[int, float]:
    """Seconds per pass size from paired timings: the median one-token pass times each size's
    median ratio to the one-token pass before it."""
    one_s = float(np.median(ones))
    return {1: one_s} | {n: one_s * float(np.median(r)) for n, r in ratios.items()}


def calibration_bumps(samples: Mapping[int, float], bump: float = BUMP) -> list[int]:
    """Sizes whose pass (seconds, samples[n]) exceeds `bump` x the line through the sizes on either
    side of it, or, for the largest, the line through the two below it."""
    ns = sorted(samples)
    out = []
    for i in range(1, len(ns)):
        if i + 1 < len(ns):
            (a, b), n = (ns[i - 1], ns[i + 1]), ns[i]
        elif i >= 2:
            (a, b), n = (ns[i - 2], ns[i - 1]), ns[i]
        else:
            continue
        line = samples[a] + (samples[b] - samples[a]) * (n - a) / (b - a)
        if samples[n] > bump * line:
            out.append(n)
    return out


def together_drafting_s(ks: Sequence[int], per_token_s: float, curve: np.ndarray) -> float:
    """Seconds a model drafting for several requests at once spends on their drafts of ks tokens:
    a pass per token, over the requests still drafting, each pass curve[n] lone passes for n of
    them (curve: [requests + 1], index 0 unused; past its end, its last).

    Token t is drafted for the requests whose k is at least t: with the ks in falling order, the
    first i + 1 draft tokens ks[i + 1] + 1 .. ks[i]. In plain Python: a planned pass prices ~200
    picks of its requests' steps, and numpy's small arrays cost more than this sum."""
    ordered = sorted(ks, reverse=True)  # [requests]
    seconds = 0.0
    for i, k in enumerate(ordered):
        below = ordered[i + 1] if i + 1 < len(ordered) else 0
        seconds += per_token_s * float(curve[min(i + 1, len(curve) - 1)]) * (k - below)
    return seconds


class AcceptanceKey(NamedTuple):
    """What acceptance is tracked by: outcomes under the same key are alike."""

    proposer: str
    match: int = 0  # the proposal's evidence strength (prompt lookup: its match-length bucket); 0 = none
    from_prompt: bool = False  # the proposal copies the prompt rather than the answer
    from_memory: bool = False  # the proposal copies an earlier request's answer
    repeat: bool = False  # ... the answer to the same prompt (kept in full far more often than a shared phrase)
    sampled: bool = False  # a temperature > 0 request
    resumes: bool = False  # a short match into the prompt that resumes the answer's last copy of it

    @property
    def greedy_repeat(self) -> bool:
        """The same question's remembered answer, drafted for a greedy request: left only where a
        near-tie flips (NearTieModel), and at any depth alike (_pooled)."""
        return self.repeat and not self.sampled


def _pooled(key: AcceptanceKey) -> bool:
    """Whether a key's drafts fail by a chance that does not grow with depth, so that no position's
    rate falls below the key's rate over every position it tested (AcceptanceModel's pooled keys):
    - a greedy answer to the same question is left at a near-tie, as likely at position 40 as at 4;
    - a long copy of the prompt (an edit) is left where the edit changes something, no likelier
      at its 2nd token than at its 20th. Per position alone, a copy left once at its 2nd token
      pinned position 2's rate, and the 1-token drafts then chosen never tested it again:
      replayed (scripts/controller_replay.py, 46 recorded outputs, code and chat before the
      edits) the edits drafted 1 token at a time on 16-token copies, each kept. Pooled from
      POOLED_COPY_MATCH tokens of match, edits went from 1.44x to 1.55x plain on a 2-core EPYC
      curve of 2026-12-04 (the replay's hindsight oracle: 1.92x), and 1.46 -> 1.55, 1.64 -> 1.67,
      2.21 -> 2.26 on three other measured curves; code and chat moved by 0.3 % at most. Shorter
      matches into the prompt are often coincidences that fail at once: pooled too, code lost
      0.4 %."""
    return key.greedy_repeat or (key.from_prompt and key.match >= POOLED_COPY_MATCH)


class Option(NamedTuple):
    """A proposer usable for the step being decided."""

    key: AcceptanceKey  # what its acceptance is tracked by, under the evidence it offers now
    k: int  # the longest draft it may make (what it has, and what it has earned in this request)
    switch_s: float  # seconds of catching up before it can draft (it sat out), beyond a step's own
    gaps: np.ndarray = NO_GAPS  # [available >= k] the same question's draft: its tokens' argmax gaps (Preview.gaps)


@dataclass(frozen=True)
class Candidate:
    proposer: str
    k: int
    tokens: float  # expected tokens this request emits
    seconds: float  # expected seconds the step costs (beside other requests: what it adds to their pass)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Choice(NamedTuple):
    """One step a request could take in a planned pass."""

    proposer: str  # OFF: plain
    k: int
    tokens: float  # expected tokens it emits
    draft_s: float  # seconds proposing them alone (catching up included), before the pass
    # Its model drafts for every request choosing it in one pass per token (batch.py), which
    # costs together_s[proposer][n] of a lone pass for n requests' rows.
    together: bool = False


@dataclass
class Offer:
    """A request's next step, offered to the pass planned for several (Controller.plan)."""

    state: RequestState
    options: dict[str, Option]
    choices: list[Choice]  # plain first


@dataclass
class RequestState:
    """What the controller keeps per request; everything else it learns is shared."""

    sampled: bool = False  # the request samples (temperature > 0)
    earned: dict[str, int] = field(default_factory=dict)  # proposer -> longest accepted run in it
    prompt_len: int = 0  # tokens: the context past it is this request's output
    probing: str | None = None  # the proposer of a decided probe step (its k may be clipped)
    # The request's own proposer instances by name (several requests at once each have theirs:
    # a draft model's KV sequence, a prompt-lookup index); None: the registry's.
    proposers: Mapping[str, Proposer] | None = None
    alongside: int = 0  # rows other requests bring to the pass being decided (batch.py)


@dataclass
class ControllerView:
    """What the daemon and the dashboard show: the choice, why, and the live figures."""

    proposer: str = OFF
    k: int = 0
    reason: str = "not calibrated yet"
    gains: dict[str, list[float]] = field(default_factory=dict)  # proposer -> [expected rate / plain] for k = 1..
    baseline_tps: float | None = None  # plain decoding, from the cost model
    effective_tps: float | None = None  # measured: emitted / step seconds (EWMA)
    speedup: float | None = None  # effective / baseline
    chosen: dict[str, int] = field(default_factory=dict)  # "<proposer>:<k>" -> steps
    probes: int = 0


class Controller:
    """A SpeculationPolicy that learns; one instance is shared by all requests of a daemon.

    It owns the registry of proposers it may choose from (add_proposer / remove_proposer) and
    their measured costs (calibrate); it reaches them only through the Proposer protocol.
    """

    def __init__(
        self,
        proposers: Sequence[Proposer] = (),
        cfg: ControllerConfig = ControllerConfig(),
        k_max: int = 16,
        together_rows: int | None = None,
        split_steps: bool = False,
    ) -> None:
        self.cfg = cfg
        self.k_max = k_max
        # The target keeps a KV stream per sequence: llama.cpp runs a pass whose requests bring
        # steps of different lengths as several graphs, so a draft beside plain rows is a pass
        # of its own (_seconds). On a 2-core Xeon (300 tokens of history each) a 5-row step beside
        # three 1-row steps took 226 ms, about the four plain rows' 115 and a 4-row pass's 110,
        # where one graph of the same rows (one KV buffer) took 161.
        self.split_steps = split_steps
        # Rows a pass of several requests drafting together may hold (None: no bound). A request
        # that arrives waits for the pass being run: the daemon keeps that within about what a
        # prompt chunk holds it (Host: half of server.prefill_chunk's rows, since a verify row,
        # with its logits, costs up to ~1.8x a prompt row). On a 2-core EPYC four drafts of 64
        # tokens made a pass of 257 rows and 4.7 s; 4 requests' 65 rows took 1.2-1.3 s, a
        # 128-token prompt chunk ~1.4 s.
        self.together_rows = together_rows
        self.cost = CostModel(k_max + 1, cfg.cost_ewma)
        # proposer -> [n]: a pass of its model over one row each of n requests, in passes over one
        # row (index 0 unused); measured at warm-up (set_together_cost). A proposer absent here
        # drafts for each request on its own.
        self.together_s: dict[str, np.ndarray] = {}
        # Passes of several requests, learned apart: such a pass is not one request's pass of as
        # many rows (several histories to attend over, rows spread over sequences), its rows reach
        # past one request's k_max + 1, and its timings would otherwise move a lone request's
        # curve (plain decoding's baseline with it).
        self.shared = CostModel(SHARED_ROWS * (k_max + 1), cfg.cost_ewma)
        # Some keys' drafts fail at any depth alike: one rate over their positions too (_pooled).
        self.acc = AcceptanceModel(k_max, cfg.acceptance_ewma, self._prior, pooled=_pooled)
        # The same question's greedy draft, by where its remembered answer had near-ties (_rates).
        self.ties = NearTieModel()
        self.proposers: dict[str, Proposer] = {}  # name -> proposer; use add/remove_proposer
        self.step_no = 0
        self.last_tried: dict[str, int] = {}  # proposer -> step it was last chosen or probed
        # Probes in a row that found a proposer not paying, by proposer (cleared when it is chosen
        # on merit) and by the evidence it offered (cleared only by a choice or probe under it):
        # prompt lookup chosen on merit for long matches says nothing of the 2-token matches its
        # probes keep finding wanting in prose.
        self.failed_probes: dict[str | AcceptanceKey, int] = {}
        # (proposer, sampled) pairs whose drafts have been observed: the rest are probed at first sight (_unseen)
        self._observed: set[tuple[str, bool]] = set()
        # Both over an exponential window of the last ~BUDGET_WINDOW steps: a daemon's long history
        # (or a bench's fixed arms) must not bank a budget that probes then spend in a burst.
        self.total_s = 0.0  # seconds of generation
        self.explore_s = 0.0  # seconds lost to probes (beyond what plain decoding would have taken)
        self.view = ControllerView()
        # The request being decided for: one at a time (the daemon's worker); a request of its
        # own per generation through policy(), this default one for direct callers.
        self.req = RequestState()
        self._shown: dict[str, Evidence] = {}  # proposer -> evidence of its last preview (the view)
        for p in proposers:
            self.add_proposer(p)

    def policy(self, proposers: Mapping[str, Proposer] | None = None) -> RequestPolicy:
        """A SpeculationPolicy for one request, with its own per-request state (and proposer
        instances), deciding from the shared estimates."""
        return RequestPolicy(self, RequestState(proposers=proposers))

    def _usable(self) -> dict[str, Proposer]:
        """The current request's instance of every registered proposer it has one of."""
        mine = self.req.proposers
        if mine is None:
            return self.proposers
        return {name: mine[name] for name in self.proposers if name in mine}

    # -- the registry and its costs --------------------------------------------------------

    def add_proposer(self, proposer: Proposer) -> None:
        """Make a proposer a candidate (again: costs measured before are kept)."""
        self.proposers[proposer.name] = proposer
        self.last_tried.setdefault(proposer.name, self.step_no)

    def remove_proposer(self, name: str) -> Proposer | None:
        """Stop choosing a proposer (its model is being unloaded); returns it."""
        return self.proposers.pop(name, None)

    def proposer(self, name: str) -> Proposer:
        """A registered proposer by name; KeyError names the available ones."""
        try:
            return self.proposers[name]
        except KeyError:
            raise KeyError(f"no proposer {name!r} (have {', '.join(sorted(self.proposers)) or 'none'})") from None

    def calibrate(
        self,
        time_pass: Callable[[int], float],
        *,
        context: Sequence[int] = (),
        probe: Sequence[int] = (),
        passes: int = 2,
        sizes: Sequence[int] | None = None,
    ) -> dict[str, dict[int, float]]:
        """Measure this machine: the target's pass over n tokens (time_pass(n) runs one and
        returns seconds), then each proposer's own cost after `context` (see
        Proposer.measure_cost). Returns the samples: {"target" | proposer: {n: seconds}}.

        Each size is timed right after a one-token pass, `passes` times (PAIRED_SMALL at least up
        to SMALL_ROWS rows): its cost is the median ratio to its one-token pass times the median
        one-token pass. A decision weighs a draft's pass against plain decoding's, so the ratio is
        what must hold, and a 2-core VM's pace drifts within the warm-up: sizes timed one after
        another put a one-token pass at 34 ms where the run's plain steps took 25.5-29 (2026-12-07,
        `homespec bench`), and auto drafted in chat at 0.96x of plain, expecting 1.28x.

        A size that comes out dearer than the line through its neighbours (calibration_bumps) is
        timed PAIRED_SMALL times more, its median taken over all its pairs: noise that prices a size
        too dear is never corrected by a live step, as no step then takes that size.

        Sizes default to a spread over 1..k_max + 1 (interpolated between), which keeps warm-up
        to a few seconds on a CPU; past 12 rows, every doubling or so (a CPU's curve bends there,
        as a kernel's tiles fill, and a straight line from 12 to 65 rows would misprice 17-33)."""
        n_max = self.k_max + 1
        if sizes is None:
            sizes = sorted({1, 2, 3, 4, 5, 6, 8, 10, 12, 17, 25, 33, 49, n_max} & set(range(1, n_max + 1)))
        ones: list[float] = []  # seconds of every one-token pass
        ratios: dict[int, list[float]] = {n: [] for n in sizes if n != 1}  # size -> [its pass / the one-token pass before it]

        def pair(n: int, times: int) -> None:  # size n timed `times` times, each right after a one-token pass
            for _ in range(times):
                one = time_pass(1)
                ones.append(one)
                ratios[n].append(time_pass(n) / one)

        for n in ratios:
            pair(n, max(passes, PAIRED_SMALL) if n <= SMALL_ROWS else passes)
        if not ones:  # (sizes: 1 alone)
            ones = [time_pass(1) for _ in range(passes)]
        samples = _paired(ones, ratios)
        bumps = calibration_bumps(samples)
        if bumps:
            log.info("calibration: timing %s rows again (%s ms: dearer than the line through their neighbours)",
                     ", ".join(map(str, bumps)), ", ".join(f"{samples[n] * 1000:.0f}" for n in bumps))
        for n in bumps:
            for _ in range(PAIRED_SMALL):
                one = time_pass(1)
                ones.append(one)
                ratios[n].append(time_pass(n) / one)
        samples = _paired(ones, ratios)
        self.cost.set_verify(samples)
        self.shared.set_verify(samples)  # until passes of several requests are timed
        out = {"target": samples}
        for name, p in self.proposers.items():
            measured = p.measure_cost(context, probe, passes) if context else None
            if measured is not None:
                self.set_proposer_cost(name, measured.per_token_s, measured.catchup_per_token_s)
                out[name] = {1: measured.per_token_s, measured.catchup_tokens: measured.catchup_per_token_s * measured.catchup_tokens}
        return out

    def set_together_cost(self, name: str, seconds: Mapping[int, float]) -> None:
        """A proposer's model drafting for n requests at once: seconds of a pass over one row of
        each of n requests, n = 1, 2, ... (a warm-up timing)."""
        ns = sorted(seconds)
        if not ns or ns[0] != 1 or seconds[1] <= 0:
            return
        self.together_s[name] = np.concatenate([[0.0], np.interp(np.arange(1, ns[-1] + 1), ns, [seconds[n] / seconds[1] for n in ns])])

    def set_proposer_cost(self, name: str, per_token_s: float, catchup_per_token_s: float | None = None) -> None:
        """Seconds per proposed token (and per token caught up) at the current pace."""
        self.cost.propose_s[name] = per_token_s / self.cost.speed
        if catchup_per_token_s is not None:
            self.cost.catchup_s[name] = catchup_per_token_s / self.cost.speed

    # -- SpeculationPolicy -----------------------------------------------------------------

    def begin(
        self, prompt: Sequence[int], sampled: bool = False, alongside: int = 0, tokens_left: int | None = None
    ) -> list[Proposer]:
        """A request starts: draft lengths are earned afresh, and acceptance is learned apart
        for sampled requests. Prefill the proposers whose prefill is free (a prompt-lookup index also
        learns where the prompt ends) and the others only while they pay (a draft's prefill, run
        after the first token, delays the second for nothing otherwise, and the next token of each
        of the `alongside` rows of other requests with it); the rest catch up if a probe or a
        plan picks them (each charges the catch-up).

        What drafting pays is priced as alone even beside others: their steps and this one's are
        planned together (plan), where drafts that all requests make pay more than one beside
        plain rows does. Priced beside plain rows, no draft model read a prompt at once, and
        catching up later cost each request 60-190 ms that no planned step repaid: in-process on
        a 2-core Xeon, four requests at once (code, edit, chat, code) got 30.0 and 29.9 tok/s
        so, 36.2 and 33.6 priced alone."""
        self.req.earned = {}
        self.req.prompt_len = len(prompt)
        self.req.sampled = sampled
        self.req.alongside = 0
        plain = self._plain()
        out = []
        for name, p in self._usable().items():
            if p.free_prefill:
                out.append(p)
                continue
            best = self._best(name, self.k_max, self._key(name))
            if best.rate < self._bar(plain):
                continue
            # Reading the prompt stalls this request and each beside it (~1 row apiece) once: a
            # 960-token prompt held the worker ~10 s with the 0.5B draft on 2 cores, more than 160
            # tokens drafted at 1.2x could save. Only a prefill the tokens left can pay back is run
            # (of what the proposer has not read: a chat's next turn finds its history there).
            if tokens_left is not None and best.rate > 0 and plain.rate > 0:
                saved_s = tokens_left * (1 / plain.rate - 1 / best.rate)
                if saved_s < self.cost.catchup(name, p.lag(prompt)) * (1 + alongside):
                    continue
            out.append(p)
        return out

    def end(self, context: Sequence[int], gaps: Sequence[float] = ()) -> None:
        """The request ended with `context` (and its answer's argmax gaps): its proposers keep
        what helps later requests."""
        for p in self._usable().values():
            p.end(context, gaps)

    def decide(self, context: Sequence[int], alongside: int = 0) -> Decision:
        self.step_no += 1
        self.req.probing = None
        self.req.alongside = alongside
        if not self.cost.calibrated():
            return Decision(None, 0)
        plain = self._plain()
        options = self._options(context)
        best_of = {p: self._best(p, o.k, o.key, self._rates(o), o.switch_s) for p, o in options.items()}
        best = max([plain, *best_of.values()], key=lambda c: c.rate)
        if best.proposer != OFF and best.rate < self._bar(plain):
            best = plain
        reason = self._reason(best, plain)
        probe = self._probe(best, options)
        if probe is not None:
            reason = f"probe {probe.proposer} k={probe.k} (untried for {self.step_no - self.last_tried[probe.proposer]} steps)"
            best = probe
            self.req.probing = probe.proposer
        self._record(best, plain, options, reason)
        if log.isEnabledFor(logging.DEBUG):  # `homespec -v serve`: every decision and what it weighed
            log.debug("beside %d rows: %s; best k per proposer: %s", alongside, reason,
                      ", ".join(f"{p} k={c.k} {c.rate / plain.rate:.2f}x" for p, c in best_of.items()) or "none")
        if best.proposer == OFF:
            return Decision(None, 0)
        self.last_tried[best.proposer] = self.step_no
        if probe is None:
            self.failed_probes.pop(best.proposer, None)  # chosen on merit
            self.failed_probes.pop(options[best.proposer].key, None)
        return Decision(self._usable()[best.proposer], best.k)

    # -- a pass of several requests, planned at once ----------------------------------------

    def offer(self, context: Sequence[int]) -> Offer | None:
        """The current request's choices for a pass planned with others (plan): plain, and each
        proposer at the draft lengths of PLAN_KS it may take, with its expected tokens and
        drafting time. None before calibration (it decides alone then: plain)."""
        if not self.cost.calibrated():
            return None
        self.req.alongside = 0  # earned lengths as alone (_unearned_k): the plan prices the pass
        options = self._options(context)
        choices = [Choice(OFF, 0, 1.0, 0.0)]
        for p, o in options.items():
            emitted = expected_emitted(self._rates(o))  # [k_max + 1]
            together = p in self.together_s and getattr(self._usable()[p], "together", None) is not None
            for k in sorted({*(k for k in PLAN_KS if k < o.k), o.k}):
                choices.append(Choice(p, k, float(emitted[k]), float(self.cost.propose(p, k)) + o.switch_s, together))
        return Offer(self.req, options, choices)

    def plan(self, offers: Sequence[Offer], graphs: Callable[[Sequence[int]], Sequence[tuple[int, int]]]) -> list[Decision]:
        """Each offering request's step in the next pass, chosen together: the steps that make
        the pass most productive, expected tokens over seconds (drafting, then the pass), if
        that beats all plain rows by min_gain. graphs(rows): how the target runs the pass when
        the requests bring rows[i] each, beside the pass's other parts (Runtime.graphs:
        (sequences, rows) per graph): with a KV stream per sequence, steps of unequal length
        run as several graphs, which one request's far copy beside plain rows pays for and a
        short draft does not. A graph of one sequence costs a pass of its rows alone (the cost
        curve), one of several the shared curve's.

        A local search from all plain and from every request drafting to each of PLAN_LENGTHS,
        one request's step at a time. A pass's rows stay within together_rows: a request that
        arrives waits for the pass being run."""
        shared = self.shared if self.shared.calibrated() else self.cost
        priced: dict[tuple[int, ...], float] = {}

        def pass_s(rows: tuple[int, ...]) -> float:
            if rows not in priced:
                priced[rows] = sum(float(self.cost.verify(n) if seqs == 1 else shared.verify(n)) for seqs, n in graphs(rows))
            return priced[rows]

        def drafting_s(steps: Sequence[Choice]) -> float:
            """Seconds before the pass: each request's drafting alone, but for a model that
            drafts for all at once: a pass per drafted token, of the requests still drafting."""
            alone = sum(c.draft_s for c in steps if not c.together)
            for p in {c.proposer for c in steps if c.together}:
                mine = [c for c in steps if c.together and c.proposer == p]
                per_token = float(self.cost.propose(p, 1))
                alone += together_drafting_s([c.k for c in mine], per_token, self.together_s[p])
                alone += sum(c.draft_s - per_token * c.k for c in mine)  # their catching up, each alone
            return alone

        rated: dict[tuple[int, ...], float] = {}  # the search meets the same picks again and again

        def rate(pick: Sequence[int]) -> float:
            key = tuple(pick)
            if key not in rated:
                rated[key] = steps_rate([o.choices[j] for o, j in zip(offers, pick)])
            return rated[key]

        def steps_rate(steps: Sequence[Choice]) -> float:
            rows = tuple(c.k + 1 for c in steps)
            if self.together_rows is not None and sum(rows) > max(self.together_rows, len(rows)):
                return 0.0
            return sum(c.tokens for c in steps) / (pass_s(rows) + drafting_s(steps))

        plain = [0] * len(offers)
        starts = [plain] + [[max(range(len(o.choices)), key=lambda j: (o.choices[j].k < m, o.choices[j].tokens)) for o in offers]
                            for m in PLAN_LENGTHS]
        best, best_rate = plain, rate(plain)
        for pick in starts:
            pick, r = list(pick), rate(pick)
            for _ in range(2):  # sweeps: one request's step at a time, the others' kept
                moved = False
                for i, o in enumerate(offers):
                    for j in range(len(o.choices)):
                        trial = [*pick[:i], j, *pick[i + 1 :]]
                        t = rate(trial)
                        if t > r * (1 + 1e-9):
                            pick, r, moved = trial, t, True
                if not moved:
                    break
            if r > best_rate:
                best, best_rate = pick, r
        plain_rate = rate(plain)
        if best_rate < plain_rate * self.cfg.min_gain:
            best = plain
        return [self._planned(o, o.choices[j], len(offers), best_rate / plain_rate if plain_rate else 1.0)
                for o, j in zip(offers, best)]

    def _planned(self, offer: Offer, c: Choice, n: int, gain: float) -> Decision:
        """Record a request's planned step as decide does its own (the view, last_tried)."""
        self.req = offer.state
        self.step_no += 1
        self.req.probing = None
        plain = self._plain()
        step = Candidate(c.proposer, c.k, c.tokens, c.draft_s)
        reason = (f"off in a pass of {n}" if c.proposer == OFF else f"{c.proposer} k={c.k} in a pass of {n}") + \
            f": the pass planned {gain:.2f}x one of plain rows"
        self._record(step, plain, offer.options, reason)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("planned: %s", reason)
        if c.proposer == OFF:
            return Decision(None, 0)
        self.last_tried[c.proposer] = self.step_no
        self.failed_probes.pop(c.proposer, None)  # chosen on merit
        self.failed_probes.pop(offer.options[c.proposer].key, None)
        return Decision(self._usable()[c.proposer], c.k)

    def observe(self, step: StepStats) -> None:
        """Learn from a step — whichever policy chose it (fixed-mode requests teach too)."""
        own = step.proposed + 1  # this request's rows of the pass
        batched = step.pass_rows > own  # the pass also held other requests' rows
        if step.timed:  # (a pass that also read prompts is no verify cost)
            if batched:
                self.shared.observe_verify(step.pass_rows, step.pass_s)
            else:
                self.cost.observe_verify(own, step.verify_s)
        catchup = step.info.catchup_s
        if catchup and not step.info.shared:
            self.cost.observe_catchup(step.proposer, step.info.catchup_tokens, catchup)
        probing = self.req.probing == step.proposer
        self.req.probing = None
        self.explore_s *= _BUDGET_DECAY
        # Beside other requests, this request's share of the pass: four requests' steps in one
        # pass are one pass of generation time, not four, for the budget probes draw on alone.
        spent = step.draft_s + step.pass_s * own / step.pass_rows if batched else step.seconds
        self.total_s = self.total_s * _BUDGET_DECAY + spent
        # Steps of no registered proposer (plain, or a grammar's forced tokens) teach no acceptance.
        if step.proposer in self.proposers and step.proposed:
            if not step.info.shared:
                self.cost.observe_propose(step.proposer, step.proposed - step.info.copied, max(0.0, step.draft_s - catchup))
            key = self._key(step.proposer, step.info.evidence)
            self.acc.observe(key, step.outcomes, PROBE_EWMA if probing else None)
            self._observed.add((key.proposer, key.sampled))
            if key.greedy_repeat and len(step.info.gaps):
                self.ties.observe(step.info.gaps, step.outcomes)
            self.req.earned[step.proposer] = max(self.req.earned.get(step.proposer, 0), step.accepted)
            if probing:  # what the probe cost beyond plain decoding of the same tokens
                self.explore_s += max(0.0, step.seconds - step.emitted * self.cost.verify(1))
                self.view.probes += 1
                pays = self._best(step.proposer, self.k_max, key).rate >= self._bar(self._plain())
                for failed in (step.proposer, key):
                    self.failed_probes[failed] = 0 if pays else self.failed_probes.get(failed, 0) + 1
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

    def _key(self, proposer: str, evidence: Evidence = Evidence()) -> AcceptanceKey:
        """Acceptance is tracked per proposer and per the evidence it offers (prompt lookup:
        its match; a 32-token match into the prompt means the output is copying (an edit), a 2-token
        match is often a coincidence, and a long repeat of the answer's own words breaks off
        sooner than a copy; a short match into the prompt that resumes the answer's copy of it, an
        edit going on after the lines it changed, runs on where the same match elsewhere is a
        coincidence). Sampled requests are tracked apart: a token drawn at temperature 0.8
        is accepted less often than an argmax, and mixing the two would mislead both."""
        return AcceptanceKey(proposer, evidence.match, evidence.from_prompt, evidence.from_memory, evidence.repeat, self.req.sampled, evidence.resumes)

    def _prior(self, key: AcceptanceKey) -> float:
        """Acceptance assumed before any observation. With evidence of strength m (prompt lookup:
        the match length) it rises as 1 - (1 - p) * 2 / m past m = 2: long matches get tried at once,
        which is what finds an editing workload quickly; data replaces the prior within a few
        steps."""
        p = self.cfg.prior_acceptance
        if key.match > 2:
            return 1.0 - (1.0 - p) * 2.0 / key.match
        return p

    def _options(self, context: Sequence[int]) -> dict[str, Option]:
        """Proposers usable now (those with something to propose), with the largest k each may
        draft and what switching to it costs. A proposer that sat out must first read what it
        missed (a draft model: ~7 ms a token on 2 cores, 0.7 s after 100 steps): that stalls this
        request and, beside others, their pass too, so the step is priced with it. Once caught
        up it stays cheap while chosen."""
        out: dict[str, Option] = {}
        unearned = self._unearned_k()
        for name, p in self._usable().items():
            preview = p.preview(context, self.k_max)
            if preview.available > 0:  # nothing to propose: not a candidate now
                earned = max(unearned, EARNED_GROWTH * self.req.earned.get(name, 0), self._copied(context, preview.evidence))
                self._shown[name] = preview.evidence
                lag = p.lag(context)
                switch_s = self.cost.catchup(name, lag, base=IN_STEP_LAG) if lag > IN_STEP_LAG else 0.0
                out[name] = Option(self._key(name, preview.evidence), min(preview.available, earned), switch_s, preview.gaps)
        return out

    # A request deciding beside others by itself (narrow passes; wide ones are planned, `plan`):
    # the others' `alongside` rows are computed whatever this request does, so its candidates
    # are priced at what their rows add to the pass, t(b + k + 1) - t(b) (CostModel.added), for
    # this request's own expected tokens: a draft must make this request's tokens cheaper than
    # its one plain row does. Pricing the whole pass instead, (b + E[emitted | k]) / t(b + k + 1),
    # one request at a time, each drafted whenever its draft beat the pass's average row, each
    # not knowing whether the others would: measured, 4 clients on a 2-core Xeon, 15.7-18.2 tok/s
    # at once that way against 22.2 with speculation off. The plan prices the whole pass too, but
    # with every request's step chosen at once and each graph of the pass priced as it runs.

    def _bar(self, plain: Candidate) -> float:
        """The rate a speculative candidate must reach: min_gain over plain decoding."""
        return plain.rate * self.cfg.min_gain

    def _copied(self, context: Sequence[int], evidence: Evidence) -> int:
        """Tokens of this request's output that its proposal shows copying the prompt: a draft
        as long is earned, as by an accepted run. The output wrote them itself, so they speak for
        this request as the pooled acceptance cannot. Where one pass of a few rows costs nearly as
        many single passes (a 2-core EPYC: 3 rows ~2.7x), no draft short enough to go unearned
        can pay, so nothing is drafted and nothing earned; an edit earns its drafts this way.

        The earlier answer to this same prompt (`Evidence.repeat`) earns every length at once,
        from the answer's first token, for a greedy request: it is the answer the target is about
        to give, and on a steep cost curve only long drafts pay (a 2-core EPYC: 49 rows cost ~20
        single passes, 17 rows ~9), so earning them step by step would give away most of what
        the memory saves. A prompt that only ends as an earlier one did (an editor's completion
        at the same cursor in a changed file, a shared system prompt, "turn on ..." after "turn
        off ...") earns its drafts as a copy does; a sampled request's draws leave the greedy
        answer soon, so it earns them so too. Acceptance, learned per key, still decides k."""
        if evidence.repeat and not self.req.sampled:
            return self.k_max
        copying = evidence.from_prompt or evidence.from_memory  # an earlier answer, said again, is copied as well
        return min(evidence.match, len(context) - self.req.prompt_len) if copying else 0

    def _unearned_k(self) -> int:
        """The longest draft whose verification costs at most UNEARNED_PASSES single passes."""
        passes, b = self._passes(), self.req.alongside
        ks = np.arange(1, self.k_max + 1)
        cheap = ks[passes.added(ks + 1, b) <= UNEARNED_PASSES * passes.added(1, b)]
        return int(cheap.max()) if cheap.size else 1

    def _passes(self) -> CostModel:
        """The cost curve of the pass being decided: one request's, or several requests' (once
        calibrated: a curve set on `cost` alone also prices shared passes)."""
        return self.shared if self.req.alongside and self.shared.calibrated() else self.cost

    def _rates(self, option: Option) -> np.ndarray:
        """[k_max] the acceptance a_i of the option's draft positions: its key's, except that the
        same question's draft, greedy, is kept token by token as its near-ties allow
        (NearTieModel: asked again, a remembered token is rejected only where it flips)."""
        rates = self.acc.rates(option.key)
        n = min(len(option.gaps), self.k_max)
        if not n or not option.key.greedy_repeat:
            return rates
        out = rates.copy()
        out[:n] = self.ties.keep(option.gaps[:n])
        return out

    def _plain(self) -> Candidate:
        return self._candidate(OFF, 0, np.ones(1))

    def _seconds(self, p: str, k: int | np.ndarray, switch_s: float = 0.0) -> float | np.ndarray:
        """Expected seconds of a step drafting k tokens with p (k: an int, or an array of draft
        lengths priced at once); beside other requests, what it adds to their pass: with a KV
        stream per sequence (split_steps) its first row joins their graph and its k drafted rows
        make a graph of their own, a pass of k rows of one request."""
        b = self.req.alongside
        if b and self.split_steps:
            passes = self._passes().added(1, b) + np.where(np.asarray(k) > 0, self.cost.verify(k), 0.0)
        else:
            passes = self._passes().added(k + 1, b)
        return passes + self.cost.propose(p, k) + switch_s

    def _rate(self, p: str, emitted: np.ndarray, ks: np.ndarray, switch_s: float = 0.0) -> np.ndarray:
        """[len(ks)] expected tokens/s of steps drafting each of ks with p, priced at once (this
        runs each step for each proposer, over up to k_max lengths)."""
        return emitted[ks] / self._seconds(p, ks, switch_s)

    def _candidate(self, p: str, k: int, emitted: np.ndarray, switch_s: float = 0.0) -> Candidate:
        """emitted: [k_max + 1] expected tokens of a step drafting 0..k_max."""
        return Candidate(p, k, float(emitted[k]), float(self._seconds(p, k, switch_s)))

    def _best(
        self, p: str, k_avail: int, key: AcceptanceKey, rates: np.ndarray | None = None, switch_s: float = 0.0
    ) -> Candidate:
        emitted = expected_emitted(self.acc.rates(key) if rates is None else rates)  # [k_max + 1]
        ks = np.arange(1, k_avail + 1)
        return self._candidate(p, int(ks[np.argmax(self._rate(p, emitted, ks, switch_s))]), emitted, switch_s)

    def _probe(self, best: Candidate, options: Mapping[str, Option]) -> Candidate | None:
        """One step with a proposer untried for explore_every steps, if (1) it could pay at all —
        at PROBE_ACCEPTANCE at every position it would beat plain (on a 2-core CPU a 0.5B draft
        cannot, and probing it would only waste time) — and (2) the exploration budget, EXPLORE_BUDGET of all
        generation time so far, covers what the probe is expected to cost: catching up (a draft
        that sat out must read what it missed) plus the step's expected loss against plain.

        Never beside other requests: their rows wait for the probe's catch-up and draft, so it
        costs every request in the pass, while the budget counts it once (and counts the shared
        pass once per request). Measured with four clients: probes of the draft model took 12 %
        of the worker's time. Lone steps keep exploring for all (acceptance is pooled)."""
        if self.req.alongside:
            return None
        plain = self._plain()
        unseen = {p: self._unseen(o) for p, o in options.items()}
        stale = [
            p
            for p, o in options.items()
            if p != best.proposer
            and (unseen[p] or self.step_no - self.last_tried[p] >= self.cfg.explore_every << min(self._failed(p, o.key), MAX_BACKOFF))
            and self._best(p, o.k, o.key, np.full(self.k_max, PROBE_ACCEPTANCE)).rate >= self._bar(plain)
        ]
        if not stale:
            return None
        p = min(stale, key=lambda q: (not unseen[q], self.last_tried[q], q))  # unseen first, then the longest untried
        o = options[p]
        k = min(o.k, 4)  # enough positions to learn from, cheaply
        probe = self._candidate(p, k, expected_emitted(self._rates(o)))
        expected_cost = o.switch_s + max(0.0, probe.seconds - probe.tokens * plain.seconds / plain.tokens)
        if not unseen[p] and self.explore_s + expected_cost > EXPLORE_BUDGET * self.total_s:
            return None
        return probe

    def _unseen(self, o: Option) -> bool:
        """A proposer never observed (for greedy or sampled requests, as the option's are), and
        cheap to catch up: its acceptance is unknown, not known to be low, so it is probed at once
        rather than when the budget has grown (the first answers after a start have none). Once
        per proposer and daemon; a long catch-up waits.

        Not once per key: prompt lookup offers a dozen kinds of evidence (match lengths, what it
        copies), and a steep cost curve makes each first-sight probe of a short match a loss that
        its prior already foresaw. Replayed (scripts/controller_replay.py, 46 recorded outputs),
        this against a probe per new key: on two 2-core EPYC curves (AVX-512, 2 rows ~1.7-2.1
        passes) edits +0.9 and +2.1 %, code -0.1 and +0.8 %, chat +0.3 and +0.2 %; on the unit
        tests' curve edits +0.3 %, code and chat equal; on the AMX Xeon's, all three equal."""
        return (o.key.proposer, o.key.sampled) not in self._observed and o.switch_s <= UNSEEN_CATCHUP_S

    def _failed(self, proposer: str, key: AcceptanceKey) -> int:
        """Doublings of the probe interval for a proposer offering this evidence: its failed
        probes since it was last chosen, or under this evidence since that was."""
        return max(self.failed_probes.get(proposer, 0), self.failed_probes.get(key, 0))

    def _reason(self, best: Candidate, plain: Candidate) -> str:
        if best.proposer == OFF:
            return f"off: no proposer beats {plain.rate:.1f} tok/s by {self.cfg.min_gain:.2f}x"
        return (
            f"{best.proposer} k={best.k}: expects {best.tokens:.2f} tokens in "
            f"{best.seconds * 1000:.0f} ms = {best.rate / plain.rate:.2f}x plain"
        )

    def _record(self, best: Candidate, plain: Candidate, options: Mapping[str, Option], reason: str) -> None:
        """The view: the choice, why, and each proposer's expected gain for every k (under the
        evidence it offers now, or the last it offered when it has nothing to propose)."""
        v = self.view
        v.proposer, v.k, v.reason = best.proposer, best.k, reason
        v.baseline_tps = 1.0 / self.cost.verify(1)  # plain decoding alone, whatever runs beside
        gains: dict[str, list[float]] = {}
        ks = np.arange(1, self.k_max + 1)
        for p in self.proposers:
            o = options[p] if p in options else Option(self._key(p, self._shown.get(p, Evidence())), self.k_max, 0.0)
            gains[p] = np.round(self._rate(p, expected_emitted(self._rates(o)), ks) / plain.rate, 3).tolist()
        v.gains = gains


class RequestPolicy:
    """The controller deciding for one request: its state is swapped in for each call (the
    daemon's worker drives every request on one thread)."""

    def __init__(self, controller: Controller, state: RequestState) -> None:
        self.controller, self.state = controller, state

    def begin(self, prompt: Sequence[int], sampled: bool, alongside: int = 0, tokens_left: int | None = None) -> list[Proposer]:
        self.controller.req = self.state
        return self.controller.begin(prompt, sampled, alongside, tokens_left)

    def decide(self, context: Sequence[int], alongside: int = 0) -> Decision:
        self.controller.req = self.state
        return self.controller.decide(context, alongside)

    def offer(self, context: Sequence[int]) -> Offer | None:
        self.controller.req = self.state
        return self.controller.offer(context)

    def observe(self, step: StepStats) -> None:
        self.controller.req = self.state
        self.controller.observe(step)

    def end(self, context: Sequence[int], gaps: Sequence[float] = ()) -> None:
        self.controller.req = self.state
        self.controller.end(context, gaps)


class Observed(FixedPolicy):
    """A fixed mode whose steps still teach the controller (costs, acceptance)."""

    def __init__(self, proposer: Proposer | None, k: int, controller: Controller) -> None:
        super().__init__(proposer, k)
        self.controller = controller
        self.state = RequestState()

    def begin(self, prompt: Sequence[int], sampled: bool, alongside: int = 0, tokens_left: int | None = None) -> list[Proposer]:
        self.state.sampled = sampled  # its steps teach the estimates of their own kind
        return super().begin(prompt, sampled, alongside, tokens_left)

    def observe(self, step: StepStats) -> None:
        self.controller.req = self.state
        self.controller.observe(step)


def make_policy(
    mode: Mode | str, k: int, controller: Controller, proposers: Mapping[str, Proposer] | None = None
) -> SpeculationPolicy:
    """The policy for a request: the shared controller for auto, a fixed one otherwise (which
    still reports its steps to the controller). k = 0 is off, whatever the mode. proposers: the
    request's own instances (its slot's), None: the registry's."""
    mode = Mode(mode)
    if mode is Mode.AUTO:
        return controller.policy(proposers)
    if mode is Mode.OFF or k == 0:
        return Observed(None, 0, controller)
    controller.proposer(mode.value)  # KeyError naming the available ones
    mine = proposers if proposers is not None else controller.proposers
    if mode.value not in mine:
        raise KeyError(f"no proposer {mode.value!r} for this request (have {', '.join(sorted(mine)) or 'none'})")
    return Observed(mine[mode.value], k, controller)
