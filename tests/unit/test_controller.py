"""The controller on a scripted machine: scripted pass costs and scripted acceptance."""

from __future__ import annotations

import numpy as np
import pytest

from homespec.config import ControllerConfig
from homespec.llama.runtime import stream_graphs
from homespec.speculation.controller import EXPLORE_BUDGET, MAX_BACKOFF, Choice, Controller, calibration_bumps, together_drafting_s
from homespec.speculation.engine import OFF, StepStats
from homespec.speculation.proposers.base import Evidence, ProposalInfo
from homespec.speculation.proposers.ngram import MATCH_CAP, Match

from .fakes import ScriptedModel, ScriptedNgram

K_MAX = 16


def cpu_cost(n: int) -> float:
    """2-core CPU: compute-bound, a pass over n tokens costs ~0.45 of a pass per extra token."""
    return 0.085 * (1 + 0.45 * (n - 1))


def gpu_cost(n: int) -> float:
    """GPU: memory-bound, the pass cost is nearly flat in n."""
    return 0.020 * (1 + 0.01 * (n - 1))


class Machine:
    """Plays the steps a controller decides, with Bernoulli acceptance per position."""

    def __init__(self, cost, acceptance: dict[str, float], draft_s: float = 0.02, seed: int = 0, ngram_cont: int = 16,
                 k_limit: int | None = None):
        self.cost, self.acceptance, self.draft_s = cost, acceptance, draft_s
        self.k_limit = k_limit  # the engine's clip of k (near max_tokens or n_ctx); None: none
        self.rng = np.random.default_rng(seed)
        self.ngram_cont = ngram_cont
        self.ctx = [0] * 10

    def peek(self, context, k):
        return Match([1] * min(k, self.ngram_cont), 5) if self.ngram_cont else Match([])

    def controller(self, proposers=("draft", "ngram"), **cfg) -> Controller:
        made = [ScriptedNgram(self.peek) if p == "ngram" else ScriptedModel(p) for p in proposers]
        c = Controller(made, ControllerConfig(**cfg), k_max=K_MAX)
        c.cost.set_verify({n: self.cost(n) for n in range(1, K_MAX + 2)})
        c.shared.set_verify({n: self.cost(n) for n in range(1, K_MAX + 2)})  # as calibrate() does
        c.cost.propose_s["draft"] = self.draft_s
        return c

    def step(self, c: Controller, alongside: int = 0) -> StepStats:
        d = c.decide(self.ctx, alongside)
        k = d.k if self.k_limit is None else min(d.k, self.k_limit)
        name = d.name if k else OFF
        outcomes: list[bool] = []
        for _ in range(k):
            ok = bool(self.rng.random() < self.acceptance.get(name, 0.0))
            outcomes.append(ok)
            if not ok:
                break
        n = sum(outcomes)
        draft_s = self.draft_s * k if name == "draft" else 0.0
        # the evidence the proposer offered for this context, as a real proposal carries it
        info = ProposalInfo(d.proposer.preview(self.ctx, k).evidence) if d.proposer and k else ProposalInfo()
        s = StepStats(name, k, k, n, draft_s, self.cost(k + 1), tuple(outcomes), info)
        c.observe(s)
        self.ctx += [1] * (n + 1)
        return s

    def run(self, c: Controller, steps: int, alongside: int = 0) -> list[StepStats]:
        return [self.step(c, alongside) for _ in range(steps)]


def test_picks_plain_decoding_when_verification_is_expensive_and_acceptance_low():
    m = Machine(cpu_cost, {"draft": 0.3, "ngram": 0.2})
    c = m.controller()
    steps = m.run(c, 300)
    late = steps[100:]
    assert sum(s.proposer == OFF for s in late) / len(late) > 0.9
    assert c.view.proposer == OFF and c.view.k == 0


def test_picks_large_k_when_verification_is_cheap_and_acceptance_high():
    m = Machine(gpu_cost, {"draft": 0.9, "ngram": 0.0}, draft_s=0.002, ngram_cont=0)
    c = m.controller()
    steps = m.run(c, 200)
    ks = [s.k for s in steps[50:] if s.proposer == "draft"]
    assert len(ks) > 100 and np.median(ks) >= 6


def test_on_a_cpu_a_perfect_ngram_copy_uses_long_drafts():
    m = Machine(cpu_cost, {"draft": 0.1, "ngram": 1.0}, ngram_cont=16)
    c = m.controller()
    steps = m.run(c, 100)
    ks = [s.k for s in steps[20:] if s.proposer == "ngram"]
    assert len(ks) > 70 and np.median(ks) >= 8


def test_ngram_without_a_match_is_never_chosen():
    m = Machine(cpu_cost, {"ngram": 1.0}, ngram_cont=0)
    c = m.controller(proposers=("ngram",))
    assert all(s.proposer == OFF for s in m.run(c, 50))


def test_ngram_k_is_capped_by_the_continuation_it_has():
    m = Machine(cpu_cost, {"ngram": 1.0}, ngram_cont=3)
    c = m.controller(proposers=("ngram",))
    assert max(s.k for s in m.run(c, 50)) <= 3


def test_switches_speculation_off_within_bounded_steps_after_acceptance_drops():
    m = Machine(gpu_cost, {"draft": 0.95}, draft_s=0.002, ngram_cont=0)
    c = m.controller(proposers=("draft",))
    m.run(c, 100)
    assert c.view.proposer == "draft"
    m.acceptance["draft"] = 0.0
    steps = m.run(c, 60)
    first_plain = next(i for i, s in enumerate(steps) if s.proposer == OFF)
    assert first_plain <= 30, f"still drafting {first_plain} steps after acceptance fell to 0"


