"""Verification: table cases for greedy and rejection sampling, and the distribution test."""

from __future__ import annotations

import numpy as np
import pytest

from homespec.speculation.verify import greedy_verify, rejection_verify


@pytest.mark.parametrize(
    "case, proposed, target, accepted, emitted",
    [
        ("all accepted", [5, 6, 7], [5, 6, 7, 8], 3, [5, 6, 7, 8]),
        ("first rejected", [5, 6, 7], [4, 6, 7, 8], 0, [4]),
        ("mismatch at position 1", [5, 6, 7], [5, 9, 7, 8], 1, [5, 9]),
        ("last rejected", [5, 6, 7], [5, 6, 1, 8], 2, [5, 6, 1]),
        ("bonus only (k = 0)", [], [3], 0, [3]),
    ],
)
def test_greedy_verify_keeps_longest_matching_prefix_plus_target_token(case, proposed, target, accepted, emitted):
    v = greedy_verify(proposed, np.asarray(target))
    assert v.accepted == accepted, case
    assert v.tokens == emitted, case
    assert v.bonus == emitted[-1]
    assert v.outcomes == [True] * accepted + ([False] if accepted < len(proposed) else [])


def _onehot(ids, vocab=6):
    p = np.zeros((len(ids), vocab))
    p[np.arange(len(ids)), ids] = 1.0
    return p


def test_rejection_verify_accepts_token_the_target_is_certain_of():
    rng = np.random.default_rng(0)
    p = _onehot([2, 3, 4])
    v = rejection_verify([2, 3], p, None, rng)
    assert (v.accepted, v.tokens) == (2, [2, 3, 4])


def test_rejection_verify_rejects_token_the_target_gives_zero_probability():
    rng = np.random.default_rng(0)
    p = _onehot([2, 3, 4])
    q = _onehot([1, 3])
    v = rejection_verify([1, 3], p, q, rng)
    assert (v.accepted, v.tokens, v.outcomes) == (0, [2], [False])


@pytest.mark.parametrize("bad", [0, 1])
def test_rejection_verify_refuses_a_drafted_token_its_proposer_gave_zero_probability(bad):
    """q(x) = 0: x was not drawn from q (a proposer bug); any verdict would bias the output."""
    p = np.full((3, 4), 0.25)
    q = np.array([[0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0]])
    proposed = [0, 1]
    proposed[bad] = 2  # q has no mass on 2
    with pytest.raises(ValueError, match=f"position {bad}"):
        for seed in range(20):  # whatever the draws (an accepted first token reaches position 1)
            rejection_verify(proposed, p, q, np.random.default_rng(seed))


def test_rejection_verify_middle_rejection_draws_recovered_token_from_residual():
    rng = np.random.default_rng(1)
    p = np.array([[0, 1, 0, 0], [0.5, 0, 0.5, 0], [0.25] * 4])
    q = np.array([[0, 1, 0, 0], [0, 0, 0, 1.0]])  # second guess impossible under p
    for _ in range(50):
        v = rejection_verify([1, 3], p, q, rng)
        assert v.accepted == 1 and v.tokens[0] == 1
        assert v.tokens[1] in (0, 2)  # residual max(0, p - q) has mass only on 0 and 2


def test_rejection_verify_point_mass_rejection_never_reemits_the_rejected_token():
    rng = np.random.default_rng(2)
    p = np.array([[0.5, 0.5, 0.0], [1 / 3] * 3])
    for _ in range(200):
        v = rejection_verify([0], p, None, rng)
        if v.accepted == 0:
            assert v.tokens == [1]


def _draw(p: np.ndarray, rng: np.random.Generator) -> int:
    return int(rng.choice(len(p), p=p))


def _sigma_tolerance(p: np.ndarray, n: int, sigmas: float = 5.0) -> np.ndarray:
    """Per-token tolerance on an empirical frequency from n draws: `sigmas` standard errors."""
    return sigmas * np.sqrt(p * (1 - p) / n) + 1e-12


PAIRS = {
    "close": (np.array([0.4, 0.3, 0.2, 0.1]), np.array([0.35, 0.35, 0.2, 0.1])),
    "disjoint-ish": (np.array([0.7, 0.1, 0.1, 0.1]), np.array([0.05, 0.05, 0.1, 0.8])),
    "q has zeros": (np.array([0.25, 0.25, 0.25, 0.25]), np.array([0.0, 0.5, 0.5, 0.0])),
    "p has zeros": (np.array([0.0, 0.6, 0.4, 0.0]), np.array([0.25, 0.25, 0.25, 0.25])),
}


@pytest.mark.parametrize("name", PAIRS)
def test_rejection_sampling_output_distribution_equals_target(name):
    p, q = PAIRS[name]
    rng = np.random.default_rng(1234)
    n = 40_000
    counts = np.zeros(4)
    P = np.stack([p, np.full(4, 0.25)])  # [k+1, vocab]
    for _ in range(n):
        x = _draw(q, rng)
        v = rejection_verify([x], P, q[None, :], rng)
        counts[v.tokens[0]] += 1
    freq = counts / n
    assert np.all(np.abs(freq - p) <= _sigma_tolerance(p, n)), (name, freq, p)


@pytest.mark.parametrize("x", [0, 1, 3])
def test_point_mass_proposal_output_distribution_equals_target(x):
    p = np.array([0.1, 0.6, 0.3, 0.0])
    rng = np.random.default_rng(99 + x)
    n = 40_000
    counts = np.zeros(4)
    P = np.stack([p, np.full(4, 0.25)])
    for _ in range(n):
        counts[rejection_verify([x], P, None, rng).tokens[0]] += 1
    freq = counts / n
    assert np.all(np.abs(freq - p) <= _sigma_tolerance(p, n)), (freq, p)


def test_multi_token_steps_preserve_the_joint_distribution_of_two_positions():
    """Emit two tokens with k = 2 steps (positions have their own p and q); the pair's joint
    distribution must be p0 x p1, whether the second token was accepted, recovered or bonus."""
    P = [np.array([0.5, 0.3, 0.2]), np.array([0.1, 0.1, 0.8]), np.array([1 / 3] * 3)]
    Q = [np.array([0.2, 0.2, 0.6]), np.array([0.6, 0.3, 0.1]), np.array([1 / 3] * 3)]
    rng = np.random.default_rng(7)
    n = 30_000
    joint = np.zeros((3, 3))
    for _ in range(n):
        out: list[int] = []
        while len(out) < 2:
            j = len(out)
            k = 2 if j == 0 else 1
            d = [_draw(Q[j + i], rng) for i in range(k)]
            v = rejection_verify(d, np.stack(P[j : j + k + 1]), np.stack(Q[j : j + k]), rng)
            out += v.tokens
        joint[out[0], out[1]] += 1
    expected = np.outer(P[0], P[1])
    freq = joint / n
    assert np.all(np.abs(freq - expected) <= _sigma_tolerance(expected, n)), (freq, expected)
