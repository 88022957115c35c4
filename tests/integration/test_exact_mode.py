"""Exact mode (runtime.exact) on the real target: a row's logits do not depend on the batch it is
computed in, so greedy speculation returns plain decoding's tokens bit for bit, with no near-tie
exemption (llama/kernels.py says which llama.cpp paths break this by default and why)."""

from __future__ import annotations

import pytest

from homespec.config import Config
from homespec.llama.kernels import EXACT_MAX_ROWS
from homespec.llama.runtime import Runtime
from homespec.models.loader import runtime_options
from homespec.speculation.engine import Engine, FixedPolicy
from homespec.speculation.proposers.draft import DraftProposer
from homespec.speculation.proposers.ngram import NgramProposer
from tests.conftest import TARGET, require
from tests.integration.exactness import batch_noise, encode

# A context past 256 tokens makes llama.cpp's one-token passes span 512 KV cells, where an f16
# cache would take a split softmax that batched passes do not.
LONG = "Explain recursion to a new programmer." + " Explain each step of your reasoning in detail." * 30
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Rename the variable `x` to `count` and output the whole code:\n\n```python\nx = 0\nfor item in items:\n    if item.ok:\n        x += 1\nprint(x)\n```",
    LONG,
]


@pytest.fixture(scope="module")
def exact_rt():
    cfg = Config()
    cfg.runtime.exact = True
    rt = Runtime(require(TARGET), runtime_options(cfg, 0, n_ctx=1024))
    yield rt
    rt.close()


@pytest.mark.integration
def test_in_exact_mode_a_rows_logits_do_not_depend_on_the_batch(exact_rt):
    assert len(encode(exact_rt, LONG)) > 256
    sizes = range(2, EXACT_MAX_ROWS + 1)
    deltas = batch_noise(exact_rt, [PROMPTS[0], LONG], positions=EXACT_MAX_ROWS * 2, sizes=sizes)
    for text, ds in deltas.items():
        assert ds == [0.0] * len(sizes), f"{text!r}: max |Δlogit| per batch size {dict(zip(sizes, ds))}"


@pytest.mark.integration
@pytest.mark.parametrize("proposer, k", [("ngram", EXACT_MAX_ROWS - 1), ("draft", 4)])
def test_in_exact_mode_greedy_speculation_returns_plain_decodings_tokens(exact_rt, draft_rt, proposer, k):
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
def test_an_exact_mode_host_verifies_at_most_seven_rows_a_pass_and_matches_plain_decoding():
    from homespec.config import ModelRef, ModelsConfig, RuntimeConfig
    from homespec.serving.host import GenerationRequest, Host
    from tests.conftest import ROOT

    cfg = Config(models=ModelsConfig(target=ModelRef(path=require(TARGET)), draft=None),
                 runtime=RuntimeConfig(n_ctx=1024, exact=True), base_dir=ROOT)
    with Host.open(cfg, calibrate=False, with_draft=False) as s:
        assert s.controller.k_max == EXACT_MAX_ROWS - 1
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
        gen = s.generate(prompt, GenerationRequest(max_tokens=48, mode="ngram", k=12))  # asks for more than exact allows
        spec = [t for ev in gen for t in ev.tokens]
        assert gen.stats.proposed > 0 and max(rows) == EXACT_MAX_ROWS  # the copy drafts as far as allowed
        assert spec == plain