def test_returns_to_speculation_within_bounded_steps_after_acceptance_recovers():
    m = Machine(cpu_cost, {"draft": 0.0}, draft_s=0.01, ngram_cont=0)
    c = m.controller(proposers=("draft",), explore_every=16)
    m.run(c, 200)
    assert c.view.proposer == OFF
    m.acceptance["draft"] = 1.0
    steps = m.run(c, 400)
    first_streak = next(
        (i for i in range(len(steps) - 5) if all(s.proposer == "draft" for s in steps[i : i + 5])), None
    )
    assert first_streak is not None and first_streak <= 300, "never went back to drafting"


def test_exploration_costs_at_most_its_budget():
    m = Machine(cpu_cost, {"draft": 0.0, "ngram": 0.0}, draft_s=0.03)
    c = m.controller(explore_every=4)
    m.run(c, 1000)
    probe_cap = c.cost.verify(5) + 4 * 0.03  # the most one probe can overshoot by
    assert c.explore_s <= EXPLORE_BUDGET * c.total_s + probe_cap
    assert c.view.probes > 0


def test_decisions_are_deterministic_for_the_same_observations():
    runs = []
    for _ in range(2):
        m = Machine(cpu_cost, {"draft": 0.6, "ngram": 0.7}, seed=3)
        c = m.controller(explore_every=8)
        runs.append([(s.proposer, s.k) for s in m.run(c, 300)])
    assert runs[0] == runs[1]


def test_uncalibrated_controller_decodes_plainly():
    c = Controller([ScriptedModel("draft")], ControllerConfig(), k_max=K_MAX)
    assert c.decide([1, 2, 3]).name == OFF


def test_view_reports_baseline_speedup_and_gain_per_k():
    m = Machine(cpu_cost, {"ngram": 1.0}, ngram_cont=16)
    c = m.controller(proposers=("ngram",))
    m.run(c, 80)
    v = c.view
    assert v.baseline_tps == pytest.approx(1 / cpu_cost(1))
    assert v.speedup is not None and v.speedup > 1.2
    assert len(v.gains["ngram"]) == K_MAX and max(v.gains["ngram"]) > 1.2
    assert "ngram" in v.reason and "x plain" in v.reason


def test_a_proposer_that_cannot_pay_even_when_always_right_is_never_probed():
    # Draft costs 0.7 of a target pass per token: even at 100 % acceptance it loses on a CPU.
    m = Machine(cpu_cost, {"draft": 1.0}, draft_s=0.06, ngram_cont=0)
    c = m.controller(proposers=("draft",), explore_every=2)
    steps = m.run(c, 500)
    assert all(s.proposer == OFF for s in steps)
    assert c.begin([1, 2, 3]) == []


def test_a_draft_never_seen_is_probed_at_its_first_chance_and_then_kept_where_it_pays():
    # A cheap draft accepted 0.9 of the time, but the prior (0.5) says it loses: before, it waited
    # for a budget the first answers had not built up and they decoded plainly.
    m = Machine(xeon_cost, {"draft": 0.9}, draft_s=0.014, ngram_cont=0)
    c = m.controller(proposers=("draft",))
    steps = m.run(c, 40)
    assert steps[0].proposer == "draft"  # the probe, at once
    assert sum(s.proposer == "draft" for s in steps) >= 30


def test_prompt_lookup_already_seen_is_not_probed_at_first_sight_of_each_new_match_length():
    # Its dozen kinds of evidence each start at a prior that says whether they pay; a first-sight
    # probe of every new one is a loss the prior foresaw (on a steep curve, a few passes each).
    def steep(n: int) -> float:  # a row costs 0.7 of a pass: a 1-token draft pays at 0.9, not at 0.67
        return 0.033 * (1 + 0.7 * (n - 1))

    m = Machine(steep, {})
    c = m.controller(proposers=("ngram",))
    seen = Match([1] * 16, 2, from_prompt=True)
    c.proposers["ngram"].peek = lambda ctx, k: seen
    first = c.decide(m.ctx)
    assert first.name == "ngram"  # prompt lookup never observed: probed at once
    c.observe(StepStats("ngram", first.k, first.k, 0, 0.0, steep(first.k + 1), (False,),
                        ProposalInfo(c.proposers["ngram"].evidence(seen))))
    c.proposers["ngram"].peek = lambda ctx, k: Match([1] * 16, 3)  # a new key: a 3-token repeat of the answer
    assert c.decide(m.ctx).name == OFF  # its prior (0.67) does not pay, and the budget is empty


def test_a_draft_never_seen_waits_for_the_budget_when_catching_up_is_long():
    m = Machine(xeon_cost, {"draft": 0.9}, draft_s=0.014, ngram_cont=0)
    c = m.controller(proposers=("draft",))
    c.cost.catchup_s["draft"] = 0.003
    c.proposers["draft"].behind = 2000  # a long prompt unread: 6 s to catch up
    assert all(s.proposer == OFF for s in m.run(c, 20))


def test_a_draft_reads_the_prompt_only_when_the_tokens_left_can_pay_its_prefill_back():
    m = Machine(gpu_cost, {"draft": 0.95}, draft_s=0.002, ngram_cont=0)
    c = m.controller(proposers=("draft",))
    m.run(c, 100)  # drafting pays: 0.95 acceptance, a cheap draft, a flat verify curve
    assert c.view.proposer == "draft"
    draft = c.proposers["draft"]
    draft.behind = 100  # tokens of the prompt it has not read
    assert c.begin([0] * 100, tokens_left=512) == [draft]  # 0.2 s of prefill, seconds saved
    long_prompt = [0] * 4000
    draft.behind = 4000  # 8 s of prefill: 16 tokens cannot save that
    assert c.begin(long_prompt, tokens_left=16) == []
    assert c.begin(long_prompt) == [draft]  # no bound given: as before
    draft.behind = 20  # a chat's next turn: the draft holds the history, 20 new tokens to read
    assert c.begin(long_prompt, tokens_left=16) == [draft]


def test_a_long_ngram_match_is_tried_on_first_sight():
    m = Machine(cpu_cost, {"ngram": 1.0}, ngram_cont=16)  # peek reports match length 5
    c = m.controller(proposers=("ngram",))
    c.proposers["ngram"].peek = lambda ctx, k: Match([1] * 16, 12, from_prompt=True)  # the output is copying the prompt
    assert c.decide([0] * 20).name == "ngram"


