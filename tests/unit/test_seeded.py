"""Seeded sampling: the same seed gives the same output whichever proposer and k speculate, and
the race it draws with is exact (its distribution over many seeds: test_engine_distribution.py)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from homespec.speculation.engine import Engine, FixedPolicy, GenerationStats
from homespec.speculation.proposers.draft import DraftProposer
from homespec.speculation.proposers.ngram import NgramProposer
from homespec.speculation.sampling import SamplingParams, choose, position_keys, race

from .fakes import FakeRuntime

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]


def generate(proposer: str | None, k: int, params: SamplingParams, max_tokens: int = 40):
    target = FakeRuntime(seed=0)
    proposers = {
        "close": DraftProposer(FakeRuntime(seed=0, sharpness=2.5), target.n_vocab),  # the target's logits, flatter
        "self": DraftProposer(FakeRuntime(seed=0), target.n_vocab),  # the target itself
        "wrong": DraftProposer(FakeRuntime(seed=7), target.n_vocab),  # unrelated logits
        "ngram": NgramProposer(1, 3),
    }
    policy = FixedPolicy(proposers[proposer], k) if proposer else FixedPolicy()
    st = GenerationStats()
    out = [t for ev in Engine(target).generate(PROMPT, params, max_tokens, policy=policy, stats=st) for t in ev.tokens]
    return out, st


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, seed=11),
        SamplingParams(temperature=1.2, top_k=20, top_p=0.95, presence_penalty=0.5, repetition_penalty=1.2, seed=3),
    ],
    ids=["t0.8", "t1.2-topk-topp-penalties"],
)
def test_seeded_output_is_the_same_for_every_proposer_and_k(params):
    ref, _ = generate(None, 0, params)
    for proposer, k in [("close", 1), ("close", 3), ("close", 5), ("wrong", 3), ("ngram", 4), ("self", 4)]:
        out, st = generate(proposer, k, params)
        assert out == ref, f"{proposer} k={k} changed the seeded output"
        if proposer == "close":  # the check means something only if drafts were kept and refused
            assert 0 < st.accepted < st.proposed, (proposer, k, st.accepted, st.proposed)


def test_seeded_output_changes_with_the_seed():
    a, _ = generate("close", 3, SamplingParams(temperature=0.8, seed=1))
    b, _ = generate("close", 3, SamplingParams(temperature=0.8, seed=2))
    assert a != b


def test_seeded_self_speculation_accepts_every_proposed_token():
    """A draft equal to the target races the same q = p against the same keys: it always wins."""
    _, st = generate("self", 4, SamplingParams(temperature=0.9, top_p=0.9, seed=5), max_tokens=41)
    assert st.accepted == st.proposed > 0


def test_race_against_fresh_keys_is_a_draw_from_p():
    p = np.array([0.05, 0.4, 0.0, 0.25, 0.3])
    n = 20_000
    counts = np.bincount([race(p, position_keys(123, j, p.shape[0])) for j in range(n)], minlength=5)
    assert counts[2] == 0  # no mass, never drawn
    keep = p > 0
    assert chisquare(counts[keep], p[keep] * n).pvalue > 1e-3, counts


def test_a_draft_raced_against_the_same_keys_matches_at_least_the_coupling_bound():
    """P(race(q) == race(p)) >= (1 - TV) / (1 + TV): the acceptance a seeded draft keeps, against
    Leviathan's 1 - TV. Here (sigma 0.3): ~0.84 against 0.87, bound 0.77."""
    rng = np.random.default_rng(0)
    hits, bound, leviathan, n = 0, 0.0, 0.0, 4000
    for j in range(n):
        z = rng.normal(size=200) * 3
        p = np.exp(z - z.max())
        q = np.exp(z + 0.3 * rng.normal(size=200) - z.max())
        p, q = p / p.sum(), q / q.sum()
        tv = 0.5 * np.abs(p - q).sum()
        keys = position_keys(9, j, 200)
        hits += race(p, keys) == race(q, keys)
        bound += (1 - tv) / (1 + tv) / n
        leviathan += (1 - tv) / n
    rate = hits / n
    assert bound - 4 * np.sqrt(bound * (1 - bound) / n) <= rate <= leviathan


def test_position_keys_are_a_function_of_seed_and_position_alone():
    position_keys.cache_clear()
    later_first = position_keys(42, 7, 50).copy()
    position_keys.cache_clear()
    for j in range(7):  # drawing the earlier positions first changes nothing
        position_keys(42, j, 50)
    assert np.array_equal(position_keys(42, 7, 50), later_first)
    assert not np.array_equal(position_keys(42, 8, 50), later_first)
    assert not np.array_equal(position_keys(43, 7, 50), later_first)
    assert np.all(later_first >= 0)


def test_a_seeded_draw_without_a_position_is_refused():
    with pytest.raises(ValueError, match="position"):
        choose(np.zeros(4), SamplingParams(temperature=1.0, seed=1), [], np.random.default_rng(0))
