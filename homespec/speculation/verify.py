"""Verification: which proposed tokens the target keeps. Pure functions over arrays.

Glossary (the words the API, the stats and the dashboard use):
- proposed: the k tokens d_1..d_k the proposer guessed.
- accepted: the longest prefix d_1..d_n (n <= k) that the verifier keeps.
- bonus: the one token the target adds after the accepted prefix. When a proposed token was
  rejected it is the *recovered* token, drawn from the residual distribution at that position;
  when all k were accepted it is drawn from the target's distribution after d_k.
- so every step emits n + 1 tokens, and never fewer than one.

Greedy (temperature 0): d_i is accepted while it equals the target's argmax at its position;
the bonus is the target's argmax at the first mismatch (or after d_k). The output is then, by
construction, what plain greedy decoding of the target emits.

Sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
Algorithm 1): with target probabilities p_i and proposer probabilities q_i at position i,
accept d_i with probability min(1, p_i(d_i) / q_i(d_i)) — so where q <= p the token is always
kept. At the first rejection, draw from norm(max(0, p_i - q_i)). Every emitted token is then
distributed exactly as if drawn from p. A deterministic proposer (ngram) is the point mass
q = onehot(d_i): accept with probability p_i(d_i); on rejection draw from p_i with d_i removed.
A drafted token with q_i(d_i) = 0 cannot have been drawn from q_i: that is a proposer bug, and
rejecting it quietly would bias the output, so it raises.

Seeded sampling (seeded_verify): Leviathan's rule consumes randomness in an order that depends on
the proposal, so the same seed would give a different output for every proposer and k. Instead
the target's token at context index j is fixed in advance as a deterministic function of p_j and
keys derived from (seed, j) alone (sampling.race: the exponential race, i.e. Gumbel-max), and
d_i is accepted iff it equals that token; the first mismatch emits the target's token. The output
is then exactly plain seeded decoding, whatever was proposed: exact (each token is a race draw
from p, with keys independent of everything before), and the same for every proposer and k. A
proposer that races its q against the same keys (sampling.draw) is accepted with probability
>= (1 - TV) / (1 + TV) against Leviathan's 1 - TV. Measured per drafted token, q's logits being
p's plus Gaussian noise (vocab 2,000, T = 0.7, 3,000 pairs each): 0.947 against 0.955 for a close
draft, 0.838 vs 0.865 and 0.691 vs 0.735 for weaker ones; on the scripted engine rig with penalties and top-k/top-p
(tests/unit/test_engine_distribution.py, k = 3) 0.71 vs 0.73. A point-mass proposer (ngram) loses
nothing: its token is kept with probability p(d) under either rule. So seeded requests use the
race (the seed promises reproducibility), unseeded ones keep Leviathan's rule (higher acceptance).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from homespec.speculation.sampling import race, sample


@dataclass(frozen=True)
class Verdict:
    accepted: int  # n: proposed tokens kept, 0 <= n <= k
    tokens: list[int]  # [n + 1] emitted: the accepted prefix, then the bonus token
    proposed: int  # k
    # Per proposed position: True accepted, False rejected; positions after the first rejection
    # were never tested and are absent, so len(outcomes) == min(k, n + 1).
    outcomes: list[bool] = field(default_factory=list)
    # [n + 1, vocab] the target's logits rows that chose `tokens` (set by the engine; logprobs
    # are read from them, so they cost no extra pass)
    rows: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def bonus(self) -> int:
        return self.tokens[-1]


def greedy_verify(proposed: Sequence[int], target_argmax: np.ndarray) -> Verdict:
    """proposed: [k]; target_argmax: [k + 1], the target's choice after each proposed prefix."""
    k = len(proposed)
    assert target_argmax.shape[0] == k + 1, (target_argmax.shape, k)
    n = 0
    while n < k and int(proposed[n]) == int(target_argmax[n]):
        n += 1
    outcomes = [True] * n + ([False] if n < k else [])
    return Verdict(n, [int(t) for t in proposed[:n]] + [int(target_argmax[n])], k, outcomes)


def rejection_verify(
    proposed: Sequence[int],
    p: np.ndarray,
    q: np.ndarray | None,
    rng: np.random.Generator,
) -> Verdict:
    """Speculative sampling.

    proposed: [k] token ids.
    p: [k + 1, vocab] target probabilities after each proposed prefix.
    q: [k, vocab] proposer probabilities the tokens were drawn from, or None for a deterministic
       proposer (q is then the point mass on each proposed token).
    """
    k = len(proposed)
    assert p.shape[0] == k + 1, (p.shape, k)
    out: list[int] = []
    outcomes: list[bool] = []
    for i, x in enumerate(int(t) for t in proposed):
        px = float(p[i, x])
        qx = 1.0 if q is None else float(q[i, x])
        if not qx > 0:  # x cannot have been drawn from q: any verdict would bias the output
            raise ValueError(f"proposed token {x} at position {i} has proposer probability q = {qx}")
        if rng.random() * qx < px:  # u < p/q without dividing
            out.append(x)
            outcomes.append(True)
            continue
        outcomes.append(False)
        out.append(sample(_residual(p[i], None if q is None else q[i], x), rng))
        return Verdict(i, out, k, outcomes)
    out.append(sample(p[k], rng))  # all accepted: bonus from the target after d_k
    return Verdict(k, out, k, outcomes)


def seeded_verify(proposed: Sequence[int], p: np.ndarray, keys: np.ndarray) -> Verdict:
    """Seeded sampling: the target's token at each row is race(p_i, keys_i), fixed before looking
    at the proposal; keep d_i while it equals that token (module docstring).

    proposed: [k]; p: [k + 1, vocab] target probabilities; keys: [k + 1, vocab] the race keys
    of the rows' context positions (sampling.position_keys).
    """
    assert p.shape[0] == keys.shape[0] == len(proposed) + 1, (p.shape, keys.shape, len(proposed))
    return greedy_verify(proposed, np.asarray([race(p[i], keys[i]) for i in range(p.shape[0])]))


def _residual(p: np.ndarray, q: np.ndarray | None, x: int) -> np.ndarray:
    """norm(max(0, p - q)) [vocab]; for a point mass q on x that is p with x removed."""
    if q is None:
        r = p.copy()
        r[x] = 0.0
    else:
        r = np.maximum(p - q, 0.0)
    s = r.sum()
    # s == 0 only if p <= q everywhere, i.e. p == q, where rejection has probability 0; floating
    # point can still land here, and p itself is then the right distribution.
    return r / s if s > 0 else p
