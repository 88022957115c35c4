"""Logits -> probabilities: the one transform that both the target and the proposer use.

Speculative sampling is exact only if the proposer's q and the target's p come from the same
transform of their logits (Leviathan et al., 2023, section 2.3). So everything that shapes a
distribution lives here, and the engine, the draft proposer and the verifier all call it:

    logits --logit_bias--> --penalties(recent tokens)--> --/temperature--> softmax
           --top_k--> --top_p--> --min_p--> [--infill-->] p

Order: the logit bias and the penalties first (they change logits; the bias first, as in
llama.cpp's sampler chain), then temperature, then the truncations on the tempered distribution
(the order of Hugging Face's `generate`). llama.cpp truncates before tempering, which differs
only when top_p/min_p and temperature are both set; a request may ask for that order
(`SamplingParams.order`, from llama.cpp's `samplers`). llama.cpp's infill sampler, which editor
plugins ask `/infill` for, is a step too, where the order puts it (infill_sampler.py). Each step
narrows the candidates; the draw is by a softmax of what is left of their logits.

The logit bias is OpenAI's: a number in [-100, 100] added to a token's logit; -100 bans the
token in practice, +100 all but forces it. Being part of `penalize`, it reaches the target's
rows, the first token and every proposer's q alike, so speculation stays exact with it.

Penalties look at the last `penalty_last_n` tokens of the context (prompt and output), as
llama.cpp does: repetition (CTRL-style, divides positive logits), presence (flat) and frequency
(per occurrence), the latter two with OpenAI's meaning.

Temperature 0 means greedy: the token is the argmax of the penalised logits; no probabilities
are formed.

Logprobs (`token_logprobs`): log softmax of the penalised logits — bias and penalties applied,
temperature and truncation not — i.e. the model's own log-probabilities, as OpenAI reports
them, under the request's bias and penalties.

Randomness. Unseeded, a request draws from its own generator (make_rng), in whatever order the
loop consumes it. Seeded, every draw at context position j is a pure function of (seed, j, p):
the race of p against that position's keys (position_keys, `draw`), so the token sampled at j
does not depend on how many draws came before it — which makes a seeded output the same for
every proposer and k (verify.py, seeded_verify).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from homespec.speculation.infill_sampler import InfillVocab, infill_keep

# Hugging Face's order (temperature, then the cuts on the tempered distribution); the infill
# cut, when a request binds a vocabulary, last.
DEFAULT_ORDER = ("temperature", "top_k", "top_p", "min_p", "infill")


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
    # OpenAI's logit_bias: (token id, bias) pairs, ids ascending; added to those logits.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # llama.cpp's infill sampler, over this vocabulary; None = not asked for. Bound to the
    # loaded target (serving/host.py, Host._params), as a request only names it.
    infill: InfillVocab | None = None
    # The order temperature and the cuts apply in (probabilities); one left out does nothing.
    # A request may name llama.cpp's (its `samplers`, serving/llama_options.py), which tempers
    # after the cuts.
    order: tuple[str, ...] = DEFAULT_ORDER

    def __post_init__(self) -> None:
        checks = [
            ("temperature", self.temperature >= 0),
            ("top_k", self.top_k >= 0),
            ("top_p", 0 <= self.top_p <= 1),  # 0: the likeliest token only (_top_p keeps one)
            ("min_p", 0 <= self.min_p <= 1),
            ("repetition_penalty", self.repetition_penalty > 0),
            ("penalty_last_n", self.penalty_last_n >= 0),
            ("logit_bias", all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias)),
            ("order", set(self.order) <= set(DEFAULT_ORDER) and len(set(self.order)) == len(self.order)),
            # greedy means the argmax only where temperature is a step (llama.cpp: temp 0 keeps it)
            ("temperature", "temperature" in self.order or self.temperature == 1.0),
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

    @property
    def shifts_logits(self) -> bool:
        """`penalize` may change the logits: a bias or a penalty is set (else it is the identity)."""
        return bool(self.logit_bias) or self.has_penalties


def with_logit_bias(params: SamplingParams, bias: Mapping[int, float] | None) -> SamplingParams:
    """params with OpenAI's logit_bias map ({token id: bias}) set; None or {} leaves none."""
    return replace(params, logit_bias=tuple(sorted((int(t), float(b)) for t, b in (bias or {}).items())))


