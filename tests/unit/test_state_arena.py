"""The prefix cache's arena: best-fit blocks of one mapping, merged again when freed."""

from __future__ import annotations

import ctypes

import pytest

from homespec.llama.state_arena import ALIGN, StateArena, block_size

MiB = 1 << 20


def test_blocks_are_rounded_to_whole_cache_lines_and_the_capacity_to_a_huge_page():
    arena = StateArena(3 * MiB)
    assert arena.capacity == 4 * MiB
    assert len(arena.alloc(1)) == ALIGN == block_size(1)
    assert len(arena.alloc(ALIGN + 1)) == 2 * ALIGN


def test_a_block_takes_the_shortest_free_run_that_holds_it():
    arena = StateArena(2 * MiB)
    a, b, c, d = (arena.alloc(n) for n in (256 << 10, 64 << 10, 128 << 10, 64 << 10))
    arena.free(a)  # a free run of 256 KiB at the start
    arena.free(c)  # and one of 128 KiB between b and d
    e = arena.alloc(100 << 10)
    assert arena.offset(e) == (256 + 64) << 10  # c's run, not a's
    assert arena.largest_free == arena.capacity - ((256 + 64 + 128 + 64) << 10)  # the tail after d


def test_freed_neighbours_merge_into_one_run_that_a_longer_block_fits():
    arena = StateArena(2 * MiB)
    blocks = [arena.alloc(512 << 10) for _ in range(4)]  # the whole arena
    assert arena.alloc(1) is None
    arena.free(blocks[1])
    arena.free(blocks[3])
    assert arena.alloc(1 << 20) is None  # 1 MiB free, in two runs apart
    arena.free(blocks[2])  # joins both
    big = arena.alloc(3 * (512 << 10))
    assert big is not None and arena.offset(big) == 512 << 10
    arena.free(blocks[0])
    arena.free(big)
    assert arena.used == 0 and arena.largest_free == arena.capacity


def test_blocks_are_separate_writable_memory_llama_cpp_can_write_into():
    arena = StateArena(2 * MiB)
    a, b = arena.alloc(100_000), arena.alloc(100_000)
    ctypes.memset((ctypes.c_uint8 * 100_000).from_buffer(a), 7, 100_000)  # as llama_state_seq_get_data writes
    ctypes.memset((ctypes.c_uint8 * 100_000).from_buffer(b), 9, 100_000)
    assert bytes(a[:100_000]) == b"\x07" * 100_000 and bytes(b[:100_000]) == b"\x09" * 100_000


def test_touch_writes_the_free_runs_and_leaves_what_a_block_holds():
    arena = StateArena(2 * MiB)
    a = arena.alloc(1000)
    a[:1000] = b"\x05" * 1000
    arena._view[arena.capacity - 1] = 3  # (a free page, written before)
    assert arena.touch() >= 0.0
    assert bytes(a[:1000]) == b"\x05" * 1000 and arena._view[arena.capacity - 1] == 0
    assert arena.used == block_size(1000) and arena.largest_free == arena.capacity - block_size(1000)


def test_a_block_the_arena_did_not_give_is_not_its_own():
    arena = StateArena(2 * MiB)
    assert not arena.owns(bytearray(10))
    with pytest.raises(KeyError):
        arena.free(memoryview(bytearray(10)))


def test_an_arena_needs_a_positive_capacity():
    with pytest.raises(ValueError, match="capacity"):
        StateArena(0)