def test_a_long_copy_of_the_prompt_and_a_long_repeat_of_the_answer_are_learned_apart():
    # Edits copy the prompt and keep every token; prose repeating its own phrases breaks off at
    # once. Both are 32-token matches: only where they point tells them apart.
    m = Machine(cpu_cost, {})
    c = m.controller(proposers=("ngram",))
    copy, repeat = Match([1] * 16, 32, from_prompt=True), Match([1] * 16, 32, from_prompt=False)
    for i in range(60):
        match = copy if i % 2 else repeat
        c.proposers["ngram"].peek = lambda ctx, k, match=match: match
        d = c.decide(m.ctx)
        n = d.k if match is copy else 0
        outcomes = (True,) * n if n == d.k else (False,)
        info = ProposalInfo(Evidence(32, match.from_prompt))
        c.observe(StepStats(d.name, d.k, d.k, n, 0.0, cpu_cost(d.k + 1), outcomes[: d.k], info))
    c.proposers["ngram"].peek = lambda ctx, k: copy
    on_copy = c.decide(m.ctx)
    c.proposers["ngram"].peek = lambda ctx, k: repeat
    on_repeat = c.decide(m.ctx)
    assert on_copy.name == "ngram" and on_copy.k >= 8
    assert on_repeat.name == OFF


def test_a_short_match_that_resumes_a_copy_is_learned_apart_from_the_same_match_by_coincidence():
    # An edit's 2-token match just past where its copy broke off runs on for dozens of tokens;
    # the same 2-token match into the prompt in a chat answer is kept for a token or two.
    m = Machine(cpu_cost, {})
    c = m.controller(proposers=("ngram",))
    c.req.earned["ngram"] = K_MAX  # this request has copied long runs already: k is not capped
    for _ in range(40):  # 8-token drafts under each: the resumptions kept whole, the others left at once
        c.observe(StepStats("ngram", 8, 8, 8, 0.0, cpu_cost(9), (True,) * 8, ProposalInfo(Evidence(2, True, resumes=True))))
        c.observe(StepStats("ngram", 8, 8, 0, 0.0, cpu_cost(9), (False,), ProposalInfo(Evidence(2, True))))
    c.proposers["ngram"].peek = lambda ctx, k: Match([1] * 16, 2, from_prompt=True, resumes=True)
    on_resumes = c.decide(m.ctx)
    c.proposers["ngram"].peek = lambda ctx, k: Match([1] * 16, 2, from_prompt=True)
    on_chance = c.decide(m.ctx)
    assert on_resumes.name == "ngram" and on_resumes.k >= 8
    assert on_chance.name == OFF


def test_in_a_new_request_long_drafts_are_earned_by_accepted_runs_where_verification_is_costly():
    copy = Match([1] * 16, 32, from_prompt=True)  # the prior trusts a 32-token copy: ~0.97 a token
    m = Machine(cpu_cost, {})
    c = m.controller(proposers=("ngram",))
    c.proposers["ngram"].peek = lambda ctx, k: copy
    c.begin([0] * 10)
    ks = []
    for _ in range(2):
        d = c.decide(m.ctx)
        ks.append(d.k)
        c.observe(StepStats("ngram", d.k, d.k, d.k, 0.0, cpu_cost(d.k + 1), (True,) * d.k, ProposalInfo(Evidence(32, True))))
    # 4 = the longest draft verified within 3 passes on this curve; a run of 4 accepted earns 16
    assert ks == [4, 16]
    c.begin([0] * 10)  # the next request earns its own
    assert c.decide(m.ctx).k == 4
    g = Machine(gpu_cost, {}).controller(proposers=("ngram",))  # flat curve: nothing to earn
    g.proposers["ngram"].peek = lambda ctx, k: copy
    g.begin([0] * 10)
    assert g.decide(m.ctx).k == 16


def epyc_cost(n: int) -> float:
    """Measured at a daemon's warm-up on a 2-core AMD EPYC VM with AVX-512 (ms): a pass of a
    few rows costs nearly as many single passes; ggml's tiled matmul bends the curve past 8."""
    ns, ms = [1, 2, 3, 4, 5, 6, 8, 10, 12, 17], [45, 106, 172, 179, 213, 259, 386, 346, 425, 472]
    return float(np.interp(n, ns, ms)) / 1000


def test_an_output_copying_its_prompt_earns_drafts_as_long_as_the_copy_where_no_short_draft_can_pay():
    copy, repeat = Match([1] * 16, 32, from_prompt=True), Match([1] * 16, 32, from_prompt=False)
    m = Machine(epyc_cost, {})
    c = m.controller(proposers=("ngram",))
    prompt = [0] * 100
    c.begin(prompt)
    c.proposers["ngram"].peek = lambda ctx, k: copy
    # 2 rows cost 2.3 passes, 3 rows 3.8: no draft short enough to go unearned can beat plain
    assert c.decide(prompt + [1] * 3).name == OFF  # 3 tokens written: too few to say it copies
    assert c.decide(prompt + [1] * 40).k == 16  # 40 written, the last 32 of them a copy of the prompt
    c.proposers["ngram"].peek = lambda ctx, k: repeat  # a repeat of its own answer earns nothing
    assert c.decide(prompt + [1] * 40).name == OFF


def test_an_answer_repeating_an_earlier_answer_earns_drafts_as_a_copy_of_the_prompt_does():
    again = Match([1] * 16, 12, from_memory=True)  # 12 tokens lead into an earlier answer: a phrase it shares
    m = Machine(epyc_cost, {})
    c = m.controller(proposers=("ngram",))
    prompt = [0] * 100
    c.begin(prompt)
    c.proposers["ngram"].peek = lambda ctx, k: again
    for _ in range(10):  # such drafts have been kept in full before (pooled over requests)
        c.acc.observe(c._key("ngram", c.proposers["ngram"].evidence(again)), [True] * K_MAX)
    assert c.decide(prompt + [1] * 3).k <= 3  # 3 tokens said again: no longer drafts earned
    assert c.decide(prompt + [1] * 40).k == 8  # the 12-token match (bucket 8) earns its length


