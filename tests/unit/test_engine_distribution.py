"""Exactness through the whole loop at temperature > 0: with a draft model, penalties and top-k /
top-p, the first generated tokens are distributed as plain sampling of the target makes them.

The reference is exact, not sampled: the joint probability of every possible 4-token start,
computed from the scripted target logits through the plain-decoding transform (penalties over
the window, then temperature, top-k, top-p). Each arm generates from many draws and a chi-square
goodness-of-fit test compares. The first step after the prefill token verifies 3 drafted tokens,
so rows with drafted tokens in their penalty history, rejections, residual draws and the bonus
all feed the sample.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from homespec.speculation import engine as engine_mod
from homespec.speculation.engine import Engine, FixedPolicy, GenerationStats
from homespec.speculation.infill_sampler import InfillVocab
from homespec.speculation.proposers.draft import DraftProposer
from homespec.speculation.sampling import SamplingParams, penalize, probabilities, window, with_logit_bias

from .fakes import FakeRuntime

VOCAB = 8
PROMPT = [1, 2, 3, 1, 5]
N_TOKENS = 4  # the first token (prefill) + 3 from the first speculative step at k = 3
DRAWS = 2000  # enough to catch a q that is not the one drawn from (p ~ 1e-5 at k = 1, 1e-16 at k = 3)
# Strong penalties over a short window, so that a row scored with the wrong history (the
# drafted tokens missing from it, or the window cut in the wrong place) moves probabilities a lot.
PARAMS = dict(
    temperature=1.0, top_k=4, top_p=0.9, repetition_penalty=1.5, presence_penalty=0.6,
    frequency_penalty=0.4, penalty_last_n=3,
)


def target() -> FakeRuntime:
    return FakeRuntime(vocab=VOCAB, seed=0, sharpness=1.0)


def draft() -> DraftProposer:
    # Same scripted logits, sharper: close to the target but not equal, so drafts are both
    # accepted and rejected (~80 % acceptance).
    return DraftProposer(FakeRuntime(vocab=VOCAB, seed=0, sharpness=1.6), VOCAB)


def exact_starts(params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first N_TOKENS tokens = s) for every s with mass, by plain decoding's transform."""
    ref = target()
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(N_TOKENS):
        nxt: dict[tuple[int, ...], float] = {}
        for s, ps in out.items():
            ctx = PROMPT + list(s)
            p = probabilities(penalize(ref.logits_after(ctx), params, window(ctx, params)), params)  # [vocab]
            for t in np.flatnonzero(p):
                nxt[(*s, int(t))] = ps * float(p[t])
        out = nxt
    return out


def generate_starts(k: int, seeded: bool, draws: int = DRAWS, bias: dict[int, float] | None = None,
                    **overrides: object) -> tuple[list[tuple[int, ...]], float]:
    """The first N_TOKENS tokens of `draws` generations; and the acceptance rate."""
    eng, d = Engine(target()), draft()
    starts, accepted, proposed = [], 0, 0
    for i in range(draws):
        params = with_logit_bias(SamplingParams(**{**PARAMS, **overrides}, seed=i if seeded else None), bias)  # type: ignore[arg-type]
        policy = FixedPolicy(d, k) if k else FixedPolicy()
        st = GenerationStats()
        toks = [t for ev in eng.generate(PROMPT, params, max_tokens=N_TOKENS + 1, policy=policy, stats=st) for t in ev.tokens]
        starts.append(tuple(toks[:N_TOKENS]))
        accepted, proposed = accepted + st.accepted, proposed + st.proposed
    return starts, accepted / proposed if proposed else 0.0


