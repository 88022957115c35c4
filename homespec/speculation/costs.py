"""What the controller knows, measured: how long target passes and proposals take on this
machine (CostModel), how often proposed tokens are accepted at each draft position
(AcceptanceModel), and how often a remembered answer's token is given again at its argmax gap
(NearTieModel). All learn from every step; none decides anything.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence

import numpy as np


class CostModel:
    """Seconds for a target pass over n tokens, and for proposing, measured and updated.

    t_verify(n) = speed x shape[n]. The shape (how the cost grows with n) is calibrated at
    warm-up and refined slowly from live steps; `speed` follows the machine's current pace from
    every step, whatever its n (a home server also runs other things: when a backup makes every
    pass 2x slower, all n slow down together, including sizes the controller is not using now).
    It is an EWMA in log space, so one stalled step cannot swing it far. Proposer costs are
    stored at calibration pace and scaled the same way.
    """

    SPEED_EWMA = 0.2  # the pace adapts within ~5 steps

    def __init__(self, n_max: int, alpha: float) -> None:
        self.n_max = n_max  # largest pass measured: k_max + 1
        self.alpha = alpha  # EWMA weight for the shape and proposer costs
        self.shape = np.full(n_max + 1, np.nan)  # [n_max + 1] seconds at calibration pace, index n
        self.log_speed = 0.0  # log(current pace / calibration pace)
        self.propose_s: dict[str, float] = {}  # proposer -> seconds per proposed token (calibration pace)
        self.catchup_s: dict[str, float] = {}  # proposer -> seconds per token caught up (calibration pace)
        self._refresh()

    def _refresh(self) -> None:
        """Recompute what pricing reads after the shape or the pace changed: the controller prices
        ~15 candidates a step, and a numpy call per scalar cost ~10 µs each (a third of its step)."""
        self._speed = float(np.exp(self.log_speed))
        self._curve = self.shape * self._speed  # [n_max + 1] seconds per pass over n rows, now
        mean = (self.shape[self.n_max] - self.shape[1]) / (self.n_max - 1) if self.n_max > 1 else self.shape[1]
        self._row_s = float(max(mean, 0.05 * self.shape[1]) * self._speed)

    @property
    def speed(self) -> float:
        return self._speed

    @property
    def verify_s(self) -> np.ndarray:
        """[n_max + 1] current seconds per pass over n tokens (index 0 unused)."""
        return self.shape * self.speed

    def set_verify(self, samples: Mapping[int, float]) -> None:
        """Calibration: seconds per pass at measured sizes; the rest is interpolated, and past
        the largest extended by the mean cost of a row between the smallest and the largest."""
        ns = sorted(n for n in samples if 1 <= n <= self.n_max)
        ts = [samples[n] for n in ns]
        xs = np.arange(1, self.n_max + 1)
        self.shape[1:] = np.interp(xs, ns, ts)
        if len(ns) > 1:
            slope = max((ts[-1] - ts[0]) / (ns[-1] - ns[0]), 0.0)
            self.shape[1:] += np.maximum(xs - ns[-1], 0) * slope
        self.log_speed = 0.0
        self._refresh()

    def calibrated(self) -> bool:
        return not np.isnan(self.shape[1])

    def verify(self, n: int | np.ndarray) -> float | np.ndarray:
        """Seconds for a pass over n rows (n: an int, or an array of sizes priced at once); past
        n_max (several requests' rows in one pass), extended by the mean cost of a row (row_s):
        a CPU pass grows ~linearly there."""
        if isinstance(n, (int, np.integer)):
            n = max(int(n), 1)
            return float(self._curve[min(n, self.n_max)] + max(n - self.n_max, 0) * self._row_s)
        n = np.maximum(n, 1)
        return self._curve[np.minimum(n, self.n_max)] + np.maximum(n - self.n_max, 0) * self._row_s

    def row_s(self) -> float:
        """Seconds one more row adds to a pass, on average over the measured sizes (at least 5 %
        of a one-row pass: no device computes rows for free)."""
        return self._row_s

    def added(self, n: int | np.ndarray, alongside: int) -> float | np.ndarray:
        """Seconds that n rows of one request add to a pass that already holds `alongside` rows
        of others (a pass of their own when there are none): its first row's cost, then what
        the other n - 1 add to a pass holding it. Each part is kept at half an average row at
        least (noise, a flat GPU curve, or a tiled kernel whose 4th row costs less than its 3rd):
        rows are never free, but n of them may cost no more than one. Splitting it so keeps the
        price of a draft off the size without it, t(alongside), which beside others is the size
        the pass rarely has (requests decode together), so its estimate is the noisiest. n may
        be an array of sizes, priced at once."""
        if alongside <= 0:
            return self.verify(n)
        floor = 0.5 * self.row_s()
        first = max(self.verify(alongside + 1) - self.verify(alongside), floor)
        seconds = np.maximum(first + self.verify(alongside + n) - self.verify(alongside + 1), floor)
        return float(seconds) if seconds.ndim == 0 else seconds

    def observe_verify(self, n: int, seconds: float) -> None:
        if not (1 <= n <= self.n_max) or seconds <= 0:
            return
        if np.isnan(self.shape[n]):
            self.shape[n] = seconds / self.speed
        else:
            self.log_speed += self.SPEED_EWMA * (np.log(seconds / self.shape[n]) - self.log_speed)
            self._speed = float(np.exp(self.log_speed))
            if n > 1:  # shape[1] anchors the pace: otherwise shape and speed could trade the same drift
                self.shape[n] += self.alpha * (seconds / self.speed - self.shape[n])
        self._refresh()

    def propose(self, proposer: str, k: int | np.ndarray) -> float | np.ndarray:
        return self.propose_s.get(proposer, 0.0) * k * self.speed

    def observe_propose(self, proposer: str, k: int, seconds: float) -> None:
        if k > 0:
            _ewma(self.propose_s, proposer, seconds / k / self.speed, self.alpha)

    def catchup(self, proposer: str, tokens: int, base: int = 0) -> float:
        """Seconds that reading `tokens` missed tokens adds to the proposer's next pass, over one
        that reads `base` (a step's own lag, which its drafting cost already holds). By the token:
        the 0.5B Q4_0 draft's passes over 2-16 tokens cost ~3 ms a token more on a 2-core EPYC, as
        a 65-token batch does (2026-12-07, after cpu-q4_0-vnni)."""
        per = self.catchup_s.get(proposer, self.propose_s.get(proposer, 0.0))
        return per * max(tokens - base, 0) * self.speed

    def observe_catchup(self, proposer: str, tokens: int, seconds: float) -> None:
        if tokens > 0:
            _ewma(self.catchup_s, proposer, seconds / tokens / self.speed, self.alpha)


def _ewma(d: dict[str, float], key: str, x: float, alpha: float) -> None:
    old = d.get(key)
    d[key] = x if old is None else old + alpha * (x - old)


Key = Hashable  # what outcomes are grouped by: the controller's AcceptanceKey


class AcceptanceModel:
    """a_i per key (proposer, match bucket, ...): P(position i accepted | all before it accepted).

    Each position keeps the mean of its outcomes (a plain mean for the first 1/alpha
    observations, an EWMA afterwards, so it forgets an old workload). Decisions use a shrunk
    estimate: position i is pulled towards position i - 1 by SHRINK pseudo-observations, and
    position 1 towards the prior. A rarely tested deep position thus inherits its shallower
    neighbour's rate instead of a fixed prior, so k can grow when every drafted token passes —
    and one unlucky observation cannot pin k down.

    A pooled key (`pooled(key)`) fails by a chance that does not grow with depth (a greedy answer
    given again leaves the remembered one at a near-tie, wherever that falls; an edit leaves the
    prompt it copies wherever it changes something), so no position's rate falls below the key's
    rate over every position it tested. Per position alone, one failure at position 8 pinned a_8
    while the later drafts it kept short never tested position 8 again: after one chat answer
    asked again, every later repeat, code's too, was drafted 5 tokens at a time, each draft kept
    whole.
    """

    SHRINK = 2.0  # pseudo-observations pulling a position towards the one before it

    def __init__(
        self, k_max: int, alpha: float, prior: float | Callable[[Key], float], pooled: Callable[[Key], bool] = lambda key: False
    ) -> None:
        self.k_max, self.alpha = k_max, alpha
        self.prior = prior if callable(prior) else (lambda key: prior)
        self.pooled = pooled
        # pooled keys -> [accepted, tested] over their positions, each step's weight decaying by
        # alpha per later step (an EWMA of steps, as the positions' means are)
        self._pool: dict[Key, np.ndarray] = {}
        self._mean: dict[Key, np.ndarray] = {}  # key -> [k_max] observed acceptance
        self._n: dict[Key, np.ndarray] = {}  # key -> [k_max] observations
        # key -> [k_max] rates(key) until its next observation: the controller reads them several
        # times a step (choice, probe, view), and the shrinkage is a loop over k_max positions.
        self._rates: dict[Key, np.ndarray] = {}

    def _arrays(self, key: Key) -> tuple[np.ndarray, np.ndarray]:
        if key not in self._mean:
            self._mean[key] = np.zeros(self.k_max)
            self._n[key] = np.zeros(self.k_max, dtype=np.int64)
        return self._mean[key], self._n[key]

    def observations(self, key: Key) -> int:
        return int(self._n[key][0]) if key in self._n else 0

    def observe(self, key: Key, outcomes: Sequence[bool], alpha: float | None = None) -> None:
        mean, n = self._arrays(key)
        self._rates.pop(key, None)
        alpha = alpha or self.alpha
        tested = outcomes[: self.k_max]
        for i, ok in enumerate(tested):
            w = max(alpha, 1.0 / (n[i] + 1))
            mean[i] += w * (float(ok) - mean[i])
            n[i] += 1
        if self.pooled(key):
            pool = self._pool.setdefault(key, np.zeros(2))
            pool *= 1.0 - alpha
            pool += (sum(tested), len(tested))

    def rates(self, key: Key) -> np.ndarray:
        """[k_max] the shrunk conditional acceptance used for decisions (read-only)."""
        out = self._rates.get(key)
        if out is not None:
            return out
        mean, n = self._arrays(key)
        weight = np.minimum(n, 1.0 / self.alpha)  # an EWMA remembers ~1/alpha observations
        out = np.empty(self.k_max)
        prev = self.prior(key)
        for i in range(self.k_max):
            prev = out[i] = (weight[i] * mean[i] + self.SHRINK * prev) / (weight[i] + self.SHRINK)
        if self.pooled(key):
            accepted, tested = self._pool.get(key, (0.0, 0.0))
            np.maximum(out, (accepted + self.SHRINK * self.prior(key)) / (tested + self.SHRINK), out=out)
        out.flags.writeable = False
        self._rates[key] = out
        return out

    def expected_emitted(self, key: Key) -> np.ndarray:
        """[k_max + 1]: E[tokens emitted by a step] for k = 0..k_max."""
        return expected_emitted(self.rates(key))


class NearTieModel:
    """P(a greedy answer asked again gives a remembered token again | that token's argmax gap).

    The same prompt under the same shaping gets the same greedy answer, except where llama.cpp's
    batch noise flips a near-tie: a row computed in a pass of other rows differs from the same
    row alone (2-core EPYC, the bench's chat and code answers, 128 tokens verified in passes of
    65 rows against one-row decoding: |Δ gap| median 0.05-0.09, 90th percentile 0.12-0.28 logits).
    The remembered answer is then the context's own continuation, so a drafted token is rejected
    only at a flip, and whether it flips depends on its gap, not on its depth. Chat answers asked
    again broke at tokens 8-33 at gaps of 0.03-0.23, where AcceptanceModel's per-position rates,
    learned mostly on code repeats kept whole, drafted 64 tokens and lost most of a 65-row pass
    (~29 plain steps).

    Per bucket of gap (EDGES) a mean of outcomes (an EWMA past 1/alpha of them: flips are rare,
    so it remembers many), shrunk towards PRIOR by SHRINK pseudo-observations. PRIOR is what was
    measured on that EPYC, kept/seen over both measurements (the 65-row passes above, and the
    drafts of 3 chat and 3 code answers asked again in the bench's process): under 0.05 5/10,
    0.05-0.1 1/2, 0.1-0.2 39/40, 0.2-0.4 37/38, 0.4-0.8 75/75, 0.8 and over every one of ~900.
    Other machines, and exact mode (its batch-invariant passes flip nothing), learn their own.
    """

    EDGES = np.array([0.05, 0.1, 0.2, 0.4, 0.8])  # logits: bucket b holds EDGES[b-1] <= gap < EDGES[b]
    PRIOR = np.array([0.5, 0.75, 0.975, 0.975, 0.99, 1.0])  # [buckets] P(kept), measured (docstring)
    SHRINK = 10.0  # pseudo-observations of PRIOR: a rate near 0.975 needs tens of outcomes to move

    def __init__(self, alpha: float = 0.01) -> None:
        self.alpha = alpha
        self._mean = self.PRIOR.copy()  # [buckets] observed P(kept)
        self._n = np.zeros(len(self.PRIOR), dtype=np.int64)  # [buckets] observations
        self._keep = self.PRIOR.copy()  # [buckets] the shrunk estimate decisions read

    @classmethod
    def bucket(cls, gaps: np.ndarray | float) -> np.ndarray:
        """[len(gaps)] (or a scalar) each gap's bucket index: 0..len(EDGES), inf in the last."""
        return np.searchsorted(cls.EDGES, gaps, side="right")

    def keep(self, gaps: np.ndarray) -> np.ndarray:
        """[len(gaps)] P(each token is given again), read by bucket."""
        return self._keep[self.bucket(gaps)]

    def observe(self, gaps: np.ndarray, outcomes: Sequence[bool]) -> None:
        """A draft of remembered tokens (gaps [>= len(outcomes)]) verified: outcomes per tested position."""
        for b, ok in zip(self.bucket(gaps[: len(outcomes)]), outcomes, strict=True):
            w = max(self.alpha, 1.0 / (self._n[b] + 1))
            self._mean[b] += w * (float(ok) - self._mean[b])
            self._n[b] += 1
        weight = np.minimum(self._n, 1.0 / self.alpha)  # [buckets] an EWMA remembers ~1/alpha observations
        self._keep = (weight * self._mean + self.SHRINK * self.PRIOR) / (weight + self.SHRINK)


def ceiling(verify_s: Mapping[int, float], propose_s: float = 0.0) -> tuple[int, float]:
    """The most speculation can speed decoding up on a measured cost curve, and the k that gets
    it: every drafted token accepted, by a proposer costing propose_s seconds a token. verify_s:
    {n: seconds of a target pass over n tokens}. (k, max over measured n = k + 1 of
    (k + 1) t(1) / (t(k + 1) + k propose_s)); (0, 1.0) when no k beats plain decoding. Between
    measured sizes the controller interpolates linearly, and a ratio of linear functions peaks at
    an end, so the measured sizes are the candidates."""
    t1 = verify_s[1]
    best = (0, 1.0)
    for n in sorted(verify_s):
        k = n - 1
        gain = n * t1 / (verify_s[n] + k * propose_s) if k else 1.0
        if gain > best[1]:
            best = (k, gain)
    return best


def expected_emitted(rates: np.ndarray) -> np.ndarray:
    """Conditional acceptance a [k] -> E[emitted tokens] [k + 1] for k = 0..len(a):
    E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i (the bonus token plus each accepted prefix)."""
    return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(rates))])