def test_the_same_question_again_drafts_its_remembered_answer_in_full_from_the_first_token():
    same = Match([1] * 16, 32, from_memory=True, repeat=True)  # the answer to this very prompt
    short = Match([1] * 16, 7, from_memory=True)  # "turn on ..." after "turn off ...": only the end matches
    alike = Match([1] * 16, 32, from_memory=True)  # a different prompt that ends as that one did (32 tokens)
    m = Machine(epyc_cost, {})
    c = m.controller(proposers=("ngram",))
    prompt = [0] * 100
    c.begin(prompt)
    for match in (short, alike):
        c.proposers["ngram"].peek = lambda ctx, k, match=match: match
        assert c.decide(prompt).name == OFF  # nothing of the answer said yet: no draft earned
    c.proposers["ngram"].peek = lambda ctx, k: same
    assert c.decide(prompt).k == 16  # before the answer's first token, all of it
    c.begin(prompt, sampled=True)
    assert c.decide(prompt).name == OFF  # a draw leaves the greedy answer: earned as a copy, step by step


def epyc_bench_cost(n: int) -> float:
    """A bench's warm-up on a 2-core AMD EPYC VM with AVX-512 (2026-12-04, ms): no dip past 8
    rows, so a draft of 5 tests nothing past position 5."""
    ns, ms = [1, 2, 3, 4, 5, 6, 8, 10, 12, 17], [33, 61, 93, 106, 125, 143, 230, 279, 296, 337]
    return float(np.interp(n, ns, ms)) / 1000


def offering(match: Match, cost) -> tuple[Controller, list[int], ProposalInfo]:
    """A controller whose one proposer, prompt lookup, offers `match` at every step of a request
    begun on a 100-token prompt; the prompt, and what a proposal of that match carries."""
    c = Machine(cost, {}).controller(proposers=("ngram",))
    prompt = [0] * 100
    c.begin(prompt)
    c.proposers["ngram"].peek = lambda ctx, k: match
    return c, prompt, ProposalInfo(c.proposers["ngram"].evidence(match))


def drafts_kept_whole(c: Controller, context: list[int], info: ProposalInfo, cost, steps: int) -> list[int]:
    """The k the controller chooses over `steps` steps, each draft kept in full."""
    ks = []
    for _ in range(steps):
        k = c.decide(context).k
        ks.append(k)
        c.observe(StepStats("ngram", k, k, k, 0.0, cost(k + 1), (True,) * k, info))
    return ks


def test_the_same_question_again_drafts_long_again_soon_after_its_answer_once_left_the_remembered_one():
    # Chat prose asked again: the answer leaves the remembered one at a near-tie (batch noise),
    # here at its 8th token, and re-joins it. That one failure must not keep every later draft
    # of a remembered answer short while each is kept whole.
    c, prompt, info = offering(Match([1] * 16, 32, from_memory=True, repeat=True), epyc_bench_cost)
    assert c.decide(prompt).k == 16
    c.observe(StepStats("ngram", 16, 16, 7, 0.0, epyc_bench_cost(17), (True,) * 7 + (False,), info))
    ks = drafts_kept_whole(c, prompt, info, epyc_bench_cost, 8)
    assert 0 < ks[0] < 16 and ks[-1] == 16, ks  # wary at once, long again after a few drafts kept whole


def test_the_same_question_is_learned_apart_from_prompts_that_only_end_alike():
    # Completions at one cursor in a changed file end alike and are answered otherwise: their
    # failures must not teach the controller to stop drafting the same question's answer.
    same = Match([1] * 16, 32, from_memory=True, repeat=True)
    alike = Match([1] * 16, 32, from_memory=True)
    m = Machine(epyc_cost, {})
    c = m.controller(proposers=("ngram",))
    prompt = [0] * 100
    c.begin(prompt)
    for _ in range(30):
        c.acc.observe(c._key("ngram", c.proposers["ngram"].evidence(alike)), [False] * K_MAX)
    c.proposers["ngram"].peek = lambda ctx, k: same
    assert c.decide(prompt).k == 16


def test_sampled_and_greedy_requests_learn_acceptance_separately():
    m = Machine(gpu_cost, {"draft": 0.95}, draft_s=0.002, ngram_cont=0)
    c = m.controller(proposers=("draft",))
    m.run(c, 100)  # greedy: drafting pays
    assert c.view.proposer == "draft"
    c.begin([0] * 10, sampled=True)
    m.acceptance["draft"] = 0.0
    m.run(c, 60)  # sampled requests reject everything
    assert c.view.proposer == OFF
    c.begin([0] * 10, sampled=False)
    m.acceptance["draft"] = 0.95
    assert c.decide([0] * 20).name == "draft"  # greedy estimates were not dragged down


def test_fixed_mode_steps_still_teach_the_controller():
    from homespec.speculation.controller import make_policy

    m = Machine(cpu_cost, {"ngram": 1.0})
    c = m.controller(proposers=("ngram",))
    policy = make_policy("ngram", 4, c)
    before = c.acc.observations(c._key("ngram", Evidence(5)))
    policy.observe(StepStats("ngram", 4, 4, 4, 0.0, cpu_cost(5), (True,) * 4, ProposalInfo(Evidence(5))))
    assert c.acc.observations(c._key("ngram", Evidence(5))) == before + 1


def test_cost_model_follows_a_machine_wide_slowdown_for_sizes_it_does_not_use():
    m = Machine(cpu_cost, {})
    c = m.controller(proposers=("draft",))
    v17 = c.cost.verify(17)
    for _ in range(15):  # the machine gets 2x slower; only plain steps (n = 1) are observed
        c.observe(StepStats(OFF, 0, 0, 0, 0.0, 2 * cpu_cost(1)))
    assert c.cost.verify(1) == pytest.approx(2 * cpu_cost(1), rel=0.05)
    assert c.cost.verify(17) == pytest.approx(2 * v17, rel=0.05)
    c.decide([0] * 10)
    assert c.view.baseline_tps == pytest.approx(1 / (2 * cpu_cost(1)), rel=0.05)


