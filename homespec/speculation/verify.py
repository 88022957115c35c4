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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from homespec.speculation.sampling import sample


@dataclass(frozen=True)
class Verdict:
    accepted: int  # n: proposed tokens kept, 0 <= n <= k
    tokens: list[int]  # [n + 1] emitted: the accepted prefix, then the bonus token
    proposed: int  # k
    # Per proposed position: True accepted, False rejected; positions after the first rejection
    # were never tested and are absent, so len(outcomes) == min(k, n + 1).
    outcomes: list[bool] = field(default_factory=list)

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
        # qx > 0 whenever x was drawn from q; a zero here means a caller bug, so reject safely.
        if qx > 0 and rng.random() * qx < px:  # u < p/q without dividing
            out.append(x)
            outcomes.append(True)
            continue
        outcomes.append(False)
        out.append(sample(_residual(p[i], None if q is None else q[i], x), rng))
        return Verdict(i, out, k, outcomes)
    out.append(sample(p[k], rng))  # all accepted: bonus from the target after d_k
    return Verdict(k, out, k, outcomes)


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
