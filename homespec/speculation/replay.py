"""Replay speculation policies over recorded greedy outputs: a noise-free model of the bench.

Under greedy decoding the output does not depend on the policy (speculation is exact), so one
plain run per prompt fixes every token, and which n-gram proposals would be accepted follows from
the tokens alone. Pricing each step with a measured cost curve (seconds per target pass over n
tokens) then gives each policy's speedup without timing anything: a controller change can be
judged on many prompts and workload orders in seconds, free of the ±5 % noise of a shared
machine. What it leaves out is what the recording cannot know: model proposers (their proposals
need the model), and near-tie tokens where batched and single passes disagree.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from homespec.speculation.controller import Controller
from homespec.speculation.costs import CostModel
from homespec.speculation.engine import OFF, Decision, FixedPolicy, SpeculationPolicy, StepStats, StepTally
from homespec.speculation.proposers.base import Evidence, ProposalInfo
from homespec.speculation.proposers.ngram import NgramProposer
from homespec.speculation.sampling import SamplingParams
from homespec.speculation.verify import greedy_verify

_GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class Recording:
    prompt: list[int]
    output: list[int]  # greedy tokens; output[0] came from the prefill


def pass_cost(samples: Mapping[int, float]) -> Callable[[int], float]:
    """Seconds per target pass over n tokens, from measured sizes (interpolated between them, as
    the controller's cost model does)."""
    cost = CostModel(max(samples), alpha=0.0)
    cost.set_verify(samples)
    return cost.verify


def rate(tally: StepTally) -> float:
    """Tokens per modelled second."""
    seconds = tally.draft_s + tally.verify_s
    return tally.emitted / seconds if seconds else 0.0


def replay(
    recordings: Sequence[Recording],
    policy: SpeculationPolicy,
    ngram: NgramProposer,
    pass_s: Callable[[int], float],
    steps: list[StepStats] | None = None,
) -> StepTally:
    """Run `policy` over the recordings as the engine would, with ngram as its only proposer
    and a step priced at pass_s(tokens verified). The prefill's first token is not counted.
    steps: if given, every step is appended to it as well (by_evidence reads them)."""
    out = StepTally()
    rng = np.random.default_rng(0)  # unused: ngram proposals are deterministic
    for rec in recordings:
        for p in policy.begin(rec.prompt, False):
            p.begin(rec.prompt)
        ctx, t = [*rec.prompt, rec.output[0]], 1
        while t < len(rec.output):
            d = policy.decide(ctx)
            if d.proposer not in (None, ngram):
                raise ValueError(f"replay has only ngram proposals; the policy chose {d.name!r}")
            k = min(d.k, len(rec.output) - t - 1) if d.proposer is ngram else 0
            proposal = ngram.propose(ctx, k, _GREEDY, rng) if k else None
            drafted = proposal.tokens[:k] if proposal else []
            # The recorded output is the target's argmax after each drafted prefix.
            verdict = greedy_verify(drafted, np.asarray(rec.output[t : t + len(drafted) + 1]))
            info = proposal.info if proposal else ProposalInfo()
            step = StepStats(ngram.name if k else OFF, k, len(drafted), verdict.accepted, 0.0,
                             pass_s(len(drafted) + 1), tuple(verdict.outcomes), info)
            policy.observe(step)
            out.add(step)
            if steps is not None:
                steps.append(step)
            ctx += verdict.tokens
            t += len(verdict.tokens)
    return out


@dataclass
class EvidenceTally:
    """The drafting steps made under one evidence (ngram: the match's length bucket, and whether
    it copies the prompt)."""

    steps: int = 0
    accepted: int = 0  # tokens
    first_kept: int = 0  # steps whose first drafted token was kept
    saved_s: float = 0.0  # modelled seconds against decoding the emitted tokens plainly (< 0: lost)


def by_evidence(steps: Sequence[StepStats], pass_s: Callable[[int], float]) -> dict[Evidence, EvidenceTally]:
    """Replayed steps that drafted, summed per evidence: where a policy gains and loses, and (for
    a fixed k) how often each kind of match is kept at all."""
    out: dict[Evidence, EvidenceTally] = {}
    for s in steps:
        if not s.proposed:
            continue
        t = out.setdefault(s.info.evidence, EvidenceTally())
        t.steps += 1
        t.accepted += s.accepted
        t.first_kept += s.accepted > 0
        t.saved_s += s.emitted * pass_s(1) - s.seconds
    return out


class _Hindsight:
    """The oracle's policy: it knows each recording's output, so it drafts the part of the
    proposal (k <= k_max) that will be accepted, as much of it as gives the best tokens per second
    of the step (on a curve with a jump, a shorter prefix can), and nothing when no part beats
    one plain pass."""

    def __init__(self, recordings: Sequence[Recording], ngram: NgramProposer, pass_s: Callable[[int], float], k_max: int) -> None:
        self._next = iter(recordings)  # replay() begins them in order (a prompt may recur with another length)
        self.ngram, self.pass_s, self.k_max = ngram, pass_s, k_max
        self.prompt_len, self.output = 0, []  # the recording being replayed

    def begin(self, prompt: Sequence[int], sampled: bool, alongside: int = 0, tokens_left: int | None = None) -> list[NgramProposer]:
        rec = next(self._next)
        assert list(prompt) == rec.prompt, "replayed out of order"
        self.prompt_len, self.output = len(prompt), rec.output
        return [self.ngram]

    def decide(self, context: Sequence[int], alongside: int = 0) -> Decision:
        t = len(context) - self.prompt_len  # output tokens already in the context
        k = min(self.k_max, len(self.output) - t - 1)
        drafted = self.ngram.propose(context, k, _GREEDY, np.random.default_rng(0)).tokens[:k] if k > 0 else []
        accepted = greedy_verify(drafted, np.asarray(self.output[t : t + len(drafted) + 1])).accepted
        a = max(range(accepted + 1), key=lambda j: ((j + 1) / self.pass_s(j + 1), -j))  # 0: plain pays best
        return Decision(self.ngram if a else None, a)

    def offer(self, context: Sequence[int]) -> None:
        return None  # runs alone: it decides each step itself

    def observe(self, step: StepStats) -> None:
        pass


def oracle(
    recordings: Sequence[Recording], ngram: NgramProposer, pass_s: Callable[[int], float], k_max: int,
    steps: list[StepStats] | None = None,
) -> StepTally:
    """Prompt lookup with hindsight (_Hindsight), replayed as any policy is. No policy can know
    what it knows, so its speedup is the reference a policy is read against (it is myopic, step
    by step, so not a proof of optimality)."""
    return replay(recordings, _Hindsight(recordings, ngram, pass_s, k_max), ngram, pass_s, steps)


def compare(
    workloads: Mapping[str, Sequence[Recording]],
    make_controller: Callable[[NgramProposer], Controller],
    pass_s: Callable[[int], float],
    fixed_k: Sequence[int] = (2, 4, 8),
    orders: Sequence[Sequence[str]] | None = None,
    ngram_n: tuple[int, int] = (2, 12),
    oracle_k: int = 0,
    piece: Callable[[int], bytes] | None = None,
) -> dict[str, dict[str, float]]:
    """Speedup over plain per workload for ngram at each fixed k, for the oracle with drafts up
    to oracle_k (0: left out), and for one auto controller that sees the workloads in turn (per
    order: what it learnt on one carries to the next). Prompt lookup reads tokens' text through
    `piece` (the recordings' tokenizer; None: by id only). Returns {arm: {workload: speedup}};
    auto's figure is its worst over the orders."""
    def new_ngram() -> NgramProposer:
        return NgramProposer(*ngram_n, piece=piece)

    def speed(recs: Sequence[Recording], policy: SpeculationPolicy, ngram: NgramProposer) -> float:
        return rate(replay(recs, policy, ngram, pass_s))

    def fixed(recs: Sequence[Recording], k: int) -> float:
        ngram = new_ngram()
        return speed(recs, FixedPolicy(ngram, k), ngram)

    plain = {w: fixed(r, 0) for w, r in workloads.items()}
    table = {f"ngram k={k}": {w: fixed(r, k) / plain[w] for w, r in workloads.items()} for k in fixed_k}
    if oracle_k:
        table["oracle"] = {w: rate(oracle(r, new_ngram(), pass_s, oracle_k)) / plain[w] for w, r in workloads.items()}
    names = list(workloads)
    orders = orders or [names[i:] + names[:i] for i in range(len(names))]  # each workload once first
    auto: dict[str, float] = {}
    for order in orders:
        ngram = new_ngram()
        controller = make_controller(ngram)
        for w in order:
            gain = speed(workloads[w], controller, ngram) / plain[w]
            auto[w] = min(auto.get(w, gain), gain)
    table["auto"] = auto
    return table


def load_recordings(path: Path) -> dict[str, list[Recording]]:
    """{workload: [{"prompt": [...], "output": [...]}]} as scripts/controller_replay.py records it."""
    raw = json.loads(path.read_text())
    return {w: [Recording(list(r["prompt"]), list(r["output"])) for r in recs] for w, recs in raw.items()}
