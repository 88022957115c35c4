"""Logits -> probabilities: the one transform that both the target and the proposer use.

Speculative sampling is exact only if the proposer's q and the target's p come from the same
transform of their logits (Leviathan et al., 2023, section 2.3). So everything that shapes a
distribution lives here, and the engine, the draft proposer and the verifier all call it:

    logits --penalties(recent tokens)--> --/temperature--> softmax --top_k--> --top_p--> --min_p--> p

Order: penalties first (they change logits), then temperature, then the truncations on the
tempered distribution (the order of Hugging Face's `generate`; llama.cpp truncates before
tempering, which differs only when top_p/min_p and temperature are both set).

Penalties look at the last `penalty_last_n` tokens of the context (prompt and output), as
llama.cpp does: repetition (CTRL-style, divides positive logits), presence (flat) and frequency
(per occurrence), the latter two with OpenAI's meaning.

Temperature 0 means greedy: the token is the argmax of the penalised logits; no probabilities
are formed.

Randomness. Unseeded, a request draws from its own generator (make_rng), in whatever order the
loop consumes it. Seeded, every draw at context position j is a pure function of (seed, j, p):
the race of p against that position's keys (position_keys, `draw`), so the token sampled at j
does not depend on how many draws came before it — which makes a seeded output the same for
every proposer and k (verify.py, seeded_verify).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # llama.cpp's default window for penalties: recent enough to stop loops, short enough not to
    # punish a code file for reusing its own identifiers.
    penalty_last_n: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            ("temperature", self.temperature >= 0),
            ("top_k", self.top_k >= 0),
            ("top_p", 0 < self.top_p <= 1),
            ("min_p", 0 <= self.min_p <= 1),
            ("repetition_penalty", self.repetition_penalty > 0),
            ("penalty_last_n", self.penalty_last_n >= 0),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"{name} out of range: {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.penalty_last_n > 0 and (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )


def penalize(logits: np.ndarray, params: SamplingParams, recent: Sequence[int]) -> np.ndarray:
    """Apply the penalties for the tokens in `recent` (the window already cut). logits: [vocab]."""
    if not params.has_penalties or len(recent) == 0:
        return logits
    ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)  # [m], [m]
    ids, counts = ids[ids < logits.shape[0]], counts[ids < logits.shape[0]]
    out = logits.copy()
    vals = out[ids]
    if params.repetition_penalty != 1.0:
        # CTRL (Keskar et al.): shrink towards "less likely" whatever the logit's sign.
        vals = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    vals = vals - params.presence_penalty - params.frequency_penalty * counts
    out[ids] = vals
    return out


def window(context: Sequence[int], params: SamplingParams) -> Sequence[int]:
    """The tokens the penalties look at, from the end of the context."""
    n = params.penalty_last_n
    return context[-n:] if n > 0 else ()


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Penalised logits [vocab] -> the distribution to sample from, [vocab] float64, sums to 1."""
    if params.greedy:
        p = np.zeros(logits.shape[0], dtype=np.float64)
        p[int(np.argmax(logits))] = 1.0
        return p
    z = logits.astype(np.float64) / params.temperature  # [vocab]
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if params.top_k and params.top_k < p.shape[0]:
        cut = np.partition(p, -params.top_k)[-params.top_k]
        p = np.where(p >= cut, p, 0.0)
        p /= p.sum()
    if params.top_p < 1.0:
        p = _top_p(p, params.top_p)
    if params.min_p > 0.0:
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def _top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches top_p. p: [vocab]."""
    # A full sort of 152k floats costs ~10 ms; the nucleus is almost always within the top few
    # hundred, so sort a growing candidate set and fall back to the full sort only if needed.
    n = p.shape[0]
    m = 256
    while True:
        m = min(m, n)
        idx = np.argpartition(p, n - m)[n - m :] if m < n else np.arange(n)  # [m] top-m ids
        idx = idx[np.argsort(-p[idx], kind="stable")]
        csum = np.cumsum(p[idx])
        if csum[-1] >= top_p - 1e-9 or m == n:
            # First index where the mass reaches top_p; the epsilon absorbs cumsum rounding
            # (0.5 + 0.3 < 0.8 in floating point).
            last = int(np.searchsorted(csum, top_p - 1e-9))
            keep = idx[: min(last + 1, m)]
            out = np.zeros_like(p)
            out[keep] = p[keep]
            return out / out.sum()
        m *= 8


def choose(
    logits: np.ndarray,
    params: SamplingParams,
    recent: Sequence[int],
    rng: np.random.Generator,
    position: int | None = None,
) -> int:
    """One token from raw logits [vocab]: the plain-decoding path (and the first token).
    position: the token's index in the context (needed by a seeded request, see `draw`)."""
    z = penalize(logits, params, recent)
    if params.greedy:
        return int(np.argmax(z))
    return draw(probabilities(z, params), params, rng, position)


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a distribution p [vocab] (inverse CDF; exact for float64 p)."""
    c = np.cumsum(p)
    i = int(np.searchsorted(c, rng.random() * c[-1], side="right"))
    # u * c[-1] can round up to c[-1] (u within 2^-53 of 1): then take the last token with mass,
    # never a zero-probability tail token that a verifier would have to refuse.
    return i if i < p.shape[0] else int(np.flatnonzero(p)[-1])


def draw(p: np.ndarray, params: SamplingParams, rng: np.random.Generator, position: int | None) -> int:
    """One token from p [vocab] at context index `position`: seeded, the race against that
    position's keys (a pure function of seed, position and p); unseeded, from rng."""
    if params.seed is None:
        return sample(p, rng)
    if position is None:
        raise ValueError("a seeded draw needs the token's position")
    return race(p, position_keys(params.seed, position, p.shape[0]))