def penalize(logits: np.ndarray, params: SamplingParams, recent: Sequence[int]) -> np.ndarray:
    """Add the logit bias, then apply the penalties for the tokens in `recent` (the window
    already cut). logits: [vocab]; returned unchanged (not copied) when there is nothing to do."""
    out = logits
    if params.logit_bias:
        out = _bias(logits, params.logit_bias)
    if not params.has_penalties or len(recent) == 0:
        return out
    ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)  # [m], [m]
    ids, counts = ids[ids < logits.shape[0]], counts[ids < logits.shape[0]]
    out = out.copy() if out is logits else out
    vals = out[ids]
    if params.repetition_penalty != 1.0:
        # CTRL (Keskar et al.): shrink towards "less likely" whatever the logit's sign.
        vals = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    vals = vals - params.presence_penalty - params.frequency_penalty * counts
    out[ids] = vals
    return out


def _bias(logits: np.ndarray, bias: tuple[tuple[int, float], ...]) -> np.ndarray:
    """logits [vocab] + the bias of each listed id; ids beyond this vocab (a draft with a few
    rows fewer than the target's) are skipped: the proposer pads those rows with -inf anyway."""
    ids = np.fromiter((t for t, _ in bias), dtype=np.int64, count=len(bias))  # [m]
    vals = np.fromiter((b for _, b in bias), dtype=np.float64, count=len(bias))  # [m]
    keep = ids < logits.shape[0]
    out = logits.copy()
    out[ids[keep]] += vals[keep].astype(out.dtype)
    return out