def test_probes_of_a_proposer_that_keeps_losing_grow_rarer_up_to_a_bounded_interval():
    # A GPU-like flat cost makes probes cheap: the backoff, not the budget, spaces them.
    m = Machine(gpu_cost, {"draft": 0.0}, draft_s=0.001, ngram_cont=0)
    c = m.controller(proposers=("draft",), explore_every=8)
    steps = m.run(c, 1500)
    probes = [i for i, s in enumerate(steps) if s.proposer == "draft"]
    gaps = [int(g) for g in np.diff(probes) if g > 1]  # the first steps draft on the prior, back to back
    assert len(gaps) >= 5
    assert gaps[0] < gaps[1] < gaps[2], f"probe gaps did not grow: {gaps}"
    assert max(gaps) == 8 << MAX_BACKOFF, f"the interval should stop doubling: {gaps}"


def test_probes_of_evidence_that_keeps_losing_grow_rarer_though_the_proposer_pays_under_other_evidence():
    # Prose: prompt lookup's 2-token matches into the answer are never kept, while its rare long
    # copies of the prompt always are and are chosen on merit. Those choices must not reset the
    # backoff of probes under the 2-token evidence (they did, per proposer: probes every 32 steps).
    # A curve where a 1-token draft costs 1.2 passes (one kept in 12 does not pay) and a probe
    # little: the backoff, not the budget, spaces the probes.
    m = Machine(lambda n: 0.02 * (1 + 0.2 * (n - 1)), {}, ngram_cont=0)
    c = m.controller(proposers=("ngram",), explore_every=8)
    ngram = c.proposer("ngram")
    weak = []  # step numbers of steps drafted under the 2-token evidence
    for i in range(2000):
        strong = i % 100 == 0  # rarer than the longest probe interval (64 steps)
        ngram.peek = lambda context, k, strong=strong: Match([1] * k, 16 if strong else 2, from_prompt=strong)
        d = c.decide(m.ctx)
        evidence = ngram.preview(m.ctx, d.k).evidence if d.k else Evidence()
        outcomes = (True,) * d.k if strong else (False,) * min(d.k, 1)
        c.observe(StepStats(d.name, d.k, d.k, sum(outcomes), 0.0, m.cost(d.k + 1), outcomes, ProposalInfo(evidence)))
        m.ctx += [1] * (sum(outcomes) + 1)
        if d.k and not strong:
            weak.append(i)
    gaps = [int(g) for g in np.diff(weak)]
    assert c.view.chosen.get("ngram:16", 0) > 15  # the copies drafted on merit
    # Backed off to the longest interval after the proposer was last used, and still retried in
    # every stretch without copies (per proposer they came back 8, 16 and 32 steps after each).
    assert len(gaps) > 15 and all(8 << MAX_BACKOFF <= g <= 100 for g in gaps[-10:]), f"no backoff: {gaps}"


def test_a_probe_whose_k_the_engine_clipped_still_counts_as_a_probe():
    # The engine cuts k near max_tokens / n_ctx: a probe decided at k = 4 runs at k = 2. It still
    # measured the proposer, so it counts (view, budget) and a losing one backs off.
    m = Machine(gpu_cost, {"draft": 0.0}, draft_s=0.001, ngram_cont=0, k_limit=2)
    c = m.controller(proposers=("draft",), explore_every=8)
    steps = m.run(c, 1500)
    drafted = [i for i, s in enumerate(steps) if s.proposer == "draft"]
    assert all(steps[i].k <= 2 for i in drafted)
    gaps = [int(g) for g in np.diff(drafted) if g > 1]
    assert c.view.probes == len(gaps) > 5  # each drafted step after plain ones was a probe (k = 4, cut to 2)
    assert c.explore_s > 0
    assert gaps[0] < gaps[1] < gaps[2] and max(gaps) == 8 << MAX_BACKOFF, f"no backoff: {gaps}"


def test_no_probe_runs_beside_other_requests_whose_rows_it_would_stall():
    # The flat-cost setting of the backoff test probes every few steps alone; beside 3 other
    # requests' rows it must not probe at all.
    m = Machine(gpu_cost, {"draft": 0.0}, draft_s=0.001, ngram_cont=0)
    c = m.controller(proposers=("draft",), explore_every=8)
    m.run(c, 100)  # alone: the prior's drafts, then probes
    probes_alone = c.view.probes
    steps = m.run(c, 400, alongside=3)
    assert probes_alone > 0 and c.view.probes == probes_alone
    assert all(s.proposer == OFF for s in steps)


def test_a_proposer_that_pays_only_when_every_token_is_accepted_is_never_probed():
    # 0.04 s a token: at 100 % acceptance k=8..16 would beat plain by ~14 %, at 90 % nothing does.
    m = Machine(cpu_cost, {"draft": 1.0}, draft_s=0.04, ngram_cont=0)
    c = m.controller(proposers=("draft",), explore_every=4)
    c.acc.observe(c._key("draft"), [False, False, False, False])  # a first look that went badly
    steps = m.run(c, 400)
    assert all(s.proposer == OFF for s in steps)
    assert c.view.probes == 0


def xeon_cost(n: int) -> float:
    """Measured on a 2-core AVX-512 Xeon (warm-up, ms): its repacked matmul takes rows 4 at a
    time, and the rows left over cost more each, so 4 rows cost less than 3."""
    ns, ms = [1, 2, 3, 4, 5, 6, 8, 10, 12, 17], [94, 144, 195, 167, 225, 275, 324, 406, 399, 448]
    return float(np.interp(n, ns, ms)) / 1000


