"""Exact mode (runtime.exact) on the real target: a row's logits do not depend on the batch it is
computed in, so greedy speculation returns plain decoding's tokens bit for bit, with no near-tie
exemption (llama/kernels.py says which llama.cpp paths break this by default and why)."""

from __future__ import annotations

import numpy as np
import pytest

from homespec.config import Config
from homespec.llama.gguf_info import read_gguf_info
from homespec.llama.kernels import EXACT_MAX_ROWS, TILED_MIN_ROWS, amx_buffer_available, reference_kernels_available
from homespec.llama.runtime import Runtime
from homespec.models.loader import open_target, runtime_options
from homespec.models.memory import kv_cells
from homespec.serving.daemon import Daemon
from homespec.speculation.batch import Batch
from homespec.speculation.constraints import json_schema_grammar
from homespec.speculation.engine import Engine, FixedPolicy
from homespec.speculation.proposers.draft import DraftProposer
from homespec.speculation.proposers.ngram import NgramProposer
from tests.conftest import DRAFT, TARGET, require
from tests.integration.exactness import batch_noise, borrowed_prefix, encode

# A context past 256 tokens makes llama.cpp's one-token passes span 512 KV cells, where an f16
# cache would take a split softmax that batched passes do not.
LONG = "Explain recursion to a new programmer." + " Explain each step of your reasoning in detail." * 30
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Rename the variable `x` to `count` and output the whole code:\n\n```python\nx = 0\nfor item in items:\n    if item.ok:\n        x += 1\nprint(x)\n```",
    LONG,
]


# Exact mode's two ways to load the target: every weight unpacked (any CPU), and AMX's buffer
# kept, as the daemon loads it where AMX is in use (llama/kernels.py).
KERNELS = ["unpacked", "amx"]


def open_exact(kernels: str, cfg: Config, n_ctx: int, slots: int = 1) -> Runtime:
    if kernels == "amx" and not amx_buffer_available():
        pytest.skip("no AMX here (CPU or llama.cpp build): exact mode loads the target unpacked")
    cfg.runtime.exact = True
    rt = open_target(cfg, require(TARGET), n_ctx, slots=slots, amx=kernels == "amx")
    # llama.cpp reports every buffer it loads weights into (an empty record would pass anything).
    assert rt.weight_buffers and sum(rt.weight_buffers.values()) > 900, rt.weight_buffers  # MiB; a ~1 GB file
    assert ("AMX" in rt.weight_buffers) == (kernels == "amx") and "CPU_REPACK" not in rt.weight_buffers, rt.weight_buffers
    # `make install` builds llama.cpp with the switch: decode passes of any length on its reference kernels.
    assert rt.opts.reference_decode == reference_kernels_available()
    return rt


def longest_pass(rt: Runtime) -> int:
    """Rows one exact-mode decode pass may hold on this target (Config.max_pass_rows)."""
    limit = Config().speculation.k_max + 1 if rt.opts.reference_decode else EXACT_MAX_ROWS
    cfg = Config()
    cfg.runtime.exact = True
    assert cfg.max_pass_rows(rt.opts.reference_decode) == limit
    return limit


@pytest.fixture(scope="module", params=KERNELS)
def exact_rt(request):
    rt = open_exact(request.param, Config(), 1024)
    yield rt
    rt.close()


@pytest.mark.integration
def test_in_exact_mode_a_rows_logits_do_not_depend_on_the_batch(exact_rt):
    assert len(encode(exact_rt, LONG)) > 256
    # Past ggml's tiled-matmul threshold (8 rows) and AMX's 32-row tile blocks, where the
    # decode passes take llama.cpp's reference kernels.
    sizes = [n for n in (2, 3, 5, 7, 8, 9, 17, 33) if n <= longest_pass(exact_rt)]
    deltas = batch_noise(exact_rt, [PROMPTS[0], LONG], positions=max(sizes) + 1, sizes=sizes)
    for text, ds in deltas.items():
        assert ds == [0.0] * len(sizes), f"{text!r}: max |Δlogit| per batch size {dict(zip(sizes, ds))}"


@pytest.mark.integration
def test_in_exact_mode_decode_passes_take_the_reference_kernels_and_prompts_the_fast_ones(exact_rt, monkeypatch):
    from homespec.llama import runtime

    if not exact_rt.opts.reference_decode:
        pytest.skip("this llama.cpp build has no reference-kernel switch: exact mode keeps passes below 8 rows")
    asked: list[bool] = []

    def spy(reference: bool):
        asked.append(reference)
        return real(reference)

    real = runtime.pass_kernels
    monkeypatch.setattr(runtime, "pass_kernels", spy)
    exact_rt.reset()
    exact_rt.sync(encode(exact_rt, PROMPTS[0]))  # a prompt: the tiled matmul's speed
    exact_rt.eval([1000, 1001, 1002], "all")  # a verify pass
    exact_rt.eval_many([(exact_rt.slot(0), [1003], "all")])  # a decode step among others'
    exact_rt.eval([1004, 1005], "none")  # a prompt's next chunk
    assert asked == [False, True, True, False]
    exact_rt.reset()


