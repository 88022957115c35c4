"""What the engine and the proposers need of a model: the `Target` protocol, and the `Pass`
over it that they yield for a driver to run.

llama/runtime.py's `Runtime` implements it (so does the scripted fake in the unit tests); the
speculation core never imports it. A draft model is reached through the same protocol: it is a
target-shaped model that only proposes. The MTP head also reads the target's hidden states
(`HiddenStates`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np

Output = Literal["all", "last", "none"]  # which positions of a pass return logits


@runtime_checkable
class Target(Protocol):
    """One model, one KV-cache sequence, spoken to in token lists."""

    n_ctx: int  # tokens the KV cache holds at most
    n_vocab: int
    tokens: list[int]  # what the KV cache holds now, position by position

    def eval(self, tokens: Sequence[int], output: Output = "all") -> np.ndarray:
        """Append `tokens` to the cache; logits [n_out, vocab] (n_out: all, 1 or 0)."""
        ...

    def sync(self, context: Sequence[int], output: Output = "last") -> np.ndarray:
        """Make the cache hold `context`, reusing the cached prefix; logits after it."""
        ...

    def truncate(self, n: int) -> None:
        """Keep the first n positions of the cache."""
        ...

    def reset(self) -> None: ...

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes a token decodes to (text is assembled from these)."""
        ...

    def is_eog(self, token: int) -> bool:
        """End of generation (EOS, EOT, ...)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class HiddenStates(Target, Protocol):
    """A target that keeps the final hidden states of its last positions (for the MTP head)."""

    n_embd: int

    @property
    def hidden_start(self) -> int:
        """First position whose hidden state is kept (len(tokens) when none is)."""
        ...

    def hidden_rows(self, start: int, stop: int) -> np.ndarray:
        """Hidden states of positions [start, stop): [stop - start, n_embd] float32."""
        ...


@dataclass
class Pass:
    """A target pass a generation needs: append `tokens` to `target`'s cache, reply with the
    logits (Target.eval). The engine yields it rather than running it, so that a batch driver
    (batch.py) can pack the passes of several generations into one llama_decode."""

    target: Target
    tokens: list[int]
    output: Output
    rows: int = 0  # set by the driver: rows of the llama_decode that ran it (others' included)
    seconds: float = 0.0  # set by the driver: how long that decode took
    timed: bool = True  # set by the driver: False when that decode also read prompt chunks
    # A proposer's pass (a draft model's), not the target's: a driver runs it before the target
    # pass, beside the passes of other requests' proposers that name the same `together`
    # (Runtime.eval_many of the draft's context; None: alone).
    draft: bool = False
    together: Callable[[Sequence[tuple[Target, Sequence[int], Output]]], list[np.ndarray]] | None = None
    verify_rows: int = 0  # a proposer's pass: the rows of the verify pass it drafts for, at most

    def run(self) -> np.ndarray:
        t0 = time.perf_counter()
        logits = self.target.eval(self.tokens, self.output)
        self.rows, self.seconds = len(self.tokens), time.perf_counter() - t0
        return logits