def beside(cost, rate: float, alongside: int) -> tuple[int, int]:
    """k chosen alone and beside `alongside` rows of other requests, once acceptance is learned."""
    m = Machine(cost, {"ngram": rate}, seed=3)
    c = m.controller(proposers=("ngram",))
    m.run(c, 300)
    alone, with_others = c.decide(m.ctx).k, c.decide(m.ctx, alongside=alongside).k
    assert c.view.baseline_tps == pytest.approx(1 / cost(1))  # the baseline stays plain decoding alone
    return alone, with_others


def test_beside_other_requests_a_draft_pays_only_where_it_makes_this_requests_tokens_cheaper() -> None:
    """The others' rows are computed whatever this request does, and their tokens come no sooner
    for its draft: on a CPU's linear curve every row costs the same, so beside three requests
    even a draft accepted 95 % of the time (which pays alone) loses; where a few more rows
    cost nothing (a GPU below its compute bound) a draft at 70 % still pays there."""
    alone, with_others = beside(cpu_cost, 0.95, 3)
    assert alone > 0 and with_others == 0
    assert beside(lambda n: 0.020, 0.7, 3)[1] > 0


def one_graph(rows):
    """Runtime.graphs with one KV buffer: the pass is one graph of all rows."""
    return [(len(rows), sum(rows))]


def streams(rows):
    """Runtime.graphs with a KV stream per sequence, the requests in slots 0, 1, ..."""
    return stream_graphs(dict(enumerate(rows)))


def offers(c: Controller, ctx, n: int):
    return [c.policy().offer(ctx) for _ in range(n)]


def test_a_planned_pass_drafts_for_every_request_where_a_pass_of_all_drafts_beats_one_of_plain_rows() -> None:
    """Beside three plain rows a draft accepted 95 % of the time loses on a CPU's linear curve
    (the test above: their passes happen anyway). Planned together, the pass of four such drafts
    beats the pass of four plain rows, and all four draft; four weak drafts do not."""
    m = Machine(cpu_cost, {"ngram": 0.95}, seed=3)
    c = m.controller(proposers=("ngram",))
    m.run(c, 300)
    assert c.decide(m.ctx, alongside=3).k == 0
    plan = c.plan(offers(c, m.ctx, 4), one_graph)
    assert all(d.k > 0 for d in plan) and "in a pass of 4" in c.view.reason
    weak = Machine(cpu_cost, {"ngram": 0.2}, seed=3)
    cw = weak.controller(proposers=("ngram",))
    weak.run(cw, 300)
    assert all(d.k == 0 for d in cw.plan(offers(cw, weak.ctx, 4), one_graph))


def test_in_streams_a_far_copy_beside_plain_rows_is_planned_as_the_graph_of_its_own_it_makes() -> None:
    """With a KV stream per sequence, 17, 1, 1 and 1 rows run as a graph of 4 rows and one of 16:
    the pass of an edit's 16-token copy beside three plain rows beats the pass of four plain
    rows, so the copy is planned, and the others' weak drafts are not."""
    m = Machine(cpu_cost, {"ngram": 1.0}, seed=3)
    c = m.controller(proposers=("ngram",))
    m.run(c, 50)
    made = offers(c, m.ctx, 4)
    made[0].choices = [Choice(OFF, 0, 1.0, 0.0), Choice("ngram", 16, 17.0, 0.0)]
    for o in made[1:]:
        o.choices = [Choice(OFF, 0, 1.0, 0.0), Choice("ngram", 4, 3.0, 0.0)]
    assert [d.k for d in c.plan(made, streams)] == [16, 0, 0, 0]


def test_a_planned_pass_holds_at_most_together_rows() -> None:
    """A request that arrives waits for the pass being run: four perfect copies on a flat curve
    draft k_max each, and within together_rows rows together when it is set."""
    m = Machine(gpu_cost, {"ngram": 1.0}, seed=3)
    c = m.controller(proposers=("ngram",))
    m.run(c, 100)
    assert [d.k for d in c.plan(offers(c, m.ctx, 4), one_graph)] == [K_MAX] * 4
    c.together_rows = 32
    plan = c.plan(offers(c, m.ctx, 4), one_graph)
    assert sum(d.k + 1 for d in plan) <= 32 and all(d.k > 0 for d in plan)


def test_beside_other_requests_a_draft_takes_the_rows_a_tiled_kernel_gives_away() -> None:
    # Beside 2 rows a third costs 51 ms, a third and a fourth together 23 ms: one drafted row
    # is cheaper than none. Beside 3 rows a plain row is free, and any draft starts a new tile.
    assert beside(xeon_cost, 0.95, 2)[1] > 0
    assert beside(xeon_cost, 0.95, 3)[1] == 0


def test_a_draft_that_sat_out_is_priced_with_reading_what_it_missed() -> None:
    # On a flat curve a draft accepted 95 % of the time pays, while it is in step; 400 tokens
    # behind, at 5 ms a token, catching up costs 2 s: more than the step could ever gain.
    m = Machine(gpu_cost, {"draft": 0.95}, draft_s=0.001, ngram_cont=0)
    c = m.controller(proposers=("draft",), explore_every=10_000)
    c.cost.catchup_s["draft"] = 0.005
    m.run(c, 100)
    assert c.decide(m.ctx).name == "draft"
    c.proposers["draft"].behind = 2  # a step's own lag (bonus and last accepted token): no switching cost
    assert c.decide(m.ctx).name == "draft"
    c.proposers["draft"].behind = 400
    assert c.decide(m.ctx).name == OFF


def test_a_pass_shared_with_other_requests_teaches_the_shared_curve_the_cost_of_all_its_rows() -> None:
    c = Machine(cpu_cost, {}).controller(proposers=("ngram",))
    alone = [c.cost.verify(n) for n in range(1, K_MAX + 2)]
    shape = c.shared.verify(6) / c.shared.verify(1)
    step = StepStats("ngram", 2, 2, 1, 0.001, 0.9, (True, False), ProposalInfo(), pass_rows=6, pass_s=3 * c.shared.verify(6))
    c.observe(step)
    # Learned as a pass over 6 rows (its shape grew), not over this request's 3 (which would
    # move the pace of every size alike and leave the shape as it was) ...
    assert c.shared.verify(6) / c.shared.verify(1) > shape * 1.01
    # ... and not as a lone request's pass, which a pass of several requests' rows is not.
    assert [c.cost.verify(n) for n in range(1, K_MAX + 2)] == alone