@pytest.mark.integration
@pytest.mark.parametrize("proposer, k", [("ngram", 16), ("draft", 4)])
def test_in_exact_mode_greedy_speculation_returns_plain_decodings_tokens(exact_rt, draft_rt, proposer, k):
    k = min(k, longest_pass(exact_rt) - 1)
    engine = Engine(exact_rt)
    spec_policy = FixedPolicy(NgramProposer(2, 12) if proposer == "ngram" else DraftProposer(draft_rt, exact_rt.n_vocab), k)
    for text in PROMPTS:
        prompt = encode(exact_rt, text)
        out = {}
        for name, policy in (("plain", FixedPolicy()), ("spec", spec_policy)):
            exact_rt.reset()
            out[name] = [t for ev in engine.generate(prompt, max_tokens=40, policy=policy) for t in ev.tokens]
        assert out["spec"] == out["plain"], f"{text[:40]!r}: speculation changed the output"


@pytest.mark.integration
def test_an_exact_mode_host_drafts_as_far_as_its_kernels_allow_and_matches_plain_decoding():
    from homespec.config import ModelRef, ModelsConfig, RuntimeConfig
    from homespec.serving.host import GenerationRequest, Host
    from tests.conftest import ROOT

    cfg = Config(models=ModelsConfig(target=ModelRef(path=require(TARGET)), draft=None),
                 runtime=RuntimeConfig(n_ctx=1024, exact=True), base_dir=ROOT)
    with Host.open(cfg, calibrate=False, with_draft=False) as s:
        limit = longest_pass(s.models.target)
        assert s.controller.k_max == s.k_limit == limit - 1
        # Where AMX is in use the daemon keeps its buffer for the target, and no repacked layout.
        assert ("AMX" in s.models.target.weight_buffers) == amx_buffer_available()
        assert "CPU_REPACK" not in s.models.target.weight_buffers
        rows: list[int] = []
        eval_ = s.models.target.eval

        def counted(tokens, output="all"):
            if output == "all":
                rows.append(len(tokens))
            return eval_(tokens, output)

        s.models.target.eval = counted  # type: ignore[method-assign]
        prompt = s.models.encode_chat([{"role": "user", "content": PROMPTS[1]}])
        plain = [t for ev in s.generate(prompt, GenerationRequest(max_tokens=48, mode="off")) for t in ev.tokens]
        rows.clear()
        k = limit + 2 if limit == EXACT_MAX_ROWS else 12  # without the reference kernels: more than exact allows
        gen = s.generate(prompt, GenerationRequest(max_tokens=48, mode="ngram", k=k))
        spec = [t for ev in gen for t in ev.tokens]
        assert gen.stats.proposed > 0 and max(rows) == min(k + 1, limit)  # the copy drafts as far as allowed
        assert limit == EXACT_MAX_ROWS or max(rows) > TILED_MIN_ROWS
        assert spec == plain
        # A grammar's jump-forward tokens are drafts too: a long forced run is cut to fit.
        schema = {"type": "object", "properties": {"a_rather_long_property_name_that_the_grammar_forces": {"type": "integer"}},
                  "required": ["a_rather_long_property_name_that_the_grammar_forces"]}
        rows.clear()
        ask = s.models.encode_chat([{"role": "user", "content": "Give me a JSON object."}])
        list(s.generate(ask, GenerationRequest(max_tokens=24, mode="off", grammar=json_schema_grammar(schema))))
        assert max(rows) == EXACT_MAX_ROWS if limit == EXACT_MAX_ROWS else TILED_MIN_ROWS < max(rows) <= limit


@pytest.mark.integration
def test_the_memory_plan_counts_exact_modes_q8_0_cache_at_the_bytes_llama_cpp_keeps_per_token(exact_rt):
    cfg = Config()
    cfg.runtime.exact = True
    per_token = read_gguf_info(TARGET).kv_bytes_per_token(cfg.runtime.kv_type)  # bytes, what plan_load counts
    saved = []
    for n in (64, 128):
        exact_rt.reset()
        exact_rt.eval(list(range(1000, 1000 + n)))
        saved.append(exact_rt.save_state().size)  # bytes: the sequence's cells as llama.cpp stores them
    # Measured 15,244 bytes a token: 15,232 of K and V (q8_0) plus the cell's position and sequence.
    assert 0 <= (saved[1] - saved[0]) / 64 - per_token <= 16


@pytest.mark.integration
def test_the_daemons_memory_plan_gives_exact_mode_the_smaller_q8_0_cache():
    require(TARGET)
    info = read_gguf_info(TARGET)
    for exact, kv_type in ((False, "f16"), (True, "q8_0")):
        cfg = Config()
        cfg.runtime.exact = exact
        d = Daemon(cfg)
        plan = d._plan()  # GGUF headers only: no weights are loaded
        cells = kv_cells(plan.n_ctx, d.slots, unified=not exact)  # every slot's sequence
        assert d.footprints[0].kv == cells * info.kv_bytes_per_token(kv_type), kv_type  # bytes