def fit_pvalue(starts: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """Chi-square goodness of fit; cells expecting < 5 draws are pooled into one."""
    assert set(starts) <= set(exact), "a start the target cannot produce"
    n = len(starts)
    counts = {s: 0 for s in exact}
    for s in starts:
        counts[s] += 1
    big = [s for s in exact if exact[s] * n >= 5]
    small = [s for s in exact if exact[s] * n < 5]
    obs = [counts[s] for s in big] + ([sum(counts[s] for s in small)] if small else [])
    exp = np.asarray([exact[s] for s in big] + ([sum(exact[s] for s in small)] if small else []))
    return float(chisquare(obs, exp * n / exp.sum()).pvalue)  # rescaled: float sums must agree


@pytest.fixture
def fixed_rng(monkeypatch):
    """Unseeded requests draw fresh entropy; pin it so the test is deterministic."""
    rng = np.random.default_rng(20240611)
    monkeypatch.setattr(engine_mod, "make_rng", lambda seed: rng)


@pytest.mark.parametrize("k", [0, 3])  # k = 0: plain decoding, the control
def test_unseeded_draft_with_penalties_and_truncation_samples_the_targets_distribution(k, fixed_rng):
    starts, acceptance = generate_starts(k, seeded=False)
    assert k == 0 or 0.3 < acceptance < 0.98  # both accepts and rejections were exercised
    p = fit_pvalue(starts, exact_starts(SamplingParams(**PARAMS)))
    assert p > 1e-3, f"k={k}: first {N_TOKENS} tokens not distributed as the target's (chi-square p = {p:.2g})"


def test_seeded_draft_with_penalties_and_truncation_samples_the_targets_distribution():
    """Over many seeds, the seeded path (keys per position, draft raced against them) is exact."""
    starts, acceptance = generate_starts(3, seeded=True)
    assert 0.3 < acceptance < 0.98
    p = fit_pvalue(starts, exact_starts(SamplingParams(**PARAMS)))
    assert p > 1e-3, f"seeded: first {N_TOKENS} tokens not distributed as the target's (chi-square p = {p:.2g})"


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
def test_a_logit_bias_keeps_speculation_exact_and_a_banned_token_never_comes(seeded, fixed_rng):
    """Rejection sampling is exact for the biased target whatever q the draft reports; here
    the draft's q carries the bias too (the one transform), which keeps acceptance up."""
    bias = {0: -100.0, 6: 1.5}  # 0: the likeliest first token unbiased; 6: a boosted one
    starts, acceptance = generate_starts(3, seeded=seeded, bias=bias)
    assert 0.3 < acceptance < 0.98
    assert all(0 not in s for s in starts)
    p = fit_pvalue(starts, exact_starts(with_logit_bias(SamplingParams(**PARAMS), bias)))
    assert p > 1e-3, f"biased: first {N_TOKENS} tokens not distributed as the biased target's (chi-square p = {p:.2g})"


# Texts that begin one another ("a", "ab", "abc"; "c", "ca"), so that llama.cpp's infill sampler
# merges candidates; 7 ends the text.
INFILL_PIECES = [b"a", b"ab", b"b", b"abc", b"c", b"ca", b"d", b""]
INFILL = InfillVocab(piece=INFILL_PIECES.__getitem__, is_eog=lambda t: t == 7, eot=7)


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
def test_the_infill_sampler_keeps_speculation_exact(seeded, fixed_rng):
    """/infill's `samplers: [top_k, top_p, infill]` (editor plugins): the cut is part of the one
    transform, so target rows, the first token and the draft's q all go through it. Tempered
    flatter (3), so that the cut leaves several starts and drafts are also rejected."""
    infill = {"infill": INFILL, "temperature": 3.0}
    starts, acceptance = generate_starts(3, seeded=seeded, **infill)
    assert 0.3 < acceptance < 0.98
    exact = exact_starts(SamplingParams(**{**PARAMS, **infill}))  # type: ignore[arg-type]
    assert 5 <= len(exact) < len(exact_starts(SamplingParams(**{**PARAMS, "temperature": 3.0})))  # the cut removed candidates
    p = fit_pvalue(starts, exact)
    assert p > 1e-3, f"infill: first {N_TOKENS} tokens not distributed as the target's (chi-square p = {p:.2g})"


def test_the_exact_reference_is_a_distribution_over_starts():
    exact = exact_starts(SamplingParams(**PARAMS))
    assert sum(exact.values()) == pytest.approx(1.0)
    # top-k 4 bounds the starts; enough of them that the chi-square test has cells to compare
    assert 20 < len(exact) <= 4**N_TOKENS


def test_requests_sampled_together_in_one_batch_each_keep_the_targets_distribution(fixed_rng):
    """Four requests per pass (speculation/batch.py), each with its own draft sequence and k
    (plain included): every request's start is still distributed as the target's."""
    from homespec.speculation.batch import Batch

    rt, drafts = FakeRuntime(vocab=VOCAB, seed=0, sharpness=1.0, n_seq=4), FakeRuntime(vocab=VOCAB, seed=0, sharpness=1.6, n_seq=4)
    ks = [3, 0, 2, 3]
    starts: list[tuple[int, ...]] = []
    accepted = proposed = 0
    for _ in range(DRAWS // 4):
        batch = Batch(rt.eval_many, n_batch=512, prefill_chunk=64)
        tokens: dict[int, list[int]] = {i: [] for i in range(4)}
        stats = [GenerationStats() for _ in range(4)]
        for i, k in enumerate(ks):
            policy = FixedPolicy(DraftProposer(drafts.slot(i), VOCAB), k) if k else FixedPolicy()
            steps = Engine(rt.slot(i)).steps(PROMPT, SamplingParams(**PARAMS), max_tokens=N_TOKENS + 1, policy=policy, stats=stats[i])
            for ev in batch.add(i, steps):
                tokens[i] += ev.tokens
        while len(batch):
            batch.step(lambda key, ev, tokens=tokens: tokens[int(key)].extend(ev.tokens))  # type: ignore[call-overload]
        starts += [tuple(tokens[i][:N_TOKENS]) for i in range(4)]
        accepted += sum(s.accepted for s in stats)
        proposed += sum(s.proposed for s in stats)
    assert max(len(p) for p in rt.passes) == 4  # the four shared passes
    assert 0.3 < accepted / proposed < 0.98
    p = fit_pvalue(starts, exact_starts(SamplingParams(**PARAMS)))
    assert p > 1e-3, f"batched: first {N_TOKENS} tokens not distributed as the target's (chi-square p = {p:.2g})"
