"""Saved KV caches of earlier conversations, so switching between them skips the prefill.

The live KV cache already serves the common case — the same conversation, one turn longer —
through `Runtime.sync`, which keeps the longest common prefix. This cache adds memory of *other*
conversations: before a request would truncate away a long cached history that it does not
share, that history's KV state is saved (llama_state_seq_get_data); a later request that shares
more with a saved state than with the live cache restores it. Entries are evicted least recently
used within a byte budget (memory.prefix_cache_mib, which the load plan counts); the states live
in one arena of that size, held and touched from load on (state_arena.py says why). With several
KV sequences (requests decoding together), a prefix another sequence holds is borrowed instead
(Slot.share_prefix: free in a unified KV buffer, a copy of its cells with a stream per slot).

Only the target's cache is saved: it is what prefill time is spent on. A draft model, when one is
in use, catches up on its own (cheaper) after a switch.

Output does not depend on what was cached: a restored state holds the same keys and values the
prefill computed; only llama.cpp's batch-composition noise differs from a cold prefill (the
near-tie rule in DESIGN.md).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from homespec.llama.state_arena import StateArena, block_size
from homespec.tokens import common_prefix

if TYPE_CHECKING:
    from homespec.llama.runtime import KvState, StateBuffer

log = logging.getLogger("homespec.llama.prefix_cache")


class _StatefulRuntime(Protocol):
    tokens: list[int]

    def save_state(self, into: StateBuffer | None = None) -> KvState: ...

    def load_state(self, state: KvState, tokens: Sequence[int]) -> None: ...

    def state_size(self) -> int: ...  # bytes save_state would write now

    # src: another sequence of the same context; a copy (unless shares_cells) goes through scratch
    def share_prefix(self, src: Any, n: int, scratch: StateBuffer | None = None) -> None: ...

    @property
    def shares_cells(self) -> bool: ...  # share_prefix borrows cells, no copy


@dataclass
class _Entry:
    tokens: list[int]  # what the saved cache holds, position i = tokens[i]
    state: KvState

    @property
    def nbytes(self) -> int:
        return _entry_bytes(self.state.nbytes, len(self.tokens))


def _entry_bytes(state: int, tokens: int) -> int:
    """Bytes an entry holds: its state's buffer and its token list (4 bytes a token)."""
    return state + 4 * tokens