@pytest.fixture(scope="module", params=KERNELS)
def exact_slots(request):
    cfg = Config()
    cfg.runtime.exact = True
    cfg.runtime.n_batch = 64  # prompts longer than this are read in chunks, between decode rounds
    target = open_exact(request.param, cfg, 768, slots=4)
    draft = Runtime(require(DRAFT), runtime_options(cfg, 0, n_ctx=768, slots=4, draft=True))
    yield target, draft
    target.close()
    draft.close()


@pytest.mark.integration
def test_in_exact_mode_requests_decoded_together_return_their_lone_plain_decoding_token_for_token(exact_slots):
    rt, draft = exact_slots
    texts = [PROMPTS[0], LONG, PROMPTS[1], "Explain what a hash map is in two sentences."]
    prompts = [encode(rt, t) for t in texts]
    alone = []
    for p in prompts:
        for i in range(4):
            rt.slot(i).reset()
        alone.append([t for ev in Engine(rt).generate(p, max_tokens=40, policy=FixedPolicy()) for t in ev.tokens])
    for i in range(4):
        rt.slot(i).reset()
    decode_rows: list[int] = []

    def counted(parts):
        if all(output == "all" for _, _, output in parts):
            decode_rows.append(sum(len(toks) for _, toks, _ in parts))
        return rt.eval_many(parts)

    policies = [  # a different proposer per request, k = 0 included
        FixedPolicy(DraftProposer(draft.slot(0), rt.n_vocab), 4),
        FixedPolicy(),
        FixedPolicy(NgramProposer(2, 12), min(12, longest_pass(rt) - 1)),
        FixedPolicy(DraftProposer(draft.slot(3), rt.n_vocab), 2),
    ]
    # Several steps share a pass up to max_rows; an even row budget tries more sharings than the default.
    max_rows = min(longest_pass(rt), 16)
    batch = Batch(counted, n_batch=rt.n_batch, prefill_chunk=32, max_rows=max_rows)
    out: dict[int, list[int]] = {i: [] for i in range(4)}
    for i, p in enumerate(prompts):
        draft.slot(i).reset()
        for ev in batch.add(i, Engine(rt.slot(i)).steps(p, max_tokens=40, policy=policies[i])):
            out[i] += ev.tokens
    while len(batch):
        batch.step(lambda key, ev: out[int(key)].extend(ev.tokens))  # type: ignore[call-overload]
    assert len(decode_rows) >= 10 and max(decode_rows) <= max_rows  # shared passes, all narrow
    assert max_rows == EXACT_MAX_ROWS or max(decode_rows) > TILED_MIN_ROWS
    assert [out[i] for i in range(4)] == alone  # no near-tie exemption


@pytest.mark.integration
def test_in_exact_mode_a_sequence_that_grows_into_cells_another_freed_computes_its_rows_as_alone(exact_slots):
    rt, _ = exact_slots
    toks = encode(rt, LONG)
    prompt, following, other = toks[:250], toks[250:253], toks[:200]

    def clear() -> None:
        for i in range(4):
            rt.slot(i).reset()

    clear()
    rt.slot(0).eval(prompt, "last")
    alone = rt.slot(0).eval(following, "all").copy()  # [3, vocab]
    clear()
    rt.slot(1).eval(other, "last")  # in a shared buffer: the first cells
    rt.slot(0).eval(prompt, "last")  # after them
    rt.slot(1).reset()  # frees the first cells ...
    rt.slot(2).eval(other[:50], "last")
    beside = rt.eval_many([(rt.slot(0), following, "all"), (rt.slot(2), other[50:51], "all")])[0]
    clear()
    # ... where slot 0's next tokens land, before its prompt's: in one unified buffer 0.66 apart.
    assert float(np.abs(beside - alone).max()) == 0.0


@pytest.mark.integration
def test_in_exact_mode_a_prefix_borrowed_from_another_stream_reads_bit_for_bit_as_its_own(exact_slots):
    """Across streams a borrowed prefix is a copy of the lender's cells (llama.cpp would abort a
    partial cross-stream seq_cp); the borrower's next rows equal those of a slot that read the
    prefix itself, exactly."""
    rt, _ = exact_slots
    assert not rt.shares_cells
    lender, borrower, reader = rt.slot(1), rt.slot(0), rt.slot(2)
    prompt, n = borrowed_prefix(rt, PROMPTS[0], PROMPTS[1], lender, borrower, reader)
    lender.reset()  # the copy outlives its source
    got, want = borrower.eval(prompt[n:], "all"), reader.eval(prompt[n:], "all")
    assert float(np.abs(got - want).max()) == 0.0
    for s in (borrower, reader):
        s.reset()
