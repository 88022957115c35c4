"""Several generations in one pass (speculation/batch.py) on a scripted multi-sequence model:
each request's output equals its output alone, passes are shared, prompts are read in chunks
beside running decodes, and one request ending (or failing) leaves the others running."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import pytest

from homespec.speculation.batch import Batch
from homespec.speculation.engine import Decision, Engine, Event, FixedPolicy, GenerationStats, Steps, StepStats
from homespec.speculation.proposers.draft import DraftProposer
from homespec.speculation.proposers.ngram import NgramProposer
from homespec.speculation.sampling import SamplingParams

from .fakes import FakeRuntime

PROMPTS = [
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5],
    [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9],
    [1, 1, 2, 3, 5, 8, 13, 21, 34],
    [9, 9, 8, 2, 4, 4, 3, 5, 3, 6, 1, 7],
]


def policies(rt: FakeRuntime, draft: FakeRuntime, slot: int) -> list[FixedPolicy]:
    """A different fixed policy per request: plain, prompt lookup, a draft model (its own
    sequence of the draft), and a wrong draft."""
    return [
        FixedPolicy(),
        FixedPolicy(NgramProposer(1, 3), 4),
        FixedPolicy(DraftProposer(draft.slot(slot), rt.n_vocab), 3),
        FixedPolicy(DraftProposer(FakeRuntime(seed=7), rt.n_vocab), 2),
    ]


def alone(prompt: list[int], policy: FixedPolicy, **kw) -> list[int]:
    events = Engine(FakeRuntime()).generate(prompt, policy=policy, **kw)
    return [t for e in events for t in e.tokens]


def round_events(batch: Batch) -> list[tuple[Hashable, Event]]:
    """One round's events, in the order the batch delivered them."""
    out: list[tuple[Hashable, Event]] = []
    batch.step(lambda key, ev: out.append((key, ev)))
    return out


def drive(batch: Batch, starts: dict[Hashable, Steps], max_rounds: int = 1000) -> dict[Hashable, list[Event]]:
    out: dict[Hashable, list[Event]] = {key: [] for key in starts}
    for key, steps in starts.items():
        out[key] += batch.add(key, steps)
    for _ in range(max_rounds):
        if not len(batch):
            return out
        for key, ev in round_events(batch):
            out[key].append(ev)
    raise AssertionError("the batch never finished")


def tokens(events: list[Event]) -> list[int]:
    return [t for e in events for t in e.tokens]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, seed=11)], ids=["greedy", "seeded"])
def test_each_request_in_a_batch_emits_exactly_what_it_emits_alone(params: SamplingParams) -> None:
    rt, draft = FakeRuntime(n_seq=4), FakeRuntime(n_seq=4)
    want = [alone(p, policies(FakeRuntime(), FakeRuntime(), 0)[i], params=params, max_tokens=40) for i, p in enumerate(PROMPTS)]
    starts = {
        i: Engine(rt.slot(i)).steps(p, params, 40, policy=policies(rt, draft, i)[i]) for i, p in enumerate(PROMPTS)
    }
    got = drive(Batch(rt.eval_many, n_batch=512, prefill_chunk=64), starts)
    assert [tokens(got[i]) for i in range(4)] == want
    assert all(got[i][-1].finish_reason == "length" for i in range(4))


class Drafting(FixedPolicy):
    """A fixed draft of k tokens; records whether each proposal's passes were shared."""

    def __init__(self, proposer, k: int) -> None:
        super().__init__(proposer, k)
        self.shared: list[bool] = []

    def observe(self, step) -> None:
        self.shared.append(step.info.shared)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, seed=11)], ids=["greedy", "seeded"])
