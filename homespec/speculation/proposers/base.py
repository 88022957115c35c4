"""The proposer role: one small protocol shared by draft, ngram and mtp.

A proposer sees the committed context (prompt + output so far, the last token not yet verified
by the target) and returns up to k guessed continuation tokens. It never decides what is
emitted: the verifier does. Its state (a KV cache, an index) follows the context it is shown;
`begin` lets it do the expensive part of catching up during prefill rather than in the first
step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from homespec.speculation.sampling import SamplingParams


@dataclass
class Proposal:
    tokens: list[int]  # [k'] proposed ids, k' <= k requested; empty = nothing worth proposing
    # [k', vocab] probabilities each token was drawn from, or None for a deterministic proposer
    # (a point mass on each token: ngram, or any proposer under greedy decoding).
    q: np.ndarray | None = None
    draft_s: float = 0.0  # seconds spent proposing
    # For the controller: e.g. the ngram match length; the draft's per-token confidence.
    info: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Proposer(Protocol):
    name: str

    def begin(self, prompt: Sequence[int]) -> None:
        """A new generation starts with this prompt: catch up (prefill) now."""

    def propose(
        self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        """Guess up to k tokens that follow `context`."""
        ...

    def close(self) -> None:
        """Free resources (a model) — the proposer is not used afterwards."""