def race(p: np.ndarray, keys: np.ndarray) -> int:
    """The exponential race (Gumbel-max): argmax_v p_v / E_v with E_v ~ Exp(1) i.i.d. is a draw
    from p, exactly. p, keys: [vocab]. Two distributions raced against the same keys pick the
    same token with probability >= (1 - TV) / (1 + TV) (Daliri et al. 2024, "Coupling without
    communication"): a draft that races q against the target's keys is accepted often."""
    s = np.flatnonzero(p)  # [m] the support: tokens outside it can never win
    with np.errstate(divide="ignore"):  # E = 0 (probability 2^-53): that token wins, as it should
        return int(s[np.argmax(p[s] / keys[s])])


@lru_cache(maxsize=20)  # a step's positions (draft and target share them): ~24 MiB at 152k vocab
def position_keys(seed: int, position: int, vocab: int) -> np.ndarray:
    """The race keys of context index `position` for a seeded request: [vocab] Exp(1), i.i.d.
    across tokens and positions. Counter-based (Philox keyed by the seed, the position in the
    counter's second word, so no two positions' streams overlap): any position's keys come
    without drawing the ones before it. Uniforms (not numpy's ziggurat exponentials) keep the
    stream the same across numpy versions."""
    bits = np.random.Philox(key=seed % 2**128, counter=[0, position, 0, 0])
    u = np.random.Generator(bits).random(vocab)  # [vocab] in [0, 1)
    keys = -np.log1p(-u)  # [vocab] Exp(1)
    keys.flags.writeable = False  # shared through the cache
    return keys


def target_view(
    logits: np.ndarray, params: SamplingParams, context: Sequence[int], continuation: Sequence[int]
) -> np.ndarray:
    """What the verifier needs from the target's logits over one step.

    logits: [n, vocab], row i scored after context + continuation[:i] (n = len(continuation) + 1).
    Returns argmax ids [n] when greedy, else probabilities [n, vocab]. Row i is only ever used if
    continuation[:i] was accepted, so its penalties may assume it was.
    """
    n = logits.shape[0]
    if params.greedy and not params.has_penalties:
        return np.argmax(logits, axis=1)
    seq = list(context[-params.penalty_last_n :]) if params.has_penalties else []
    rows = []
    for i in range(n):
        z = penalize(logits[i], params, window(seq + list(continuation[:i]), params))
        rows.append(int(np.argmax(z)) if params.greedy else probabilities(z, params))
    return np.asarray(rows)


def make_rng(seed: int | None) -> np.random.Generator:
    """Per-request generator: a seed makes sampling reproducible, None draws fresh entropy."""
    return np.random.default_rng(seed)