def test_the_draft_model_drafts_for_several_requests_in_one_pass_and_each_emits_what_it_emits_alone(params) -> None:
    """A draft model's passes for the requests drafting go through its context's eval_many
    together, a drafted token for all at once; each request's output stays its own, and steps
    drafted so tell the controller their time is no lone proposing cost."""
    rt, draft = FakeRuntime(n_seq=3), FakeRuntime(n_seq=3)
    want = [alone(p, FixedPolicy(DraftProposer(FakeRuntime(), rt.n_vocab), 3), params=params, max_tokens=30) for p in PROMPTS[:3]]
    policies = [Drafting(DraftProposer(draft.slot(i), rt.n_vocab, together=draft.eval_many), 3) for i in range(3)]
    starts = {i: Engine(rt.slot(i)).steps(p, params, 30, policy=policies[i]) for i, p in enumerate(PROMPTS[:3])}
    got = drive(Batch(rt.eval_many, n_batch=512, prefill_chunk=64), starts)
    assert [tokens(got[i]) for i in range(3)] == want
    assert any(sorted(seq for seq, _ in p) == [0, 1, 2] for p in draft.passes)  # one draft pass for all three
    assert all(any(pol.shared) for pol in policies)
    lone = Drafting(DraftProposer(FakeRuntime(), rt.n_vocab, together=draft.eval_many), 3)
    list(Engine(FakeRuntime()).generate(PROMPTS[0], params, 10, policy=lone))
    assert lone.shared and not any(lone.shared)  # alone, its passes are its own


def test_running_requests_share_one_pass_each_round_with_their_own_rows() -> None:
    rt = FakeRuntime(n_seq=3)
    starts = {i: Engine(rt.slot(i)).steps(PROMPTS[i], max_tokens=12, policy=FixedPolicy(NgramProposer(1, 3), 3)) for i in range(3)}
    drive(Batch(rt.eval_many, n_batch=512, prefill_chunk=512), starts)
    assert rt.passes[0] == [(0, len(PROMPTS[0])), (1, len(PROMPTS[1])), (2, len(PROMPTS[2]))]  # the prompts, together
    shared = [p for p in rt.passes if len(p) == 3]
    assert len(shared) >= 5  # the decode steps ran together, not one request after another
    assert {seq for p in rt.passes for seq, _ in p} == {0, 1, 2}
    for p in shared[1:]:
        assert all(1 <= n <= 4 for _, n in p)  # [last] + up to k = 3 drafts per request