class PrefixCache:
    def __init__(self, budget_bytes: int, min_tokens: int = 16) -> None:
        self.budget = budget_bytes  # bytes
        # A history is saved (whole) when a request would throw away at least this many of its
        # tokens. Fewer are not worth an entry; the cost of saving is no reason for more: the
        # 1.5B target's 16-token state (449 KiB) saved in 1.7 ms and loaded in 0.9 ms, where
        # reading those 16 tokens again took ~500 ms on 2 cores (128 tokens: 10 and 4 ms). A
        # voice command's history (template and "Turn on the") is short, and its reuse is half
        # its TTFT.
        self.min_tokens = min_tokens  # tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # LRU order, oldest first
        # Every saved state lives in the arena: memory held from load on (see state_arena).
        self._arena = StateArena(budget_bytes) if budget_bytes > 0 else None
        self._next_id = 0
        self.restores = 0
        self.saves = 0
        self.shares = 0  # prefixes lent by another sequence

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def touch(self) -> float:
        """Fault the budget's memory in now (at warm-up), not during a request's save; seconds."""
        return self._arena.touch() if self._arena is not None else 0.0

    def prepare(self, rt: _StatefulRuntime, prompt: Sequence[int], peers: Sequence[_StatefulRuntime] = ()) -> int:
        """Put the best cached history for `prompt` into rt's KV cache; return the shared prefix.

        peers: the other sequences of rt's context, running or idle. One that shares more of the
        prompt than the live cache and every saved state lends its prefix (share_prefix: a copy
        of its cells across streams, free in a unified cache). Requests of different apps share
        the chat template's system prompt, and a voice command beside three long answers then
        reads only its own words.

        After this, rt.sync(prompt) re-evaluates only what follows the returned length.
        """
        live = common_prefix(rt.tokens, prompt)
        best_id, best_len = None, live
        for eid, e in self._entries.items():
            n = common_prefix(e.tokens, prompt)
            if n > best_len:
                best_id, best_len = eid, n
        lender, lent = None, live
        for peer in peers:
            n = common_prefix(peer.tokens, prompt) if peer is not rt else 0
            if n > lent:
                lender, lent = peer, n
        if lender is not None and lent >= best_len:  # a tie with a saved state: sharing is free
            self._save_live(rt, keep=live)
            # (a copy only with a stream per sequence: else no block, and no history evicted for one)
            scratch = None if rt.shares_cells else self._alloc(lender.state_size())
            rt.share_prefix(lender, lent, scratch=scratch)
            self._release(scratch)
            self.shares += 1
            log.debug("shared %d tokens of the prompt with another sequence", lent)
            return lent
        # Out of the LRU order while the live cache is saved, so that no eviction frees its block.
        entry = self._entries.pop(best_id) if best_id is not None else None
        self._save_live(rt, keep=live, held=entry.nbytes if entry is not None else 0)
        if entry is None:
            return live
        try:
            rt.load_state(entry.state, entry.tokens)
        except RuntimeError as e:  # llama.cpp refused it (a state read from disk): read the prompt instead
            log.warning("a saved cache of %d tokens was refused and dropped: %s", len(entry.tokens), e)
            self._release(entry.state.buf)
            return 0
        if len(entry.tokens) - best_len < self.min_tokens:
            self._release(entry.state.buf)  # the slot takes it over (and saves it again, grown, when it leaves)
        else:
            # It lends only its prefix (a system prompt, an earlier turn): its own history
            # stays saved for its return, as a peer's does (the state bytes are shared, not copied).
            self._entries[best_id] = entry  # most recently used
            self._fit()
        self.restores += 1
        log.debug("restored a saved cache of %d tokens (%d shared with the prompt)", len(entry.tokens), best_len)
        return best_len

    def saved(self) -> list[tuple[list[int], memoryview]]:
        """The saved histories, least recently used first: (tokens, state bytes), for the disk
        (prefix_store.save); the views are valid until the cache changes."""
        return [(e.tokens, memoryview(e.state.buf)[: e.state.size]) for e in self._entries.values()]

    def newest(self) -> tuple[list[int], KvState] | None:
        """The most recently used history (tokens, state), or None."""
        if not self._entries:
            return None
        e = next(reversed(self._entries.values()))
        return e.tokens, e.state

    def adopt(self, tokens: Sequence[int], size: int, fill: Callable[[StateBuffer], None]) -> bool:
        """Take in a history read back from disk, as the most recently used: `fill` writes its
        state (`size` bytes) into a block of the arena. False where it does not fit the budget
        (older ones are evicted for it, as for any save)."""
        from homespec.llama.runtime import KvState  # (llama_cpp only where states are real)

        if self._arena is None or _entry_bytes(block_size(size), len(tokens)) > self.budget:
            return False
        block = self._alloc(size)
        if block is None:
            return False
        try:
            fill(block)
        except BaseException:
            self._release(block)
            raise
        self._entries[self._next_id] = _Entry(list(tokens), KvState(block, size))
        self._next_id += 1
        self._fit()
        return True

    def stash(self, rt: _StatefulRuntime) -> None:
        """Save rt's cache (if long enough) before the caller empties it."""
        self._save_live(rt, keep=0)

    def _save_live(self, rt: _StatefulRuntime, keep: int, held: int = 0) -> None:
        """Save the live cache if the coming request would throw away much of it. held: bytes
        of an entry taken out of the cache for the moment (see prepare)."""
        if len(rt.tokens) - keep < self.min_tokens or self.budget <= 0:
            return
        tokens = list(rt.tokens)
        size = rt.state_size()  # bytes
        room = _entry_bytes(block_size(size), len(tokens))  # bytes
        if room > self.budget:
            return
        # An older save of the same conversation (a prefix of this one) is superseded.
        for eid in [i for i, e in self._entries.items() if common_prefix(e.tokens, tokens) == len(e.tokens)]:
            self._release(self._entries.pop(eid).state.buf)
        while self._entries and self.bytes + held + room > self.budget:
            self._evict()
        entry = _Entry(tokens, rt.save_state(into=self._alloc(size)))
        self._entries[self._next_id] = entry
        self._next_id += 1
        self.saves += 1
        self._fit()  # (a buffer from the runtime, when the arena had no room, may be larger)

    def _alloc(self, size: int) -> StateBuffer | None:
        """An arena block for a state of `size` bytes, evicting the least recently used
        histories while no free run is long enough. None (the runtime then maps a fresh
        buffer) only without an arena or for a state longer than it."""
        if self._arena is None or size > self._arena.capacity:
            return None
        while (block := self._arena.alloc(size)) is None and self._entries:
            self._evict()
        return block

    def _release(self, buf: StateBuffer | None) -> None:
        if buf is not None and self._arena is not None and self._arena.owns(buf):
            self._arena.free(buf)

    def _evict(self) -> None:
        self._release(self._entries.popitem(last=False)[1].state.buf)

    def _fit(self) -> None:
        """Within the budget: the least recently used histories go first."""
        while self.bytes > self.budget and self._entries:
            self._evict()

    def clear(self) -> None:
        while self._entries:
            self._evict()

