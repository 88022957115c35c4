"""The MTP head on the real target: hidden states kept by the runtime, and greedy exactness.

The runtime tests need only the target. The proposer tests need a trained head, a user-side
artefact (`homespec train-mtp` writes models/<target>.mtp.safetensors, ~1-2 h on 2 cores): they
skip with that reason when it is missing. Exactness is DESIGN.md's rule, as in
test_exactness.py: (a) every emitted token is the argmax of the target logits that verified it;
(b) the output equals plain decoding up to the first near-tie (margin below the batch noise).
"""

from __future__ import annotations

import numpy as np
import pytest

from homespec.runtime import Runtime, RuntimeOptions
from tests.conftest import MODELS, TARGET, require
from tests.integration.exactness import Recording, encode, first_divergence, margin

HEAD = MODELS / (TARGET.stem + ".mtp.safetensors")
WINDOW = 16
MAX_TOKENS = 48
PROMPTS = [  # code prompts held out from the head's training data (homespec.mtp.collect)
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that returns the maximum subarray sum (Kadane's algorithm) with a docstring.",
    "Write a Python class `RateLimiter` that allows at most n calls per second, using time.monotonic.",
]


@pytest.fixture(scope="module")
def hidden_rt():
    rt = Runtime(require(TARGET), RuntimeOptions(n_ctx=1024, n_batch=256, hidden_window=WINDOW))
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def embeddings_rt():
    rt = Runtime(require(TARGET), RuntimeOptions(n_ctx=1024, n_batch=256, embeddings=True))
    yield rt
    rt.close()


def _reference_hidden(rt: Runtime, tokens: list[int]) -> np.ndarray:
    rt.reset()
    rt.eval(tokens, output="all")
    return rt.last_hidden  # [n, d]


@pytest.mark.integration
def test_hidden_window_keeps_the_last_positions_aligned_through_prefill_steps_and_truncation(hidden_rt, embeddings_rt):
    prompt = encode(hidden_rt, PROMPTS[0])
    cont = hidden_rt.tokenize(" def fib(n):\n    a, b = 0, 1\n    for _ in range(n):", add_special=False)
    hidden_rt.reset()
    hidden_rt.sync(prompt)  # bulk without embeddings, the last WINDOW with
    assert hidden_rt.hidden_start == len(prompt) - WINDOW
    hidden_rt.eval(cont[:5])  # a step of 5 ...
    hidden_rt.truncate(len(prompt) + 2)  # ... 2 accepted: the rejected tail's states go too
    hidden_rt.eval(cont[6:8])  # the next step, with other tokens at the truncated positions
    seq = prompt + cont[:2] + cont[6:8]
    assert hidden_rt.tokens == seq
    assert hidden_rt.hidden_start == len(prompt) - WINDOW  # nothing older was dropped yet
    ref = _reference_hidden(embeddings_rt, seq)  # [n, d] every position in one pass
    got = hidden_rt.hidden_rows(hidden_rt.hidden_start, len(seq))
    want = ref[hidden_rt.hidden_start :]
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 0.02, f"hidden states differ by {rel:.3f} of their scale: misaligned?"
    # A position's state matches that position, not a neighbour's.
    assert np.abs(got[-1] - want[-1]).max() < np.abs(got[-1] - want[-2]).max()


@pytest.mark.integration
def test_hidden_window_leaves_the_logits_of_prefill_unchanged(hidden_rt, target_rt, epsilon):
    prompt = encode(hidden_rt, PROMPTS[1])
    hidden_rt.reset()
    target_rt.reset()
    a = hidden_rt.sync(prompt)[0]
    b = target_rt.sync(prompt)[0]
    target_rt.reset()
    assert int(np.argmax(a)) == int(np.argmax(b))
    assert np.abs(a - b).max() <= max(4 * epsilon, 0.05)


@pytest.fixture(scope="module")
def mtp_engine_parts():
    pytest.importorskip("torch", reason="the MTP head needs torch: pip install 'homespec[mtp]'")
    if not HEAD.exists():
        pytest.skip(f"no trained MTP head at {HEAD} (a user-side artefact: run `homespec train-mtp`)")
    from homespec.proposers.mtp import head_window, open_mtp

    rt = Runtime(require(TARGET), RuntimeOptions(n_ctx=1024, n_batch=256, hidden_window=head_window(HEAD)))
    prop = open_mtp(rt, HEAD, TARGET)
    yield rt, prop
    rt.close()


def _generate(engine, prompt, policy):
    from homespec.engine import GenerationStats

    engine.target.reset()
    st = GenerationStats()
    out = [t for ev in engine.generate(prompt, max_tokens=MAX_TOKENS, policy=policy, stats=st) for t in ev.tokens]
    return out, st


@pytest.mark.integration
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_mtp_speculation_matches_plain_decoding_except_at_near_ties(mtp_engine_parts, epsilon, k):
    from homespec.engine import Engine, FixedPolicy

    rt, prop = mtp_engine_parts
    rec = Recording(rt)
    engine = Engine(rec, {"mtp": prop})
    proposed = accepted = diverged = 0
    for text in PROMPTS:
        prompt = encode(rt, text)
        rec.rows.clear()
        plain, _ = _generate(engine, prompt, FixedPolicy())
        plain_margins = {pos: margin(row) for pos, row in rec.rows}
        rec.rows.clear()
        spec, st = _generate(engine, prompt, FixedPolicy("mtp", k))
        proposed += st.proposed
        accepted += st.accepted
        verified = dict(rec.rows)
        for i, tok in enumerate(spec[1:], start=1):  # (a)
            assert int(np.argmax(verified[len(prompt) + i - 1])) == tok, f"token {i} is not the target's argmax"
        j = first_divergence(plain, spec)  # (b)
        if j is None:
            assert len(spec) == len(plain)
            continue
        diverged += 1
        m = plain_margins.get(len(prompt) + j - 1)
        assert m is not None and m < epsilon, f"diverged at token {j} where plain's margin {m} >= epsilon {epsilon}"
    print(f"\nmtp k={k}: {accepted}/{proposed} accepted; {diverged}/{len(PROMPTS)} diverged, all at near-ties")
    assert proposed > 0 and accepted > 0
