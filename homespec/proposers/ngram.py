"""Prompt lookup: propose what followed the last time the context's suffix occurred.

No model. For each n from n_max down to n_min, look up the context's last n tokens in an index
of earlier n-grams; on a hit propose the (up to k) tokens that followed that earlier occurrence.
Longer matches are more specific, so they win. This pays off when the output copies from the
prompt (editing code, quoting, summarising with names) and costs ~nothing when it misses.

The index maps each n-gram to the latest position where it started *and had a follower*, and is
extended incrementally as the context grows; a context that is not an extension of the indexed
one (a new request) rebuilds it. Memory: n_max dict entries per context token.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from homespec.proposers.base import Proposal
from homespec.sampling import SamplingParams


class NgramIndex:
    def __init__(self, n_min: int = 2, n_max: int = 5) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        # tables[n]: n-gram -> start index of its latest occurrence that has a following token
        self._tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}

    def sync(self, context: Sequence[int]) -> None:
        """Make the index cover `context` (extend if it grew, rebuild if it changed)."""
        m = len(self.tokens)
        if len(context) < m or list(context[:m]) != self.tokens:
            self.tokens = []
            for t in self._tables.values():
                t.clear()
            m = 0
        for tok in context[m:]:
            self._append(int(tok))

    def _append(self, tok: int) -> None:
        toks = self.tokens
        toks.append(tok)
        end = len(toks) - 1  # the new token follows every n-gram ending just before it
        for n, table in self._tables.items():
            if end - n >= 0:
                table[tuple(toks[end - n : end])] = end - n

    def lookup(self, k: int) -> tuple[list[int], int]:
        """(continuation [<= k], match length n); ([], 0) when no suffix occurred before."""
        toks = self.tokens
        for n in range(min(self.n_max, len(toks) - 1), self.n_min - 1, -1):
            start = self._tables[n].get(tuple(toks[len(toks) - n :]))
            if start is not None:
                return toks[start + n : start + n + k], n
        return [], 0


class NgramProposer:
    """Deterministic proposer: q is a point mass, so `Proposal.q` is None."""

    name = "ngram"

    def __init__(self, n_min: int = 2, n_max: int = 5) -> None:
        self.index = NgramIndex(n_min, n_max)

    def begin(self, prompt: Sequence[int]) -> None:
        self.index.sync(prompt)

    def match(self, context: Sequence[int], k: int) -> tuple[list[int], int]:
        """The proposal and its match length, without timing: the controller peeks with this."""
        self.index.sync(context)
        return self.index.lookup(k)

    def propose(
        self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        t0 = time.perf_counter()
        tokens, n = self.match(context, k)
        return Proposal(tokens, None, time.perf_counter() - t0, {"match_len": float(n)})

    def close(self) -> None:
        self.index = NgramIndex(self.index.n_min, self.index.n_max)
