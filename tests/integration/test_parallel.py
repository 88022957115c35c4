"""Several requests in one target pass on the real models (llama/runtime.py eval_many,
speculation/batch.py): each request's greedy output obeys DESIGN.md's exactness rules as if it
ran alone — (a) every emitted token is the argmax of the rows that verified it, (b) the output
equals the request's plain decoding alone up to a near-tie (top-2 margin below 2 epsilon)."""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest

from homespec.llama.runtime import COMPACT_AFTER, Runtime, RuntimeOptions
from homespec.speculation.batch import Batch
from homespec.speculation.engine import Engine, FixedPolicy, GenerationStats
from homespec.speculation.proposers.draft import DraftProposer
from homespec.speculation.proposers.ngram import NgramProposer
from tests.conftest import DRAFT, TARGET, require
from tests.integration.exactness import borrowed_prefix, encode, first_divergence, margin
from tests.integration.test_exactness import PROMPTS

pytestmark = pytest.mark.integration

SLOTS = 4
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def models():
    opts = RuntimeOptions(n_ctx=1024, n_batch=256, n_seq=SLOTS)
    target, draft = Runtime(require(TARGET), opts), Runtime(require(DRAFT), opts)
    yield target, draft
    target.close()
    draft.close()


def plain_alone(rt: Runtime, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Plain greedy decoding in slot 0, one token a pass: the tokens and each row's top-2 margin."""
    rt.reset()
    row = rt.sync(prompt)[0]
    out, margins = [], []
    for _ in range(MAX_TOKENS):
        out.append(int(np.argmax(row)))
        margins.append(margin(row))
        if rt.is_eog(out[-1]):
            break
        row = rt.eval(out[-1:], "all")[0]
    rt.reset()
    return out, margins


def test_rows_of_several_sequences_in_one_pass_match_each_sequence_alone(models, epsilon) -> None:
    rt, _ = models
    prompts = [encode(rt, t) for t in PROMPTS[:3]]
    alone = []
    for i, p in enumerate(prompts):
        s = rt.slot(i)
        s.reset()
        alone.append(s.sync(p, "last")[0])  # [vocab] after the prompt
        s.truncate(len(p) - 1)
    rows = rt.eval_many([(rt.slot(i), p[-1:], "all") for i, p in enumerate(prompts)])
    delta = max(float(np.abs(r[0] - a).max()) for r, a in zip(rows, alone))
    print(f"\nmax |Δlogit| of 3 sequences in one pass vs each alone: {delta:.4f} (epsilon {epsilon:.4f})")
    for r, a in zip(rows, alone):
        assert r.shape == (1, rt.n_vocab)
        if margin(a) > 2 * epsilon:
            assert int(np.argmax(r[0])) == int(np.argmax(a))
    assert [len(rt.slot(i).tokens) for i in range(3)] == [len(p) for p in prompts]
    for i in range(3):
        rt.slot(i).reset()


def test_a_pass_that_skips_a_slot_bridges_it_with_a_row_and_leaves_its_cache_as_it_was(models) -> None:
    rt, _ = models
    prompts = [encode(rt, t) for t in PROMPTS[:3]]
    for i, p in enumerate(prompts):
        rt.slot(i).reset()
        rt.slot(i).eval(p[:-1], "none")
    idle = rt.slot(1)
    before = idle.eval(prompts[1][-1:], "all").copy()  # [1, vocab]
    idle.truncate(len(prompts[1]) - 1)
    passes = []
    real = rt._eval_many

    def recording(parts, pads=None):
        passes.append(([(slot.seq, len(toks), out) for slot, toks, out in parts], dict(pads or {})))
        return real(parts, pads or {})

    rt._eval_many = recording  # type: ignore[method-assign]
    try:
        rows = rt.eval_many([(rt.slot(2), prompts[2][-1:], "all"), (rt.slot(0), prompts[0][-1:], "all")])
    finally:
        del rt._eval_many
    assert passes == [([(0, 1, "all"), (1, 0, "none"), (2, 1, "all")], {1: 1})]  # one run of neighbours: one graph
    assert [r.shape for r in rows] == [(1, rt.n_vocab)] * 2  # the caller's parts, in its order
    assert idle.tokens == prompts[1][:-1]
    assert np.array_equal(idle.eval(prompts[1][-1:], "all"), before)  # nothing of the throwaway row is left
    for i in range(3):
        rt.slot(i).reset()


def test_short_steps_beside_a_longer_one_are_padded_to_one_graph_and_keep_no_throwaway_cells(models) -> None:
    """3 rows in slot 0 and 1 in slot 2 (slot 1 idle): every slot runs 3 rows, one graph; each
    caller gets its own rows, and no slot's cache holds a cell past its tokens afterwards."""
    rt, _ = models
    prompts = [encode(rt, t) for t in PROMPTS[:3]]
    for i, p in enumerate(prompts):
        rt.slot(i).reset()
        rt.slot(i).eval(p[:-1], "none")
    passes = []
    real = rt._eval_many

    def recording(parts, pads=None):
        passes.append(([(slot.seq, len(toks)) for slot, toks, _ in parts], dict(pads or {})))
        return real(parts, pads or {})

    rt._eval_many = recording  # type: ignore[method-assign]
    try:
        three, one = rt.eval_many([(rt.slot(0), prompts[0][-1:] + prompts[0][:2], "all"), (rt.slot(2), prompts[2][-1:], "last")])
    finally:
        del rt._eval_many
    assert passes == [([(0, 3), (1, 0), (2, 1)], {1: 3, 2: 2})]
    assert three.shape == (3, rt.n_vocab) and one.shape == (1, rt.n_vocab)
    lengths = {0: len(prompts[0]) + 2, 1: len(prompts[1]) - 1, 2: len(prompts[2])}
    for seq, n in lengths.items():
        assert len(rt.slot(seq).tokens) == n
        assert llama_cpp.llama_memory_seq_pos_max(rt._mem, seq) == n - 1  # the throwaway cells are gone
    for i in range(3):
        rt.slot(i).reset()


def test_a_slot_left_idle_between_running_ones_is_compacted_away_and_every_slot_keeps_its_cells(models, epsilon) -> None:
    """Slots 0, 2 and 3 decode while slot 1 sits idle holding its history (an answer that ended):
    the passes bridge it with a throwaway row until the gap has lasted COMPACT_AFTER passes, then
    slot 3 moves into its stream and the passes are one graph of three rows. Each slot keeps its
    Slot object, tokens and cells; the moved request decodes on as it would have."""
    rt, _ = models
    prompts = [encode(rt, t) for t in PROMPTS[:4]]
    for i, p in enumerate(prompts):
        rt.slot(i).reset()
        rt.slot(i).eval(p[:-1], "none")
    slots = [rt.slot(i) for i in range(4)]
    idle = slots[1]
    before = idle.eval(prompts[1][-1:], "all").copy()  # [1, vocab]
    idle.truncate(len(prompts[1]) - 1)
    reference = {i: plain_alone_in(rt.slot(i), prompts[i]) for i in (2, 3)}  # each alone, in its own slot
    for i in (0, 2, 3):
        rt.slot(i).truncate(len(prompts[i]) - 1)
    passes = []
    real = rt._eval_many

    def recording(parts, pads=None):
        passes.append((sorted(slot.seq for slot, toks, _ in parts if toks), dict(pads or {})))
        return real(parts, pads or {})

    rt._eval_many = recording  # type: ignore[method-assign]
    out: dict[int, list[int]] = {i: [] for i in (0, 2, 3)}
    try:
        last = {i: prompts[i][-1] for i in out}
        for _ in range(COMPACT_AFTER + 3):
            rows = rt.eval_many([(rt.slot(i), [last[i]], "all") for i in out])
            for i, r in zip(out, rows):
                last[i] = int(np.argmax(r[0]))
                out[i].append(last[i])
    finally:
        del rt._eval_many
    assert passes[: COMPACT_AFTER - 1] == [([0, 2, 3], {1: 1})] * (COMPACT_AFTER - 1)
    assert passes[COMPACT_AFTER - 1 :] == [([0, 1, 2], {})] * 4  # the gap moved away: no throwaway row
    assert [rt.slot(i) for i in range(4)] == slots and (slots[3].seq, slots[1].seq) == (1, 3)
    for i in (0, 2, 3):
        assert len(rt.slot(i).tokens) == len(prompts[i]) + COMPACT_AFTER + 2
        assert llama_cpp.llama_memory_seq_pos_max(rt._mem, rt.slot(i).seq) == len(rt.slot(i).tokens) - 1
    assert idle.tokens == prompts[1][:-1]
    assert np.array_equal(idle.eval(prompts[1][-1:], "all"), before)  # its cells came along to stream 3
    for i in (2, 3):  # the moved request, and the one beside it, decode as each does alone (near-ties aside)
        plain, margins = reference[i]
        j = first_divergence(plain, out[i])
        assert j is None or margins[j] < 2 * epsilon, f"slot {i} diverged at token {j} (margin {margins[j]:.3f})"
    for i in range(4):
        rt.slot(i).reset()


def plain_alone_in(slot, prompt: list[int], n: int = COMPACT_AFTER + 3) -> tuple[list[int], list[float]]:
    """Plain greedy decoding of n tokens in `slot` alone after its prompt (cached but for the last
    token): the tokens and each row's top-2 margin; the slot is left holding the prompt."""
    row = slot.eval(prompt[-1:], "all")[0]
    out, margins = [], []
    for _ in range(n):
        out.append(int(np.argmax(row)))
        margins.append(margin(row))
        row = slot.eval(out[-1:], "all")[0]
    slot.truncate(len(prompt))
    return out, margins


def test_batched_requests_each_match_their_plain_decoding_alone_except_at_near_ties(models, epsilon) -> None:
    rt, draft = models
    prompts = [encode(rt, t) for t in PROMPTS]
    reference = [plain_alone(rt, p) for p in prompts]
    rows: dict[tuple[int, int], np.ndarray] = {}  # (slot, position) -> the logits row that scored it

    def recording_eval_many(parts):
        starts = [len(t.tokens) for t, _, _ in parts]
        outs = rt.eval_many(parts)
        for (t, toks, output), start, out in zip(parts, starts, outs):
            if output == "all":
                rows.update({(t, start + i): out[i] for i in range(len(toks))})  # by Slot: compaction moves seq ids
        return outs

    policies = [  # a different proposer per request, k = 0 included
        FixedPolicy(DraftProposer(draft.slot(0), rt.n_vocab), 4),
        FixedPolicy(),
        FixedPolicy(NgramProposer(2, 5), 4),
        FixedPolicy(DraftProposer(draft.slot(3), rt.n_vocab), 2),
    ]
    batch = Batch(recording_eval_many, n_batch=rt.n_batch, prefill_chunk=32)
    stats = [GenerationStats() for _ in prompts]
    out: dict[int, list[int]] = {i: [] for i in range(SLOTS)}
    for i, p in enumerate(prompts):
        rt.slot(i).reset()
        draft.slot(i).reset()
        for ev in batch.add(i, Engine(rt.slot(i)).steps(p, max_tokens=MAX_TOKENS, policy=policies[i], stats=stats[i])):
            out[i] += ev.tokens
    shared = 0
    while len(batch):
        batch.step(lambda key, ev: out[int(key)].extend(ev.tokens))  # type: ignore[call-overload]
        shared += batch.last is not None and batch.last.sequences > 1
    assert shared >= 10  # the requests stepped together, not one after another
    diverged = 0
    for i, p in enumerate(prompts):
        # (a) every emitted token after the first that a shared pass verified is its argmax
        for j, tok in enumerate(out[i][1:], start=1):
            row = rows.get((rt.slot(i), len(p) + j - 1))
            if row is not None:
                assert int(np.argmax(row)) == tok, f"request {i} token {j} is not the target's argmax"
        # (b) the request's own plain decoding, or a divergence at one of its near-ties
        plain, margins = reference[i]
        j = first_divergence(plain, out[i])
        if j is None:
            assert out[i] == plain[: len(out[i])] and len(out[i]) == len(plain)
            continue
        diverged += 1
        assert margins[j] < 2 * epsilon, (
            f"request {i} diverged at token {j} where its plain margin was {margins[j]:.3f} >= 2 epsilon"
        )
    print(f"\n{SLOTS} requests in one batch: {diverged} diverged from plain, all at near-ties; "
          f"{sum(s.proposed for s in stats)} tokens proposed, {shared} shared passes")
    assert sum(s.proposed for s in stats) > 0


@pytest.mark.parametrize("layout", ["streams", "unified"])
def test_a_prefix_borrowed_from_another_sequence_reads_as_its_own_and_outlives_the_lender(models, epsilon, layout) -> None:
    """Slot.share_prefix (prefix_cache.prepare's peers): after a prefix shared from another
    sequence (cells tagged in one unified buffer, copied across streams), the rows are those of a
    sequence that read the prefix itself, up to batch noise, and stay so once the lender's
    request ends and its slot empties."""
    rt = models[0] if layout == "streams" else Runtime(require(TARGET), RuntimeOptions(n_ctx=1024, n_batch=256, n_seq=SLOTS, kv_unified=True))
    assert rt.shares_cells == (layout == "unified")
    lender, borrower, reader = rt.slot(1), rt.slot(2), rt.slot(3)
    prompt, n = borrowed_prefix(rt, PROMPTS[0], PROMPTS[1], lender, borrower, reader)
    got, want = borrower.eval(prompt[n:], "last")[0], reader.eval(prompt[n:], "last")[0]
    lender.reset()
    deltas = []
    for _ in range(8):
        deltas.append(float(np.abs(got - want).max()))
        if margin(want) > 2 * epsilon:
            assert int(np.argmax(got)) == int(np.argmax(want))
        tok = int(np.argmax(want))
        got, want = borrower.eval([tok], "all")[0], reader.eval([tok], "all")[0]
    print(f"\nborrowed prefix of {n} tokens: max |Δlogit| per position {[round(d, 3) for d in deltas]} (epsilon {epsilon:.3f})")
    assert max(deltas) <= 2 * epsilon  # seen failing at 3.7 with the prefix not really shared
    for s in (borrower, reader):
        s.reset()
    if rt is not models[0]:
        rt.close()