def window(context: Sequence[int], params: SamplingParams) -> Sequence[int]:
    """The tokens the penalties look at, from the end of the context."""
    n = params.penalty_last_n
    return context[-n:] if n > 0 else ()


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Penalised logits [vocab] -> the distribution to sample from, [vocab] float64, sums to 1.
    The steps run in params.order over the candidates still in the running; the draw is by a
    softmax of their (tempered) logits."""
    n = logits.shape[0]
    if params.greedy:
        p = np.zeros(n, dtype=np.float64)
        p[int(np.argmax(logits))] = 1.0
        return p
    ids: np.ndarray | None = None  # [m] the candidates' token ids; None: every token, in order
    z = logits.astype(np.float64)  # [m] their logits (a copy: the steps may work in place)
    for step in params.order:
        ids, z = _STEPS[step](ids, z, params)
    if ids is None:
        return _softmax(z)
    p = np.zeros(n, dtype=np.float64)
    p[ids] = _softmax(z)
    return p


def _softmax(z: np.ndarray) -> np.ndarray:
    w = z - z.max()  # [m]
    np.exp(w, out=w)
    w /= w.sum()
    return w


Candidates = tuple[np.ndarray | None, np.ndarray]  # ([m] token ids or None for all, [m] their logits)


def _kept(ids: np.ndarray | None, z: np.ndarray, keep: np.ndarray) -> Candidates:
    """The candidates at `keep` (positions into z, or a mask over it)."""
    return (np.flatnonzero(keep) if keep.dtype == bool else keep) if ids is None else ids[keep], z[keep]


def _temperature(ids: np.ndarray | None, z: np.ndarray, params: SamplingParams) -> Candidates:
    z /= params.temperature
    return ids, z


def _top_k(ids: np.ndarray | None, z: np.ndarray, params: SamplingParams) -> Candidates:
    k = params.top_k
    if k == 0 or k >= z.shape[0]:
        return ids, z
    return _kept(ids, z, z >= np.partition(z, -k)[-k])  # ties at the cut stay


def _top_p(ids: np.ndarray | None, z: np.ndarray, params: SamplingParams) -> Candidates:
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    if params.top_p >= 1.0:
        return ids, z
    p = _softmax(z)  # [m]
    # A full sort of 152k floats costs ~10 ms; the nucleus is almost always within the top few
    # hundred, so sort a growing candidate set and fall back to the full sort only if needed.
    n = p.shape[0]
    m = 256
    while True:
        m = min(m, n)
        idx = np.argpartition(p, n - m)[n - m :] if m < n else np.arange(n)  # [m] top-m positions
        idx = idx[np.argsort(-p[idx], kind="stable")]
        csum = np.cumsum(p[idx])
        if csum[-1] >= params.top_p - 1e-9 or m == n:
            # First index where the mass reaches top_p; the epsilon absorbs cumsum rounding
            # (0.5 + 0.3 < 0.8 in floating point). top_p 0 keeps the likeliest token.
            return _kept(ids, z, idx[: min(int(np.searchsorted(csum, params.top_p - 1e-9)) + 1, m)])
        m *= 8


def _min_p(ids: np.ndarray | None, z: np.ndarray, params: SamplingParams) -> Candidates:
    if params.min_p <= 0.0:
        return ids, z
    p = _softmax(z)  # [m]
    return _kept(ids, z, p >= params.min_p * p.max())


def _infill(ids: np.ndarray | None, z: np.ndarray, params: SamplingParams) -> Candidates:
    if params.infill is None:
        return ids, z
    cand = np.arange(z.shape[0]) if ids is None else ids  # [m]
    # Candidates a grammar or a bias already ruled out (-inf) are dead to llama.cpp's sampler:
    # they neither count nor merge (top_k keeps ties at a cut of -inf, all of them).
    live = np.isfinite(z)
    if not live.all():
        cand, z = cand[live], z[live]
    keep = infill_keep(cand, _softmax(z), params.infill)
    if keep is None:  # no text token left: the end of text, certain
        return np.array([params.infill.eot]), np.zeros(1)
    return cand[keep], z[keep]


_STEPS = {"temperature": _temperature, "top_k": _top_k, "top_p": _top_p, "min_p": _min_p, "infill": _infill}


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
    if params.greedy and not params.shifts_logits:  # the argmax of the raw rows is the answer
        return np.argmax(logits, axis=1)
    seq = list(context[-params.penalty_last_n :]) if params.has_penalties else []
    rows = []
    for i in range(n):
        z = penalize(logits[i], params, window(seq + list(continuation[:i]), params))
        rows.append(int(np.argmax(z)) if params.greedy else probabilities(z, params))
    return np.asarray(rows)


def argmax_gaps(logits: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
    """[n] float32: how far each greedy token's logit stands above the next best in its row.

    logits: [>= n, vocab], row i the raw (grammar-masked) row that chose tokens[i], its argmax;
    tokens: [n]. A gap within llama.cpp's batch noise (a row computed in a pass of other rows
    differs from the same row alone by up to ~0.4-0.8, median ~0.07 on the 2-core CPU) is a
    near-tie: asked again and verified in passes of other sizes, the answer can take the other
    token there. inf where the row allows nothing else (a grammar's forced token). ~20 µs a row
    at 152k vocab: the row is written to in place and restored (no copy)."""
    n = len(tokens)
    if not logits.flags.writeable:
        logits = logits[:n].copy()
    rows, cols = np.arange(n), np.asarray(tokens, dtype=np.int64)
    top = logits[rows, cols]  # [n] (fancy indexing: a copy)
    logits[rows, cols] = -np.inf
    try:
        second = logits[:n].max(axis=1)  # [n]
    finally:
        logits[rows, cols] = top
    with np.errstate(invalid="ignore"):
        gaps = (top - second).astype(np.float32)
    gaps[~np.isfinite(second)] = np.inf
    return gaps


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target (module docstring, "Logprobs")."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the `top` likeliest (id, logprob), likeliest first


def token_logprobs(
    rows: np.ndarray, params: SamplingParams, context: Sequence[int], tokens: Sequence[int], top: int
) -> list[TokenLogprob]:
    """The log-probabilities of `tokens` from the target's rows that chose them — no extra pass.

    rows: [n, vocab], row i scored after context + tokens[:i] (a step's verified rows, or the
    prefill's last row); tokens: [n]; top: alternatives to list per token (0: none).
    """
    out = []
    recent = list(window(context, params))
    for i, tok in enumerate(tokens):
        z = penalize(rows[i], params, window(recent + list(tokens[:i]), params)).astype(np.float64)  # [vocab]
        m = z.max()
        lp = z - (m + np.log(np.exp(z - m).sum()))  # log softmax, [vocab]
        alts: tuple[tuple[int, float], ...] = ()
        if top > 0:
            best = np.argpartition(-lp, top - 1)[:top] if top < lp.shape[0] else np.arange(lp.shape[0])
            best = best[np.argsort(-lp[best], kind="stable")]
            alts = tuple((int(t), float(lp[t])) for t in best)
        out.append(TokenLogprob(int(tok), float(lp[tok]), alts))
    return out


def make_rng(seed: int | None) -> np.random.Generator:
    """Per-request generator: a seed makes sampling reproducible, None draws fresh entropy."""
    return np.random.default_rng(seed)
