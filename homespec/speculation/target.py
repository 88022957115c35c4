"""What the engine and the proposers need of a model: the `Target` protocol.

llama/runtime.py's `Runtime` implements it (so does the scripted fake in the unit tests); the
speculation core never imports it. A draft model is reached through the same protocol: it is a
target-shaped model that only proposes. The MTP head also reads the target's hidden states
(`HiddenStates`).
"""

from __future__ import annotations

from collections.abc import Sequence
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
