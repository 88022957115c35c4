"""MTP head: tiny configurations, random weights, scripted hidden states — seconds, no models.

What is checked: the training objective goes down; the serving runner (KV cache, one position at
a time, its own predictions fed back) computes what the training forward computes; the proposer
pairs h_j with t_{j+1} and rebuilds its cache from real hidden states after each step; greedy
speculation with it emits exactly plain decoding's tokens; data helpers and GGUF reading.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from homespec.mtp.collect import HELDOUT_PROMPTS, TRAIN_PROMPTS, Record, save_record, top_k  # noqa: E402
from homespec.mtp.model import HeadConfig, HeadRunner, MTPHead  # noqa: E402
from homespec.mtp.train import Batches, Data, choose_vocab, head_loss, load_data  # noqa: E402
from homespec.speculation.engine import Engine, FixedPolicy, GenerationStats  # noqa: E402
from homespec.speculation.proposers.mtp import MTPProposer  # noqa: E402
from homespec.speculation.sampling import SamplingParams  # noqa: E402
from tests.unit.fakes import FakeRuntime  # noqa: E402

D, VOCAB = 32, 64


def tiny_config(window: int = 16, vocab_out: int = 48) -> HeadConfig:
    return HeadConfig(d=D, n_head=4, n_kv=2, head_dim=8, ff=64, vocab_out=vocab_out, n_vocab=VOCAB,
                      rope_base=10000.0, eps=1e-6, window=window)


def tiny_head(seed: int = 0, **kw) -> MTPHead:
    torch.manual_seed(seed)
    cfg = tiny_config(**kw)
    vocab_ids = torch.arange(cfg.vocab_out) * 1  # V' = the first vocab_out ids
    head = MTPHead(cfg, torch.randn(cfg.vocab_out, D) * 0.5, vocab_ids)
    with torch.no_grad():  # bigger than default init, so that attention and depth matter
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return head.eval()


EMBED = np.random.default_rng(1).normal(size=(VOCAB, D)).astype(np.float32)  # [V, d]


def embed(ids: np.ndarray) -> np.ndarray:
    return EMBED[np.asarray(ids)]


# -- training ----------------------------------------------------------------------------------


def synthetic_batch(cfg: HeadConfig, B: int = 4, T: int = 12, seed: int = 0) -> dict:
    """Windows whose labels are a fixed function of the next token: learnable in a few steps."""
    g = np.random.default_rng(seed)
    toks = g.integers(0, cfg.vocab_out, size=(B, T + 1))
    h = g.normal(size=(B, T + 1, D)).astype(np.float32)
    label = (toks[:, 1:] * 7 + 3) % cfg.vocab_out  # [B, T]
    ids = np.full((B, T, 2), -1, np.int64)
    ids[..., 0] = label
    logp = np.full((B, T, 2), -np.inf, np.float32)
    logp[..., 0] = 0.0
    batch = dict(h=h[:, :T], h_next=h[:, 1:], e=EMBED[toks[:, 1:]], ids=ids, logp=logp, mask=np.ones((B, T), bool))
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}


def test_a_few_training_steps_decrease_the_loss():
    head = tiny_head().train()
    batch = synthetic_batch(head.cfg)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss, parts = head_loss(head, batch, depth=2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    assert set(parts) >= {"ce1", "ce2", "reg1", "reg2", "acc1", "acc2"}


def test_frozen_output_projection_gets_no_gradient_and_is_not_saved():
    head = tiny_head()
    assert "lm_head" not in head.state_dict()  # read from the target's GGUF at load
    assert all(p is not head.lm_head for p in head.parameters())
    assert "vocab_ids" in head.state_dict()


# -- serving computes what training computes ----------------------------------------------------


def test_runner_matches_the_training_forward_at_every_position_and_depth():
    head = tiny_head(window=32)
    T = 10
    g = np.random.default_rng(3)
    toks = g.integers(0, VOCAB, size=T + 1)
    h = g.normal(size=(T, D)).astype(np.float32)  # h_0..h_{T-1}
    e = embed(toks[1:])  # e[p] = embed(t_{p+1})
    with torch.no_grad():
        ref1, ref2 = head(torch.from_numpy(e)[None], torch.from_numpy(h)[None], depth=2)  # [1, T, d] each
    runner = HeadRunner(head, embed, int8=False)
    for p in range(1, T):
        # Real entries 0..p-1 in one batch (as after a verification), then one speculative entry.
        runner.truncate(0)
        h1, _ = runner.extend(h[:p], toks[1 : p + 1], 0)
        np.testing.assert_allclose(h1, ref1[0, p - 1].numpy(), atol=2e-4)
        h2, logits2 = runner.extend(h1[None], toks[p + 1 : p + 2], p)  # (ĥ_p, t_{p+1}) at entry p
        np.testing.assert_allclose(h2, ref2[0, p].numpy(), atol=2e-4)
        np.testing.assert_allclose(logits2, head.logits(ref2[0, p]).detach().numpy(), atol=2e-3)


def test_runner_attends_only_within_its_window():
    head = tiny_head(window=4)
    g = np.random.default_rng(4)
    h = g.normal(size=(12, D)).astype(np.float32)
    toks = g.integers(0, VOCAB, size=13)
    runner = HeadRunner(head, embed, int8=False)
    full, _ = runner.extend(h, toks[1:], 0)  # 12 entries, window 4
    assert (runner.start, runner.end) == (8, 12)
    runner.reset()
    tail, _ = runner.extend(h[8:], toks[9:], 8)  # only the last 4 entries
    np.testing.assert_allclose(full, tail, atol=1e-5)


def test_int8_runner_stays_close_to_float32():
    head = tiny_head()
    g = np.random.default_rng(5)
    h = g.normal(size=(6, D)).astype(np.float32)
    toks = g.integers(0, VOCAB, size=7)
    _, ref = HeadRunner(head, embed, int8=False).extend(h, toks[1:], 0)
    _, q8 = HeadRunner(head, embed, int8=True).extend(h, toks[1:], 0)
    assert np.abs(q8 - ref).max() < 0.1 * np.abs(ref).max() + 1e-3


# -- the proposer: the one-position shift and the cache rebuild -------------------------------------


class HiddenFake(FakeRuntime):
    """FakeRuntime that also keeps scripted hidden states, like RuntimeOptions.hidden_window."""

    def __init__(self, window: int = 64, **kw) -> None:
        super().__init__(vocab=VOCAB, **kw)
        self.window = window
        self.opts = dataclasses.replace(self.opts, hidden_window=window)
        self.kept_from = 0  # tests may pretend older states were never computed

    @staticmethod
    def hidden_of(prefix) -> np.ndarray:  # h_j depends on tokens[: j + 1]
        key = zlib.crc32(np.asarray(prefix, dtype=np.int64).tobytes())
        return np.random.default_rng(key).normal(size=D).astype(np.float32)

    @property
    def hidden_start(self) -> int:
        return max(self.kept_from, len(self.tokens) - self.window, 0)

    def hidden_rows(self, start: int, stop: int) -> np.ndarray:
        assert self.hidden_start <= start <= stop <= len(self.tokens), (start, stop, self.hidden_start, len(self.tokens))
        return np.stack([self.hidden_of(self.tokens[: j + 1]) for j in range(start, stop)]).reshape(-1, D)


class RecordingRunner:
    """Stands in for HeadRunner: records every extend; proposes token (last pos0 + n) % 10."""

    def __init__(self, window: int = 16) -> None:
        self.cfg = tiny_config(window=window)
        self.window = window
        self.vocab_ids = np.arange(self.cfg.vocab_out)
        self.calls: list[tuple[int, np.ndarray, list[int]]] = []  # (pos0, hidden, next tokens)
        self.start = self.end = 0

    def reset(self, pos: int = 0) -> None:
        self.start = self.end = pos

    def truncate(self, pos: int) -> None:
        if pos <= self.start:
            self.reset(pos)
        self.end = min(self.end, pos)

    def extend(self, hidden, next_tokens, pos0):
        assert pos0 == self.end or self.end == self.start, "entries must stay contiguous"
        self.calls.append((pos0, np.array(hidden), [int(t) for t in next_tokens]))
        self.start = self.start if self.end > self.start else pos0
        self.end = pos0 + len(next_tokens)
        logits = np.zeros(self.cfg.vocab_out, np.float32)
        logits[(pos0 + len(next_tokens)) % 10] = 5.0
        return np.full(D, 100.0 + self.end, np.float32), logits  # a recognisable ĥ


GREEDY = SamplingParams()


def test_first_draft_pairs_the_last_evaluated_hidden_state_with_the_newest_token():
    target, runner = HiddenFake(), RecordingRunner()
    prop = MTPProposer(target, runner)
    ctx = [5, 9, 2, 7, 3, 8]
    target.sync(ctx[:-1], output="none")  # the engine's invariant: the target holds ctx[:-1]
    prop.propose(ctx, 1, GREEDY, np.random.default_rng(0))
    pos0, hidden, nxt = runner.calls[-1]
    m = len(ctx)
    assert pos0 + len(nxt) - 1 == m - 2  # the last entry built is m - 2 ...
    np.testing.assert_array_equal(hidden[-1], HiddenFake.hidden_of(ctx[: m - 1]))  # ... with h_{m-2}
    assert nxt[-1] == ctx[m - 1]  # ... and t_{m-1}, the token sampled from L_{m-2}
    assert nxt == ctx[pos0 + 1 : m]  # every entry j reads t_{j+1}


def test_deeper_drafts_feed_the_heads_own_hidden_state_and_drafted_token():
    target, runner = HiddenFake(), RecordingRunner()
    prop = MTPProposer(target, runner)
    ctx = [1, 2, 3, 4, 5]
    target.sync(ctx[:-1], output="none")
    p = prop.propose(ctx, 3, GREEDY, np.random.default_rng(0))
    assert p.q is None and len(p.tokens) == 3
    (_, _, _), (pos1, h1, t1), (pos2, h2, t2) = runner.calls[-3:]
    m = len(ctx)
    assert (pos1, t1) == (m - 1, [p.tokens[0]]) and (pos2, t2) == (m, [p.tokens[1]])
    assert h1[0, 0] == 100.0 + (m - 1) and h2[0, 0] == 100.0 + m  # ĥ of the previous entry


def test_after_verification_speculative_entries_are_rebuilt_from_real_hidden_states():
    target, runner = HiddenFake(), RecordingRunner()
    prop = MTPProposer(target, runner)
    ctx = [1, 2, 3, 4, 5, 6]
    target.sync(ctx[:-1], output="none")
    p = prop.propose(ctx, 3, GREEDY, np.random.default_rng(0))
    # The engine verifies: the target evaluates [ctx[-1]] + proposal, 2 are accepted, then a bonus.
    target.eval([ctx[-1], *p.tokens])
    accepted, bonus = p.tokens[:2], 11
    target.truncate(len(ctx) + 2)
    new_ctx = ctx + accepted + [bonus]
    runner.calls.clear()
    prop.propose(new_ctx, 1, GREEDY, np.random.default_rng(0))
    pos0, hidden, nxt = runner.calls[0]
    m, m2 = len(ctx), len(new_ctx)
    assert pos0 == m - 1  # the first speculative entry is rebuilt, the real ones kept
    assert nxt == new_ctx[m : m2]  # t_{j+1} for j = m-1 .. m'-2, ending with the bonus
    for row, j in zip(hidden, range(m - 1, m2 - 1)):
        np.testing.assert_array_equal(row, HiddenFake.hidden_of(new_ctx[: j + 1]))  # real h_j
    assert prop.lag(new_ctx + [4]) == 1


def test_a_proposer_that_sat_out_reports_its_catch_up():
    target, runner = HiddenFake(), RecordingRunner()
    prop = MTPProposer(target, runner)
    ctx = list(range(1, 7))
    target.sync(ctx[:-1], output="none")
    prop.propose(ctx, 1, GREEDY, np.random.default_rng(0))
    ctx2 = ctx + [9, 9, 9, 9, 9, 9]  # six plain steps later
    target.sync(ctx2[:-1], output="none")
    assert prop.lag(ctx2) == 6
    p = prop.propose(ctx2, 1, GREEDY, np.random.default_rng(0))
    assert p.info.catchup_tokens == 6 and p.info.catchup_s > 0


def test_no_proposal_without_the_hidden_state_of_the_last_evaluated_position():
    target, runner = HiddenFake(), RecordingRunner()
    prop = MTPProposer(target, runner)
    ctx = [1, 2, 3, 4]
    target.sync(ctx[:-1], output="none")
    target.kept_from = len(target.tokens)  # e.g. a restored prefix cache: no hidden states
    assert prop.propose(ctx, 2, GREEDY, np.random.default_rng(0)).tokens == []


def test_sampled_proposals_carry_q_over_the_full_vocabulary_zero_outside_the_heads():
    target = HiddenFake()
    prop = MTPProposer(target, HeadRunner(tiny_head(), embed, int8=False))
    ctx = [3, 1, 4, 1, 5, 9]
    target.sync(ctx[:-1], output="none")
    p = prop.propose(ctx, 3, SamplingParams(temperature=0.8, top_p=0.95), np.random.default_rng(0))
    assert p.q.shape == (3, VOCAB)
    np.testing.assert_allclose(p.q.sum(1), 1.0)
    assert (p.q[:, tiny_config().vocab_out :] == 0).all()
    assert all(p.q[i, t] > 0 for i, t in enumerate(p.tokens))


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculation_with_the_head_emits_plain_decodings_tokens(k):
    prompt = [7, 3, 11, 5, 2, 9, 4]
    plain_target = HiddenFake(sharpness=4.0)
    plain = [t for ev in Engine(plain_target).generate(prompt, max_tokens=40) for t in ev.tokens]
    target = HiddenFake(sharpness=4.0)
    prop = MTPProposer(target, HeadRunner(tiny_head(window=8), embed, int8=True))
    st = GenerationStats()
    spec = [t for ev in Engine(target).generate(prompt, max_tokens=40, policy=FixedPolicy(prop, k), stats=st)
            for t in ev.tokens]
    assert spec == plain
    assert st.proposed > 0


# -- data --------------------------------------------------------------------------------------------


def test_top_k_returns_the_best_ids_with_full_vocabulary_log_probabilities():
    logits = np.random.default_rng(0).normal(size=(3, 100)).astype(np.float32)
    ids, logp = top_k(logits, 5)
    assert (ids[:, 0] == logits.argmax(1)).all()
    assert (np.diff(logp, axis=1) <= 0).all()
    full = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    np.testing.assert_allclose(logp, np.take_along_axis(full, ids, 1), atol=1e-5)


def test_held_out_prompts_are_not_training_prompts():
    train = {user for _, user in TRAIN_PROMPTS}
    assert not train & set(HELDOUT_PROMPTS)
    assert len(train) == len(TRAIN_PROMPTS)  # no duplicates


def write_chunks(tmp_path, n_chunks: int = 3, n: int = 20) -> None:
    g = np.random.default_rng(0)
    for c in range(n_chunks):
        toks = g.integers(0, VOCAB, n).astype(np.int32)
        rec = Record(toks, g.normal(size=(n, D)).astype(np.float16), np.stack([toks, (toks + 1) % VOCAB], 1).astype(np.int32),
                     np.log(np.tile([0.7, 0.2], (n, 1))).astype(np.float32), 0)
        save_record(tmp_path / f"code-{c:04d}.npz", rec, "code")


def test_windows_pair_each_input_with_the_next_positions_labels(tmp_path):
    write_chunks(tmp_path)
    data = load_data(tmp_path)
    wins = data.windows([0, 1], seq=8)
    assert wins[0] == (0, 9) and all(w[0] + w[1] <= 40 for w in wins)  # never across chunk 1's end
    assert sum(n - 1 for _, n in wins) == 2 * 19  # every position with a successor, once
    full2red = np.arange(VOCAB)
    b = Batches(data, EMBED, np.arange(VOCAB), full2red).make(wins[:1], 8)
    np.testing.assert_allclose(b["h"][0, 0].numpy(), data.hidden[0].astype(np.float32))
    np.testing.assert_allclose(b["h_next"][0, 0].numpy(), data.hidden[1].astype(np.float32))
    np.testing.assert_allclose(b["e"][0, 0].numpy(), EMBED[data.tokens[1]])  # embed(t_{p+1})
    assert b["ids"][0, 0, 0] == data.top_ids[1, 0]  # labels of L_{p+1}


def test_vocabulary_keeps_the_most_predicted_tokens(tmp_path):
    data = Data(np.array([1, 1, 2, 3], np.int32), np.zeros((4, D), np.float16),
                np.array([[5, 1], [5, 1], [5, 2], [6, 1]], np.int32), np.zeros((4, 2), np.float32), [0], ["x"])
    assert choose_vocab(data, [0], 2, VOCAB).tolist() == [1, 5]


# -- the target's tensors from a GGUF ---------------------------------------------------------------


def test_target_weights_read_rows_in_torch_layout(tmp_path):
    gguf = pytest.importorskip("gguf")
    from homespec.mtp.weights import TargetWeights

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    for key, val in (("embedding_length", 8), ("block_count", 1), ("attention.head_count", 2),
                     ("attention.head_count_kv", 1), ("feed_forward_length", 16)):
        w.add_uint32(f"qwen2.{key}", val)
    w.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("qwen2.rope.freq_base", 1e6)
    emb = np.arange(10 * 8, dtype=np.float32).reshape(10, 8)  # [vocab, d]
    gate = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)  # [ff, d] = Linear(d -> ff)
    w.add_tensor("token_embd.weight", emb)
    w.add_tensor("blk.0.ffn_gate.weight", gate)
    w.add_tensor("output_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tw = TargetWeights(path)
    assert (tw.shape.n_embd, tw.shape.n_vocab, tw.shape.n_ff, tw.shape.head_dim) == (8, 10, 16, 4)
    np.testing.assert_array_equal(tw.embed([3, 7]), emb[[3, 7]])
    np.testing.assert_array_equal(tw.output([2]), emb[[2]])  # tied: no output.weight
    np.testing.assert_array_equal(tw.layer(0)["gate"], gate)


def test_proposing_twice_for_the_same_context_gives_the_same_draft():
    target = HiddenFake()
    prop = MTPProposer(target, HeadRunner(tiny_head(), embed, int8=False))
    ctx = [3, 1, 4, 1, 5, 9, 2]
    target.sync(ctx[:-1], output="none")
    first = prop.propose(ctx, 3, GREEDY, np.random.default_rng(0)).tokens
    assert prop.propose(ctx, 3, GREEDY, np.random.default_rng(0)).tokens == first != []


def test_the_controller_chooses_mtp_when_its_measured_cost_and_acceptance_pay():
    from homespec.speculation.controller import Controller

    c = Controller([MTPProposer(HiddenFake(), RecordingRunner())], k_max=4)
    c.cost.set_verify({1: 0.056, 2: 0.095, 4: 0.148, 5: 0.18})  # DESIGN.md's 2-core figures
    c.set_proposer_cost("mtp", 0.004)  # ~0.07 of a target pass per proposed token
    first = c.decide([1, 2, 3])
    assert first.name == "mtp" and c.view.reason.startswith("probe")  # never seen: probed at once,
    assert max(c.view.gains["mtp"]) < 1.0  # though at the prior acceptance (0.5) it does not pay
    for _ in range(40):
        c.acc.observe(c._key("mtp"), [True, True, True, False])
    d = c.decide([1, 2, 3])
    assert d.name == "mtp" and d.k >= 2


# -- end to end: a tiny GGUF target, collected-like chunks, train(), checkpoint, proposer ------------


def write_tiny_target(path, d: int = D, vocab: int = VOCAB, ff: int = 48) -> None:
    """A GGUF with one Qwen2-shaped layer (float32) — enough for TargetWeights and the head."""
    gguf = pytest.importorskip("gguf")
    g = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), "qwen2")
    for key, val in (("embedding_length", d), ("block_count", 1), ("attention.head_count", 4),
                     ("attention.head_count_kv", 2), ("feed_forward_length", ff)):
        w.add_uint32(f"qwen2.{key}", val)
    w.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("qwen2.rope.freq_base", 1e4)
    hd = d // 4
    shapes = {
        "token_embd.weight": (vocab, d), "output.weight": (vocab, d), "output_norm.weight": (d,),
        "blk.0.attn_norm.weight": (d,), "blk.0.attn_q.weight": (d, d), "blk.0.attn_q.bias": (d,),
        "blk.0.attn_k.weight": (2 * hd, d), "blk.0.attn_k.bias": (2 * hd,), "blk.0.attn_v.weight": (2 * hd, d),
        "blk.0.attn_v.bias": (2 * hd,), "blk.0.attn_output.weight": (d, d), "blk.0.ffn_norm.weight": (d,),
        "blk.0.ffn_gate.weight": (ff, d), "blk.0.ffn_up.weight": (ff, d), "blk.0.ffn_down.weight": (d, ff),
    }
    for name, shape in shapes.items():
        arr = np.ones(shape, np.float32) if name.endswith("norm.weight") else g.normal(0, 0.3, shape).astype(np.float32)
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_train_writes_a_checkpoint_that_serves_as_a_proposer_and_resumes(tmp_path):
    from homespec.mtp.checkpoint import head_window, open_head
    from homespec.mtp.model import load_head, meta_path
    from homespec.mtp.train import TrainConfig, read_meta, train
    from homespec.mtp.weights import TargetWeights

    target = tmp_path / "tiny.gguf"
    write_tiny_target(target)
    data = tmp_path / "data"
    data.mkdir()
    write_chunks(data, n_chunks=6, n=40)
    out = tmp_path / "tiny.mtp.safetensors"
    tc = TrainConfig(vocab=32, epochs=2, seq=8, batch=2, depth=2, val_every=3, dtype="float32", threads=1)
    logs: list[str] = []
    result = train(target, data, out, tc, log=logs.append)
    assert out.is_file() and meta_path(out).is_file()
    meta = read_meta(out)
    assert meta["data_positions"] == 240 and len(meta["data_digest"]) == 64
    assert "acc1" in meta["val_metrics"] and result.steps > 0
    assert any("step" in line and "acc1" in line for line in logs)  # the progress line
    assert head_window(out) == 8
    head = load_head(out, TargetWeights(target))
    assert head.cfg.vocab_out == 32 and head.vocab_ids.shape == (32,)
    # Served: the proposer drafts only tokens of the head's vocabulary.
    fake = HiddenFake()
    prop = MTPProposer(fake, open_head(fake, out, target, int8=False))
    ctx = [3, 1, 4, 1, 5, 9, 2]
    fake.sync(ctx[:-1], output="none")
    drafted = prop.propose(ctx, 3, GREEDY, np.random.default_rng(0)).tokens
    assert len(drafted) == 3 and set(drafted) <= set(head.vocab_ids.tolist())
    # Resumed: continues from the saved step with the same vocabulary.
    again = train(target, data, out, TrainConfig(**{**tc.__dict__, "epochs": 3}), resume=True, log=logs.append)
    assert again.steps > result.steps
    assert torch.equal(load_head(out, TargetWeights(target)).vocab_ids, head.vocab_ids)


def test_the_head_offers_nothing_while_the_target_kept_no_hidden_state_of_the_last_position():
    """After a pass shared with other requests (batch.py) slot 0 keeps no hidden states: the
    head has nothing to draft from, so it must not be chosen (it would propose nothing)."""
    target = HiddenFake()
    prop = MTPProposer(target, RecordingRunner())
    ctx = [5, 9, 2, 7, 3, 8]
    target.sync(ctx[:-1], output="none")
    assert prop.preview(ctx, 4).available == 4
    target.kept_from = len(target.tokens)  # what a shared pass leaves: no state kept
    assert prop.preview(ctx, 4).available == 0