def test_a_pass_that_also_read_prompts_teaches_no_cost() -> None:
    c = Machine(cpu_cost, {}).controller(proposers=("ngram",))
    before = [c.cost.verify(n) for n in range(1, 8)]
    c.observe(StepStats("ngram", 2, 2, 1, 0.001, 5.0, (True, False), ProposalInfo(), pass_rows=6, pass_s=5.0, timed=False))
    assert [c.cost.verify(n) for n in range(1, 8)] == before


def test_calibration_times_long_passes_where_the_curve_bends_not_a_line_from_12_rows():
    def curve(n: int) -> float:  # seconds; past 17 rows each row costs less (0.8 power), as on the EPYC
        return epyc_cost(n) if n <= 17 else epyc_cost(17) * (n / 17) ** 0.8

    timed: list[int] = []
    c = Controller([], ControllerConfig(), k_max=48)
    c.calibrate(lambda n: timed.append(n) or curve(n), passes=1)
    # each after a 1-token pass; then, again, the two sizes dearer than their neighbours' line (this
    # curve's real steps: 3 rows, and 8 where the tiled matmul starts)
    assert timed[1::2] == [2] * 4 + [3] * 4 + [4] * 4 + [5] * 4 + [6] * 4 + [8] * 4 + [10, 12, 17, 25, 33, 49] + [3] * 4 + [8] * 4
    assert set(timed[::2]) == {1}
    assert c.cost.verify(33) == pytest.approx(curve(33))  # measured, not interpolated
    assert c.cost.verify(8) == pytest.approx(curve(8))  # a real step, timed again, kept


def epyc_vnni_cost(n: int) -> float:
    """Target passes after 300 tokens on a 2-core AVX-512 EPYC with the wheel's VNNI kernels
    (2026-12-07, ms): ~8 ms a row past 4."""
    ns = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 17, 25, 33, 49, 65]
    ms = [32, 35, 38, 44, 57, 64, 72, 76, 87, 95, 104, 164, 240, 304, 448, 592]
    return float(np.interp(n, ns, ms)) / 1000


def test_calibration_bumps_are_the_sizes_dearer_than_the_line_through_their_neighbours() -> None:
    sizes = (1, 2, 3, 4, 5, 6, 8, 10, 12, 17, 25, 33, 49, 65)
    smooth = {n: epyc_vnni_cost(n) for n in sizes}
    assert calibration_bumps(smooth) == []
    # a bench's warm-up on that VM (ms): 6 rows dearer than 8 is cheap, 33 and 65 far over the passes
    warmup = {1: 26, 2: 28, 3: 30, 4: 34, 5: 43, 6: 71, 8: 85, 10: 113, 12: 123, 17: 191, 25: 277, 33: 397, 49: 443, 65: 792}
    assert calibration_bumps(warmup) == [6, 33, 65]
    assert calibration_bumps(smooth | {65: 0.9 * 0.792}) == [65]  # the largest, against the line through the two below


def test_calibration_times_again_a_size_the_machine_slowed_and_prices_it_as_it_runs() -> None:
    # The VM slows down for the first two timings of 6 rows and both of 65: priced so, neither would
    # be chosen again, so no live step would correct them.
    seen: dict[int, int] = {}

    def noisy(n: int) -> float:
        seen[n] = seen.get(n, 0) + 1
        return epyc_vnni_cost(n) * (1.6 if n in (6, 65) and seen[n] <= 2 else 1.0)

    c = Controller([], ControllerConfig(), k_max=64)
    c.calibrate(noisy, passes=2)
    for n in (5, 6, 8, 49, 65):
        assert c.cost.verify(n) == pytest.approx(epyc_vnni_cost(n), rel=0.01)
    assert seen[6] == 4 + 4 and seen[65] == 2 + 4 and seen[8] == 4  # the bumps again, nothing else


def test_calibration_keeps_each_pass_to_plain_decoding_ratio_while_the_machine_slows_down() -> None:
    calls = 0

    def drifting(n: int) -> float:  # 2 % slower with every pass timed, as a VM's pace drifts
        nonlocal calls
        calls += 1
        return epyc_cost(n) * (1.0 + 0.02 * calls)

    c = Controller([], ControllerConfig(), k_max=16)
    c.calibrate(drifting, passes=2)
    for n in (2, 3, 5, 9, 17):
        assert c.cost.verify(n) / c.cost.verify(1) == pytest.approx(epyc_cost(n) / epyc_cost(1), rel=0.03)


def test_the_same_question_again_drafts_as_far_as_its_near_ties_make_worth_it() -> None:
    # Asked again, a greedy answer leaves the remembered one only where batch noise flips a
    # near-tie. A remembered answer with clear leads is drafted whole; one with a coin toss at
    # every 4th token (gaps 0.01 logits) is drafted up to the first, and once such coin tosses
    # are seen never to flip (exact mode's batch-invariant passes), whole again.
    m = Machine(epyc_bench_cost, {})
    c = m.controller(proposers=("ngram",))
    prompt = [0] * 100
    c.begin(prompt)
    clear = np.full(16, 3.0, np.float32)
    ties = clear.copy()
    ties[3::4] = 0.01
    for gaps, k in ((clear, 16), (ties, 3)):
        c.proposers["ngram"].peek = lambda ctx, k, gaps=gaps: Match([1] * 16, 32, from_memory=True, repeat=True, gaps=gaps)
        assert c.decide(prompt).k == k
    info = ProposalInfo(Evidence(MATCH_CAP, from_memory=True, repeat=True), gaps=ties)
    for _ in range(10):
        c.observe(StepStats("ngram", 16, 16, 16, 0.0, epyc_bench_cost(17), (True,) * 16, info))
    assert c.decide(prompt).k == 16