def test_a_long_prompt_is_read_in_chunks_while_running_requests_keep_decoding() -> None:
    rt = FakeRuntime(n_seq=2, n_ctx=1024)
    batch = Batch(rt.eval_many, n_batch=512, prefill_chunk=32, prefill_chunk_alone=512)  # never alone here
    events: dict[Hashable, list[Event]] = {"short": [], "long": []}
    events["short"] += batch.add("short", Engine(rt.slot(0)).steps(PROMPTS[0], max_tokens=60))
    for key, ev in round_events(batch):  # its prompt, alone: one chunk
        events[key].append(ev)
    long_prompt = [(7 * i) % 60 for i in range(300)]
    events["long"] += batch.add("long", Engine(rt.slot(1)).steps(long_prompt, max_tokens=5))
    rounds = 0
    while not events["long"]:
        before = len(events["short"])
        for key, ev in round_events(batch):
            events[key].append(ev)
        rounds += 1
        assert len(events["short"]) == before + 1  # a step of the short request every round
        assert batch.last is not None and batch.last.prefill_rows <= 32
    assert rounds == -(-300 // 32)  # the prompt took ceil(300 / 32) rounds, one chunk each
    solo = alone(long_prompt, FixedPolicy(), max_tokens=5)
    while len(batch):
        for key, ev in round_events(batch):
            events[key].append(ev)
    assert tokens(events["long"]) == solo  # read in chunks, the same answer


def test_a_higher_priority_prompt_is_read_first_and_alone_while_lower_decodes_sit_out() -> None:
    rt = FakeRuntime(n_seq=3)
    batch = Batch(rt.eval_many, n_batch=512, prefill_chunk=4)
    batch.add("running", Engine(rt.slot(0)).steps(PROMPTS[0], max_tokens=50))
    while not round_events(batch):  # its prompt, in chunks of 4, to its first token
        pass
    batch.add("low", Engine(rt.slot(1)).steps(PROMPTS[1], max_tokens=5), priority=0)
    batch.add("high", Engine(rt.slot(2)).steps(PROMPTS[2], max_tokens=5), priority=5)
    n = len(PROMPTS[2])
    events = [ev for _ in range(-(-n // 4)) for ev in round_events(batch)]
    # The high-priority prompt, in chunks as on an idle daemon, in passes of its own: through its
    # own eval, with neither the running decode nor the other prompt.
    assert rt.slot(2).evals == [min(4, n - i) for i in range(0, n, 4)]
    assert [key for key, _ in events] == ["high"]  # its first token; the others sat these rounds out
    events = round_events(batch)
    assert rt.passes[-1][0] == (0, 1) and {"running", "high"} <= {key for key, _ in events}  # all back together


def test_a_lone_prompt_is_read_in_long_chunks_until_a_request_of_higher_priority_has_come() -> None:
    rt = FakeRuntime(n_seq=2, n_ctx=1024)
    batch = Batch(rt.eval_many, n_batch=512, prefill_chunk=8, prefill_chunk_alone=64)
    long_prompt = [(7 * i) % 60 for i in range(200)]
    batch.add("chat", Engine(rt.slot(0)).steps(long_prompt, max_tokens=3))
    while not round_events(batch):  # alone in its passes, nobody above it: long chunks
        pass
    assert rt.slot(0).evals == [64, 64, 64, 8]
    batch.add("command", Engine(rt.slot(1)).steps(PROMPTS[2], max_tokens=5), priority=5)
    assert [key for key, _ in round_events(batch)] == ["command"]  # its prompt (9 tokens), its pass alone
    assert rt.slot(1).evals == [9]  # the chat's decode sat out
    while len(batch):
        round_events(batch)
    # A command came once, so it may come again: a lone chat prompt now goes in short chunks,
    # while the command's own prompt, nobody above it, still reads in long ones.
    batch.add("next chat", Engine(rt.slot(0)).steps(long_prompt[::-1], max_tokens=1))
    round_events(batch)
    assert rt.slot(0).evals[-1] == 8
    batch.close()
    batch.add("next command", Engine(rt.slot(1)).steps(long_prompt[:100], max_tokens=1), priority=5)
    round_events(batch)
    assert rt.slot(1).evals[-1] == 64


def test_a_batch_handed_an_earlier_top_priority_reads_a_lone_lower_prompt_in_short_chunks() -> None:
    """The daemon hands a new batch (models loaded again) the highest priority the last one saw."""
    long_prompt = [(7 * i) % 60 for i in range(200)]
    for handed, first_chunk in ((None, 64), (5, 8), (0, 64)):
        rt = FakeRuntime(n_seq=1, n_ctx=1024)
        batch = Batch(rt.eval_many, n_batch=512, prefill_chunk=8, prefill_chunk_alone=64, top_priority=handed)
        assert batch.top_priority == handed
        batch.add("chat", Engine(rt.slot(0)).steps(long_prompt, max_tokens=1))
        round_events(batch)
        assert rt.slot(0).evals == [first_chunk], handed
        assert batch.top_priority == max(handed or 0, 0)


def test_a_request_arriving_while_a_lone_prompt_is_read_waits_one_chunk_not_the_whole_prompt() -> None:
    """A voice command that comes while a chat's long prompt is read, with nothing else running,
    once one such command has come (before that, a lone prompt reads in long chunks)."""
    rt = FakeRuntime(n_seq=2, n_ctx=1024)
    batch = Batch(rt.eval_many, n_batch=512, prefill_chunk=8, prefill_chunk_alone=64)
    batch.add("earlier command", Engine(rt.slot(1)).steps(PROMPTS[2], max_tokens=1), priority=5)
    while len(batch):
        round_events(batch)
    long_prompt = [(7 * i) % 60 for i in range(200)]
    batch.add("long", Engine(rt.slot(0)).steps(long_prompt, max_tokens=5))
    assert round_events(batch) == [] and rt.slot(0).evals == [8]  # alone, it reads one short chunk a round
    batch.add("command", Engine(rt.slot(1)).steps(PROMPTS[2], max_tokens=5), priority=5)
    # its first token after its own 9 tokens, in one pass: nothing above it
    assert [key for key, _ in round_events(batch)] == ["command"]
    assert len(rt.slot(0).tokens) == 8  # the long prompt waited, one chunk read
    while len(batch):
        round_events(batch)
    assert rt.slot(0).tokens[:200] == long_prompt  # and went on afterwards


def test_removing_a_request_leaves_its_cache_consistent_and_the_others_running() -> None:
    rt = FakeRuntime(n_seq=2)
    want = alone(PROMPTS[1], FixedPolicy(), max_tokens=30)
    batch = Batch(rt.eval_many, n_batch=512, prefill_chunk=64)
    got: dict[Hashable, list[Event]] = {0: [], 1: []}
    for i in (0, 1):
        got[i] += batch.add(i, Engine(rt.slot(i)).steps(PROMPTS[i], max_tokens=30, policy=FixedPolicy(NgramProposer(1, 3), 4)))
    for _ in range(4):
        for key, ev in round_events(batch):
            got[key].append(ev)
    batch.remove(0)  # its client hung up
    assert 0 not in batch and len(batch) == 1
    committed = PROMPTS[0] + tokens(got[0])
    assert rt.slot(0).tokens == committed[:-1]  # the cache holds every committed token but the last
    while len(batch):
        for key, ev in round_events(batch):
            got[key].append(ev)
    assert tokens(got[1]) == want


def test_a_first_token_is_delivered_before_any_draft_of_the_round_runs() -> None:
    """Events leave as they are produced: a first token waits neither for the drafts of the
    generations after it in the round nor for its own draft's prefill (engine.py)."""
    rt, draft = FakeRuntime(n_seq=2), FakeRuntime(n_seq=2)
    batch = Batch(rt.eval_many, n_batch=512, prefill_chunk=64)
    policy = FixedPolicy(DraftProposer(draft.slot(1), rt.n_vocab), 3)
    batch.add("a", Engine(rt.slot(0)).steps(PROMPTS[0], max_tokens=20, policy=FixedPolicy(DraftProposer(draft.slot(0), rt.n_vocab), 3)))
    batch.add("b", Engine(rt.slot(1)).steps(PROMPTS[1], max_tokens=20, policy=policy))
    seen: list[tuple[Hashable, int, int]] = []  # (whose first token, draft passes of a, of b) as it left
    batch.step(lambda key, ev: seen.append((key, len(draft.slot(0).evals), len(draft.slot(1).evals))))
    assert seen[0] == ("a", 0, 0)
    assert seen[1][0] == "b" and seen[1][2] == 0 and seen[1][1] > 0  # after a's draft ran, before b's
    assert draft.slot(1).evals[0] == len(PROMPTS[1]) - 1  # then b's draft read its prompt


def test_a_generation_its_deliver_removes_gets_no_more_events_and_the_others_run_on() -> None:
    """The daemon ends a request from inside `deliver` (its client left): the batch must not
    advance it again, and the others finish as they would have."""
    rt = FakeRuntime(n_seq=2)
    want = alone(PROMPTS[1], FixedPolicy(NgramProposer(1, 3), 4), max_tokens=20)
    batch = Batch(rt.eval_many, n_batch=512, prefill_chunk=64)
    got: dict[Hashable, list[Event]] = {"leaves": [], "stays": []}
    leaving = Engine(rt.slot(0)).steps(PROMPTS[0], max_tokens=20, policy=FixedPolicy(NgramProposer(1, 3), 4))
    batch.add("leaves", leaving)
    batch.add("stays", Engine(rt.slot(1)).steps(PROMPTS[1], max_tokens=20, policy=FixedPolicy(NgramProposer(1, 3), 4)))

    def deliver(key: Hashable, ev: Event) -> None:
        got[key].append(ev)
        if key == "leaves" and len(got[key]) == 3:
            batch.remove(key)

    while len(batch):
        batch.step(deliver)
    assert len(got["leaves"]) == 3 and "leaves" not in batch
    assert leaving.gi_frame is None  # closed at once, not whenever it is collected
    assert tokens(got["stays"]) == want and got["stays"][-1].finish_reason == "length"


def test_a_deliver_that_raises_ends_only_its_generation_and_is_reported() -> None:
    rt = FakeRuntime(n_seq=2)
    batch = Batch(rt.eval_many, n_batch=512, prefill_chunk=64)
    ok = GenerationStats()
    batch.add("ok", Engine(rt.slot(0)).steps(PROMPTS[0], max_tokens=10, stats=ok))
    batch.add("bad", Engine(rt.slot(1)).steps(PROMPTS[1], max_tokens=10))

    def deliver(key: Hashable, ev: Event) -> None:
        if key == "bad":
            raise ConnectionResetError("the client's socket broke")

    failures = []
    for _ in range(30):
        if not len(batch):
            break
        batch.step(deliver)
        failures += batch.take_failures()
    assert [(k, str(e)) for k, e in failures] == [("bad", "the client's socket broke")]
    assert ok.completion_tokens == 10 and ok.finish_reason == "length" and not len(batch)


class Exploding(NgramProposer):
    def propose(self, *a, **kw):
        raise RuntimeError("a proposer bug")


def test_a_request_that_raises_ends_alone_and_is_reported() -> None:
    rt = FakeRuntime(n_seq=2)
    batch = Batch(rt.eval_many, n_batch=512, prefill_chunk=64)
    ok = GenerationStats()
    batch.add("ok", Engine(rt.slot(0)).steps(PROMPTS[0], max_tokens=10, stats=ok))
    batch.add("bad", Engine(rt.slot(1)).steps(PROMPTS[1], max_tokens=10, policy=FixedPolicy(Exploding(1, 3), 2)))
    failures = []
    while len(batch):
        round_events(batch)
        failures += batch.take_failures()
    assert [(k, str(e)) for k, e in failures] == [("bad", "a proposer bug")]
    assert ok.completion_tokens == 10 and ok.finish_reason == "length"


def test_a_pass_of_one_request_runs_through_its_own_eval_as_alone() -> None:
    """A request alone in the batch takes the same path as engine.run_alone (Runtime.eval keeps
    the hidden states the MTP head reads): no eval_many call."""
    rt = FakeRuntime(n_seq=2)
    drive(Batch(rt.eval_many, n_batch=512, prefill_chunk=8), {0: Engine(rt.slot(0)).steps(PROMPTS[0], max_tokens=5)})
    assert rt.passes == [] and rt.evals[:2] == [8, len(PROMPTS[0]) - 8]  # the prompt in chunks, alone


def test_eval_many_rows_match_each_sequence_evaluated_alone() -> None:
    """The scripted stand-in's contract, as the real one's (tests/integration/test_parallel.py)."""
    rt = FakeRuntime(n_seq=2)
    a, b = rt.eval_many([(rt.slot(0), [1, 2, 3], "all"), (rt.slot(1), [4, 5], "last")])
    assert a.shape == (3, rt.n_vocab) and b.shape == (1, rt.n_vocab)
    np.testing.assert_array_equal(b[0], FakeRuntime().eval([4, 5], "last")[0])


class Recorder(FixedPolicy):
    """A fixed policy that records what each decision was told and each step's timing flag."""

    def __init__(self) -> None:
        super().__init__()
        self.alongside: list[int] = []
        self.timed: list[bool] = []

    def decide(self, context, alongside=0):
        self.alongside.append(alongside)
        return super().decide(context, alongside)

    def observe(self, step) -> None:
        self.timed.append(step.timed)


def test_the_rows_beside_a_request_count_other_decodes_and_the_next_prompt_chunk() -> None:
    """A draft is priced at what its rows add to the next pass: the others' decode rows and the
    prompt chunk read beside them are in it. A pass that read prompts is no verify cost to
    learn from."""
    rt = FakeRuntime(n_seq=3, n_ctx=1024)
    batch = Batch(rt.eval_many, n_batch=512, prefill_chunk=32)
    a, b = Recorder(), Recorder()
    batch.add("a", Engine(rt.slot(0)).steps(PROMPTS[0], max_tokens=40, policy=a))
    batch.add("b", Engine(rt.slot(1)).steps(PROMPTS[1], max_tokens=40, policy=b))
    for _ in range(3):
        round_events(batch)
    assert a.alongside[-1] == 1 and b.alongside[-1] == 1  # each other's single decode row
    batch.add("reader", Engine(rt.slot(2)).steps([(5 * i) % 60 for i in range(100)], max_tokens=2))
    round_events(batch)
    assert a.alongside[-1] == 1 + 32  # b's row and the reader's next chunk of 32 (of 100 - 32 left)
    assert a.timed[-1] is False and a.timed[-2] is True  # that pass read a prompt: its time is no verify cost


class Offering(Recorder):
    """Offers each step to a planning driver (its offer: its key and context length)."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key

    def offer(self, context):
        return (self.key, len(context))


def test_the_steps_of_a_pass_of_several_are_planned_together_and_a_request_left_alone_decides_alone() -> None:
    """After each pass the requests that go on decoding offer their next steps, and one plan
    picks them all, priced by the graphs the pass would run as (its prompt chunks included); the
    decision planned is the step run. A request alone decides alone."""
    rt = FakeRuntime(n_seq=3, n_ctx=1024)
    plans: list[tuple[list[str], list[tuple[int, int]]]] = []

    def plan(offered, graphs):
        plans.append(([key for key, _ in offered], list(graphs([2] * len(offered)))))
        return [Decision(ngram, 1) for _ in offered]  # one drafted token each

    ngram = NgramProposer(1, 3)
    batch = Batch(rt.eval_many, n_batch=512, prefill_chunk=32, plan=plan, graphs=rt.graphs)
    a, b = Offering("a"), Offering("b")
    batch.add("a", Engine(rt.slot(0)).steps(PROMPTS[0], max_tokens=40, policy=a))
    batch.add("b", Engine(rt.slot(1)).steps(PROMPTS[1], max_tokens=12, policy=b))
    for _ in range(3):
        round_events(batch)
    assert plans and all(sorted(keys) == ["a", "b"] and graphs == [(2, 4)] for keys, graphs in plans[-2:])
    assert max(rt.passes[-1], key=lambda p: p[1])[1] <= 2  # each step: its last token and one drafted
    batch.add("reader", Engine(rt.slot(2)).steps([(5 * i) % 60 for i in range(100)], max_tokens=2))
    round_events(batch)
    assert plans[-1][1] == [(3, 2 + 2 + 32)]  # beside the reader's next chunk of 32
    while "b" in batch:
        round_events(batch)
    while "reader" in batch:
        round_events(batch)
    n, decided = len(plans), len(a.alongside)
    round_events(batch)
    assert len(plans) == n and len(a.alongside) == decided + 1 and a.alongside[-1] == 0  # alone: its own decision


def test_a_driver_that_does_not_plan_lets_each_request_decide_beside_the_others_rows() -> None:
    """Narrow passes (exact mode) are not planned, nor is a batch without a plan: a request's
    policy decides, told the rows beside it, and is never asked for an offer."""
    rt = FakeRuntime(n_seq=2, n_ctx=1024)
    narrow = Batch(rt.eval_many, n_batch=512, prefill_chunk=32, max_rows=7, plan=lambda o, g: [], graphs=rt.graphs)
    assert narrow.plan is None
    a, b = Offering("a"), Offering("b")
    narrow.add("a", Engine(rt.slot(0)).steps(PROMPTS[0], max_tokens=40, policy=a))
    narrow.add("b", Engine(rt.slot(1)).steps(PROMPTS[1], max_tokens=40, policy=b))
    for _ in range(6):
        round_events(narrow)
    assert a.alongside and b.alongside and max(a.alongside) >= 1


@pytest.mark.parametrize("split_steps", [False, True])
def test_a_shared_pass_teaches_the_cost_model_once_not_once_per_request_in_it(split_steps: bool) -> None:
    rt = FakeRuntime(n_seq=3, n_ctx=1024)
    batch = Batch(rt.eval_many, n_batch=512, prefill_chunk=32, split_steps=split_steps)  # (plain steps: one graph)
    recorders = [Recorder() for _ in range(3)]
    for i, rec in enumerate(recorders):
        batch.add(i, Engine(rt.slot(i)).steps(PROMPTS[i], max_tokens=40, policy=rec))
    for _ in range(5):
        round_events(batch)
    per_round = [sum(t) for t in zip(*(rec.timed[-3:] for rec in recorders))]
    assert per_round == [1, 1, 1]


class Alternating(FixedPolicy):
    """Drafts k = 3 with its proposer every other step, plainly in between; records the rows."""

    def __init__(self, proposer) -> None:
        super().__init__(proposer, 3)
        self.rows: list[int] = []

    def decide(self, context, alongside=0):
        d = self.decision if len(self.rows) % 2 == 0 else Decision(None, 0)
        self.rows.append(d.k + 1)
        return d


def test_a_request_deciding_after_another_in_the_round_counts_the_rows_that_one_just_chose() -> None:
    """The rows beside a decision are those of the next pass: a request deciding later in the
    round sees the earlier one's new draft, not the rows it brought to the pass just run (else
    two requests beside one free row of a tiled kernel would both take it)."""
    rt, draft = FakeRuntime(n_seq=2, n_ctx=1024), FakeRuntime(n_seq=2)
    batch = Batch(rt.eval_many, n_batch=512, prefill_chunk=32)
    a, b = Alternating(DraftProposer(draft.slot(0), rt.n_vocab)), Recorder()
    batch.add("a", Engine(rt.slot(0)).steps(PROMPTS[0], max_tokens=60, policy=a))
    batch.add("b", Engine(rt.slot(1)).steps(PROMPTS[1], max_tokens=60, policy=b))
    for _ in range(6):
        round_events(batch)
    assert len(b.alongside) >= 4 and a.rows[-4:] in ([4, 1, 4, 1], [1, 4, 1, 4])
    assert b.alongside[-4:] == a.rows[-4:]  # the rows `a` chose earlier in the same round


def test_narrow_passes_hold_few_decode_rows_read_prompts_alone_and_change_no_request_output() -> None:
    rt, draft = FakeRuntime(n_seq=4), FakeRuntime(n_seq=4)
    want = [alone(p, policies(FakeRuntime(), FakeRuntime(), 0)[i], max_tokens=30) for i, p in enumerate(PROMPTS)]
    batch = Batch(rt.eval_many, n_batch=8, prefill_chunk=64, max_rows=5)
    out: dict[Hashable, list[Event]] = {i: [] for i in range(4)}
    for i, p in enumerate(PROMPTS):
        out[i] += batch.add(i, Engine(rt.slot(i)).steps(p, max_tokens=30, policy=policies(rt, draft, i)[i]))
    rounds = []
    while len(batch):
        for key, ev in round_events(batch):
            out[key].append(ev)
        rounds.append(batch.last)
    assert [tokens(out[i]) for i in range(4)] == want
    for r in rounds:
        if r.prefill_rows:  # a prompt alone: n_batch at most beside waiting decodes, else whole, as alone
            assert r.sequences == 1 and r.rows == r.prefill_rows and (r.rows <= 8 or r.rows in map(len, PROMPTS)), r
        else:
            assert r.rows <= 5, r
    assert max(r.sequences for r in rounds if not r.prefill_rows) >= 2  # decode steps still share passes
    assert any(r.prefill_rows == 8 for r in rounds)  # a prompt cut at n_batch while others decoded


def test_in_narrow_passes_steps_too_wide_to_share_take_turns() -> None:
    rt, draft = FakeRuntime(n_seq=2), FakeRuntime(n_seq=2)
    batch = Batch(rt.eval_many, n_batch=512, prefill_chunk=64, max_rows=6)
    passes: list[int] = []  # the sequence of each one-request pass of [last] + 4 drafts
    for i in range(2):
        slot = rt.slot(i)
        slot.eval = lambda toks, out="all", slot=slot: (passes.append(slot.seq) if len(toks) == 5 else None,
                                                        FakeRuntime.eval(slot, toks, out))[1]
        policy = FixedPolicy(DraftProposer(draft.slot(i), rt.n_vocab), 4)  # a draft model always drafts all 4
        batch.add(i, Engine(slot).steps(PROMPTS[i], max_tokens=40, policy=policy))
    while len(batch):
        round_events(batch)
    assert passes[:2] == [0, 0]  # request 1's prompt was read between them
    both = passes[1 : len(passes) - passes[::-1].index(0)]  # until request 0's last step
    assert len(both) >= 6 and all(a != b for a, b in zip(both, both[1:]))  # they alternate: neither starves


def test_in_narrow_passes_a_lower_priority_prompt_waits_until_no_higher_request_decodes() -> None:
    rt = FakeRuntime(n_seq=2)
    batch = Batch(rt.eval_many, n_batch=8, prefill_chunk=64, max_rows=7)
    events: dict[Hashable, list[Event]] = {"voice": [], "chat": []}
    events["voice"] += batch.add("voice", Engine(rt.slot(0)).steps(PROMPTS[0], max_tokens=6), priority=5)
    for key, ev in round_events(batch):  # the command's prompt, alone
        events[key].append(ev)
    long_prompt = [(7 * i) % 60 for i in range(40)]
    events["chat"] += batch.add("chat", Engine(rt.slot(1)).steps(long_prompt, max_tokens=3), priority=0)
    while "voice" in batch:
        for key, ev in round_events(batch):
            events[key].append(ev)
        assert batch.last is not None and batch.last.prefill_rows == 0  # not one chunk of the chat's prompt
    assert len(tokens(events["voice"])) == 6 and not events["chat"]
    while len(batch):
        for key, ev in round_events(batch):
            events[key].append(ev)
    assert tokens(events["chat"]) == alone(long_prompt, FixedPolicy(), max_tokens=3)


def test_a_narrow_pass_of_several_sequences_teaches_no_verify_cost_and_a_lone_one_does() -> None:
    class Recording(FixedPolicy):
        def __init__(self) -> None:
            super().__init__()
            self.steps: list[StepStats] = []

        def observe(self, step: StepStats) -> None:
            self.steps.append(step)

    rt = FakeRuntime(n_seq=2)
    batch = Batch(rt.eval_many, n_batch=512, prefill_chunk=64, max_rows=7)
    policies = [Recording(), Recording()]
    for i in range(2):  # request 1 ends first: request 0 then runs alone
        batch.add(i, Engine(rt.slot(i)).steps(PROMPTS[i], max_tokens=12 - 6 * i, policy=policies[i]))
    while len(batch):
        round_events(batch)
    steps = policies[0].steps + policies[1].steps
    assert any(s.pass_rows == 2 for s in steps) and any(s.pass_rows == 1 for s in steps)
    assert all(s.timed == (s.pass_rows == 1) for s in steps)  # plain steps: 1 row each


def test_in_streams_a_pass_of_steps_of_unequal_length_teaches_no_pass_cost() -> None:
    """With a KV stream per sequence llama.cpp runs steps of unequal length as several graphs:
    such a pass is no pass of its rows, and the shared curve learns only from one-graph passes."""
    class Recording(Alternating):
        def __init__(self, proposer) -> None:
            super().__init__(proposer)
            self.steps: list[StepStats] = []

        def observe(self, step: StepStats) -> None:
            self.steps.append(step)

    for split in (True, False):
        rt, draft = FakeRuntime(n_seq=2, n_ctx=1024), FakeRuntime(n_seq=2)
        batch = Batch(rt.eval_many, n_batch=512, prefill_chunk=64, split_steps=split)
        a, b = Recording(DraftProposer(draft.slot(0), rt.n_vocab)), Recording(DraftProposer(draft.slot(1), rt.n_vocab))
        b.rows.append(1)  # b drafts on the other steps: 4 + 1 rows, then 1 + 4
        batch.add("a", Engine(rt.slot(0)).steps(PROMPTS[0], max_tokens=30, policy=a))
        batch.add("b", Engine(rt.slot(1)).steps(PROMPTS[1], max_tokens=30, policy=b))
        for _ in range(6):
            round_events(batch)
        shared = [s for s in a.steps + b.steps if s.pass_rows == 5]
        assert shared and sum(s.timed for s in shared) == (0 if split else len(shared) // 2)
