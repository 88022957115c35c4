"""One mapping that holds the prefix cache's whole budget, from load on, cut into KV-state buffers.

Why not a fresh mapping per saved state: on the 2-core Xeon VMs we run on, memory the process
touches for the first time can fault in at ~2.7-3 ms a MiB (past the first ~1.5 GB; the host
backing guest pages, as far as we can tell), so saving a 34 MiB history into new pages took
68-114 ms, against ~5 ms into pages written before. Mappings freed and mapped again, populated
(MAP_POPULATE) or in 4 KiB pages were as slow; only memory held from the start was not. The arena
is touched once at warm-up (`touch`), and the cache's saves then reuse those pages for as long as
the daemon runs.

Blocks are handed out best-fit and freed blocks merge with free neighbours, so a conversation
saved again, a little longer, fits where its older save was.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import time

ALIGN = 64  # bytes: block sizes and offsets are multiples of a cache line
_HUGE_PAGE = 2 << 20  # bytes


def block_size(size: int) -> int:
    """Bytes a block for `size` bytes of state takes."""
    return max(ALIGN, -(-size // ALIGN) * ALIGN)


class StateArena:
    def __init__(self, capacity: int) -> None:
        """capacity: bytes (rounded up to a huge page). Nothing is resident until touched."""
        if capacity <= 0:
            raise ValueError(f"StateArena: capacity must be positive, got {capacity}")
        self.capacity = -(-capacity // _HUGE_PAGE) * _HUGE_PAGE  # bytes
        self._map = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(AttributeError, OSError):  # (no THP: 4 KiB pages)
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self._view = memoryview(self._map)
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, size) in bytes, by offset
        self._used: dict[int, tuple[int, int, memoryview]] = {}  # id(block) -> (offset, size, block)

    def touch(self) -> float:
        """Write every free page once, so that no save pays for first-touch faults; returns
        seconds. In 16 MiB strides from one zeroed buffer."""
        t0 = time.perf_counter()
        stride = 16 << 20  # bytes
        zeros = bytes(stride)
        for start, size in self._free:
            for off in range(start, start + size, stride):
                n = min(stride, start + size - off)
                self._view[off : off + n] = zeros[:n]
        return time.perf_counter() - t0

    def alloc(self, size: int) -> memoryview | None:
        """A writable block of at least `size` bytes (rounded up to ALIGN), or None if no free
        run is that long. Best fit: the shortest free run that holds it."""
        need = block_size(size)  # bytes
        fits = [i for i, (_, n) in enumerate(self._free) if n >= need]
        if not fits:
            return None
        i = min(fits, key=lambda j: self._free[j][1])
        off, n = self._free[i]
        if n == need:
            del self._free[i]
        else:
            self._free[i] = (off + need, n - need)
        block = self._view[off : off + need]
        self._used[id(block)] = (off, need, block)
        return block

    def owns(self, block: object) -> bool:
        return id(block) in self._used

    def offset(self, block: memoryview) -> int:
        return self._used[id(block)][0]  # bytes from the arena's start

    def free(self, block: memoryview) -> None:
        """Give a block back; it merges with the free runs on either side."""
        off, size, _ = self._used.pop(id(block))
        i = bisect.bisect(self._free, (off, size))
        if i < len(self._free) and self._free[i][0] == off + size:  # merge with the run after
            size += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == off:  # and with the run before
            off, size = self._free[i - 1][0], self._free[i - 1][1] + size
            self._free[i - 1] = (off, size)
        else:
            self._free.insert(i, (off, size))

    @property
    def used(self) -> int:
        return sum(size for _, size, _ in self._used.values())  # bytes

    @property
    def largest_free(self) -> int:
        return max((n for _, n in self._free), default=0)  # bytes