def test_a_long_copy_of_the_prompt_drafts_long_again_after_one_early_failure_though_short_drafts_were_kept():
    # A copy of the prompt left once at its 2nd token (where an edit changed something): the short
    # drafts chosen after it, each kept whole, never test position 2 again, so only the key's rate
    # over every position it tested can bring the long drafts back.
    c, prompt, info = offering(Match([1] * 16, 20, from_prompt=True), epyc_bench_cost)
    # As replayed (scripts/controller_replay.py): a copy of 3 kept in code, one left at its 2nd
    # token in chat; then every edit drafted 1 token at a time on its 16-token copies.
    c.observe(StepStats("ngram", 3, 3, 3, 0.0, epyc_bench_cost(4), (True,) * 3, info))
    c.observe(StepStats("ngram", 3, 3, 1, 0.0, epyc_bench_cost(4), (True, False), info))
    ks = drafts_kept_whole(c, prompt + [1] * 40, info, epyc_bench_cost, 12)
    assert ks[-1] == 16, ks


def test_in_streams_a_draft_beside_plain_rows_is_priced_as_the_pass_of_its_own_it_makes() -> None:
    """On a flat curve a draft's rows cost almost nothing in one graph with the others'
    (test_beside_other_requests_a_draft_pays_only_where_it_makes_this_requests_tokens_cheaper);
    with a KV stream per sequence they are a second graph, a whole pass."""
    m = Machine(lambda n: 0.020, {"ngram": 0.7}, seed=3)
    c = m.controller(proposers=("ngram",))
    m.run(c, 300)
    assert c.decide(m.ctx, alongside=3).k > 0
    c.split_steps = True
    assert c.decide(m.ctx, alongside=3).k == 0
    assert c.decide(m.ctx).k > 0  # alone, a pass is one graph


def test_a_draft_made_beside_other_requests_drafts_teaches_no_lone_proposing_cost() -> None:
    """The draft model's passes for several requests at once take longer than one request's
    (9 against 19.5 ms a token for three on 2 cores): a lone request must not be priced at that."""
    m = Machine(cpu_cost, {"draft": 0.8}, draft_s=0.01)
    c = m.controller(proposers=("draft",))
    before = c.cost.propose_s["draft"]  # seconds a token, at the machine's pace
    shared = StepStats("draft", 3, 3, 2, 0.06, 0.2, (True, True, False), ProposalInfo(shared=True))
    c.observe(shared)
    assert c.cost.propose_s["draft"] == before
    c.observe(StepStats("draft", 3, 3, 2, 0.06, 0.2, (True, True, False), ProposalInfo()))
    assert c.cost.propose_s["draft"] != before


def test_tokens_a_draft_copied_from_the_prompt_teach_no_cost_per_drafted_token() -> None:
    """A 40-token edit draft of which the model guessed 8 (DraftProposer.copy): its seconds are
    8 passes of the draft, not 40, whose per-token cost would price every code draft at a fifth."""
    m = Machine(cpu_cost, {"draft": 0.8}, draft_s=0.01)
    c = m.controller(proposers=("draft",))
    per_token = float(c.cost.propose("draft", 1))  # seconds
    for _ in range(50):  # (untimed passes: the machine's pace stays as it is)
        c.observe(StepStats("draft", 40, 40, 40, 8 * per_token, 0.4, (True,) * 40, ProposalInfo(copied=32), timed=False))
    assert float(c.cost.propose("draft", 1)) == pytest.approx(per_token)


def test_drafting_for_several_at_once_costs_a_pass_per_token_over_the_requests_still_drafting() -> None:
    curve = np.array([0.0, 1.0, 1.1, 1.2, 1.3])  # lone passes for 1-4 requests' rows
    # drafts of 3, 1 and 1 tokens: token 1 for three requests, tokens 2 and 3 for one
    assert together_drafting_s([1, 3, 1], 0.01, curve) == pytest.approx(0.01 * (1.2 + 1.0 + 1.0))
    assert together_drafting_s([2, 2], 0.01, curve) == pytest.approx(0.01 * 2 * 1.1)
    assert together_drafting_s([1] * 6, 0.01, curve) == pytest.approx(0.01 * 1.3)  # past the curve: its last
    assert together_drafting_s([0, 0], 0.01, curve) == 0.0


def test_a_plan_prices_a_draft_model_drafting_for_all_at_once_at_its_measured_pass_over_their_rows() -> None:
    """Four requests' 2-token drafts (2.95 tokens kept each) on a CPU's linear curve: drafted one
    request after another (10 ms a token each) the pass of all drafts does not beat plain rows by
    min_gain; drafted for all in one pass per token, which costs 1.3 lone passes for four rows
    (a warm-up timing), it does."""
    m = Machine(cpu_cost, {"draft": 0.9}, draft_s=0.01)
    c = m.controller(proposers=("draft",))

    def planned(together: bool) -> list[int]:
        made = offers(c, m.ctx, 4)
        for o in made:
            o.choices = [Choice(OFF, 0, 1.0, 0.0), Choice("draft", 2, 2.95, float(c.cost.propose("draft", 2)), together)]
        return [d.k for d in c.plan(made, one_graph)]

    c.set_together_cost("draft", {1: 0.009, 2: 0.0099, 4: 0.0117})
    assert c.together_s["draft"] == pytest.approx([0.0, 1.0, 1.1, 1.2, 1.3])
    assert planned(together=False) == [0, 0, 0, 0]
    assert planned(together=True) == [2, 2, 2, 2]
    assert not any(ch.together for ch in c.policy().offer(m.ctx).choices)  # (its model drafts alone)
    c.proposers["draft"].together = object()  # as DraftProposer.together: the draft context's eval_many
    assert all(ch.together for ch in c.policy().offer(m.ctx).choices[1:])
