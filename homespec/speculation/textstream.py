"""Tokens -> text deltas that are safe to show, with stop strings.

Two things make streaming text from tokens subtle:
- a token can end in the middle of a UTF-8 character (emoji, CJK): hold those bytes until the
  character is complete;
- a stop string can span tokens, and a speculative step emits several tokens at once: text that
  could still turn out to be the start of a stop string is held back until it cannot, and
  nothing at or after a stop string is ever emitted.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


class TextStream:
    """Feed tokens one at a time; get back the text that may be shown now."""

    def __init__(self, piece: Callable[[int], bytes], stop: Sequence[str] = ()) -> None:
        self._piece = piece
        self._stop = [s for s in stop if s]
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded text not yet emitted (could begin a stop string)
        self.stopped = False  # a stop string was found; push() returns "" from now on
        self.stop_matched: str | None = None
        self.decoded = 0  # characters decoded so far, shown or held (a token's text ends here)

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        new = self._decoder.decode(self._piece(token))
        self.decoded += len(new)
        text = self._held + new
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            self._held = ""
            return text[:cut]
        keep = self._holdback(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """End of generation without a stop string: release what was held back."""
        if self.stopped:
            return ""
        text = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return text

    def _first_stop(self, text: str) -> int | None:
        hits = [(i, s) for s in self._stop if (i := text.find(s)) >= 0]
        if not hits:
            return None
        i, s = min(hits)
        self.stop_matched = s
        return i

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
