"""Prefix reuse: the live cache plus saved conversations, on the scripted runtime."""

from __future__ import annotations

import random

from homespec.llama.prefix_cache import PrefixCache
from homespec.llama.runtime import state_buffer
from homespec.llama.state_arena import block_size
from homespec.speculation.engine import Engine, FixedPolicy, GenerationStats

from .fakes import FakeRuntime

SYSTEM_A = list(range(1, 41))  # 40-token "system prompt" of conversation A
SYSTEM_B = list(range(41, 81))


def chat(engine, cache, prompt, max_tokens=8):
    cache.prepare(engine.target, prompt)
    st = GenerationStats()
    out = [t for ev in engine.generate(prompt, max_tokens=max_tokens, policy=FixedPolicy(), stats=st) for t in ev.tokens]
    return out, st


def cold(prompt, max_tokens=8):
    eng = Engine(FakeRuntime(n_ctx=2048))
    return [t for ev in eng.generate(prompt, max_tokens=max_tokens) for t in ev.tokens]


def test_second_turn_reuses_the_first_turn_and_counts_cached_tokens_exactly():
    eng, cache = Engine(FakeRuntime(n_ctx=2048)), PrefixCache(1 << 20, min_tokens=16)
    turn1 = SYSTEM_A + [5, 6, 7]
    out1, st1 = chat(eng, cache, turn1)
    assert st1.cached_tokens == 0
    turn2 = turn1 + out1 + [9, 9, 9]
    out2, st2 = chat(eng, cache, turn2)
    # The cache held turn1 + out1 minus the last emitted token (never evaluated).
    assert st2.cached_tokens == len(turn1) + len(out1) - 1
    assert out2 == cold(turn2)


def test_cold_and_warm_cache_give_the_same_greedy_text():
    eng, cache = Engine(FakeRuntime(n_ctx=2048)), PrefixCache(1 << 20, min_tokens=16)
    prompt = SYSTEM_A + [3, 3, 3]
    warm_first, _ = chat(eng, cache, prompt)
    warm_again, st = chat(eng, cache, prompt)
    assert st.cached_tokens == len(prompt) - 1  # all but the last prompt token, whose logits are needed
    assert warm_first == warm_again == cold(prompt)


def test_a_different_system_prompt_misses_and_is_still_correct():
    eng, cache = Engine(FakeRuntime(n_ctx=2048)), PrefixCache(1 << 20, min_tokens=16)
    chat(eng, cache, SYSTEM_A + [1, 2])
    out, st = chat(eng, cache, SYSTEM_B + [1, 2])
    assert st.cached_tokens == 0
    assert out == cold(SYSTEM_B + [1, 2])


def test_cached_prefix_longer_than_the_new_prompt_is_truncated():
    eng, cache = Engine(FakeRuntime(n_ctx=2048)), PrefixCache(1 << 20, min_tokens=1000)
    long_prompt = SYSTEM_A + list(range(100, 160))
    chat(eng, cache, long_prompt)
    short = SYSTEM_A + list(range(100, 110))  # a prefix of what is cached
    out, st = chat(eng, cache, short)
    assert st.cached_tokens == len(short) - 1
    assert eng.target.tokens[: len(short)] == short
    assert out == cold(short)


def test_switching_back_to_an_earlier_conversation_restores_its_saved_cache():
    eng, cache = Engine(FakeRuntime(n_ctx=2048)), PrefixCache(1 << 20, min_tokens=16)
    a = SYSTEM_A + [7, 7]
    out_a, _ = chat(eng, cache, a)
    chat(eng, cache, SYSTEM_B + [1])  # a different conversation takes the live cache
    assert len(cache) == 1 and cache.saves == 1
    a2 = a + out_a + [4]
    out, st = chat(eng, cache, a2)
    assert cache.restores == 1
    assert st.cached_tokens == len(a) + len(out_a) - 1
    assert out == cold(a2)


def test_a_saved_history_that_lends_only_its_prefix_stays_saved_for_its_own_return():
    """A new conversation that shares only the system prompt with a saved one restores that
    state to skip the system prompt; the saved conversation must not be lost by it."""
    eng, cache = Engine(FakeRuntime(n_ctx=2048)), PrefixCache(1 << 20, min_tokens=16)
    a = SYSTEM_A + list(range(100, 160))  # a long first conversation
    out_a, _ = chat(eng, cache, a)
    chat(eng, cache, SYSTEM_B + [1])  # saves A
    b = SYSTEM_A + [5]  # shares A's system prompt only
    chat(eng, cache, b)
    assert cache.restores == 1  # the system prompt came from A's save
    a2 = a + out_a + [4]
    out, st = chat(eng, cache, a2)  # A's next turn
    assert cache.restores == 2 and st.cached_tokens == len(a) + len(out_a) - 1
    assert out == cold(a2)


def test_short_histories_are_not_worth_saving():
    eng, cache = Engine(FakeRuntime(n_ctx=2048)), PrefixCache(1 << 20, min_tokens=100)
    chat(eng, cache, SYSTEM_A)
    chat(eng, cache, SYSTEM_B)
    assert len(cache) == 0


def test_least_recently_used_entries_are_evicted_within_the_budget():
    rt = FakeRuntime(n_ctx=4096)
    eng = Engine(rt)
    per_entry = (40 + 8) * 4 * 2  # FakeRuntime state: 4 bytes per token, plus 4 per token of bookkeeping
    cache = PrefixCache(budget_bytes=2 * per_entry + 10, min_tokens=16)
    convs = [[100 * i + j for j in range(40)] for i in range(1, 5)]
    for c in convs:
        chat(eng, cache, c)
    assert len(cache) == 2  # the two most recent earlier conversations
    assert cache.bytes <= cache.budget
    kept = {tuple(e.tokens[:40]) for e in cache._entries.values()}
    assert kept == {tuple(convs[1]), tuple(convs[2])}


def test_a_grown_conversation_supersedes_its_older_save():
    eng, cache = Engine(FakeRuntime(n_ctx=2048)), PrefixCache(1 << 20, min_tokens=16)
    a = SYSTEM_A + [1]
    out, _ = chat(eng, cache, a)
    chat(eng, cache, SYSTEM_B)  # saves A
    chat(eng, cache, a + out + [2])  # restores A, saves B
    chat(eng, cache, SYSTEM_B + [5])  # restores B, saves the longer A
    assert len(cache) == 1
    assert cache._entries[max(cache._entries)].tokens[: len(a)] == a


def test_a_returning_conversation_finds_the_slot_that_kept_its_history_and_a_new_one_saves_what_it_replaces() -> None:
    from types import SimpleNamespace

    from homespec.config import Config
    from homespec.serving.host import Host

    from .fakes import FakeRuntime

    target = FakeRuntime(n_seq=3, n_ctx=1024)
    host = Host(Config(), SimpleNamespace(target=target, draft=None, mtp_head=None))  # type: ignore[arg-type]
    history = [(3 * i) % 60 for i in range(300)]
    target.slot(2).eval(history)  # a request that ended in slot 2 left its history there
    assert host.pick_slot([*history, 7], free=[0, 1, 2]) == 2  # its next turn reads one token
    other = [(5 * i + 1) % 61 for i in range(200)]
    assert host.pick_slot(other, free=[0, 2]) == 0  # an empty slot before one holding a history
    target.slot(0).eval(other[:50])
    assert host.pick_slot(other[:40] + [9], free=[0, 2]) == 0  # the longer shared prefix wins
    third = [(7 * i + 2) % 59 for i in range(100)]
    assert host.pick_slot(third, free=[0, 1]) == 1  # nothing shared: the empty slot, though numbered higher
    # Sharing a system prompt is no reason to evict a history: an empty slot borrows the prefix.
    assert host.pick_slot([*history[:30], 8], free=[1, 2]) == 1
    host._prepare_cache(other, 2)  # a new conversation in slot 2 all the same: the old one is saved
    assert host.prefix_cache is not None and len(host.prefix_cache) == 1
    assert host.prefix_cache.prepare(target.slot(0), [*history, 7]) == len(history)  # restored in any slot


def test_idle_histories_stay_while_others_run_and_go_to_the_prefix_cache_when_one_request_is_left() -> None:
    """In the unified KV cache an idle history costs every pass (7 % measured for a lone request)."""
    from types import SimpleNamespace

    from homespec.config import Config
    from homespec.serving.host import Host

    from .fakes import FakeRuntime

    target = FakeRuntime(n_seq=4, n_ctx=1024)
    host = Host(Config(), SimpleNamespace(target=target, draft=None, mtp_head=None))  # type: ignore[arg-type]
    histories = {s: [(s + 3 * i) % 60 for i in range(300)] for s in range(4)}
    for s, h in histories.items():
        target.slot(s).eval(h)
    host.release_slot(3, busy=[0, 1, 2])
    host.release_slot(2, busy=[0, 1])
    assert target.slot(3).tokens == histories[3] and target.slot(2).tokens == histories[2]  # two still run
    host.release_slot(1, busy=[0])  # one left: it runs alone from now on
    assert [len(target.slot(s).tokens) for s in range(4)] == [300, 0, 0, 0]
    assert host.prefix_cache is not None and len(host.prefix_cache) == 3
    host.release_slot(0, busy=[])
    assert target.slot(0).tokens == histories[0]  # a lone user's next turn finds it live
    assert host.prefix_cache.prepare(target.slot(2), [*histories[3], 7]) == 300  # and the others in any slot


def test_a_new_request_borrows_the_longest_prefix_a_running_sequence_holds_and_the_lender_keeps_its_own() -> None:
    """A voice command beside three long answers shares the chat template's system prompt with
    them: it reads only its own words (share_prefix, free in llama.cpp's unified cache)."""
    from types import SimpleNamespace

    from homespec.config import Config
    from homespec.serving.host import Host

    from .fakes import FakeRuntime

    target = FakeRuntime(n_seq=3, n_ctx=1024)
    host = Host(Config(), SimpleNamespace(target=target, draft=None, mtp_head=None))  # type: ignore[arg-type]
    system = [(3 * i) % 60 for i in range(30)]
    running = [*system, 1, 2, 3, *range(100)]
    target.slot(0).eval(running)  # a long answer, still generating
    command = [*system, 7, 8, 9]
    assert host.prefix_cache is not None
    assert host.prefix_cache.prepare(target.slot(2), command, [target.slot(0), target.slot(1)]) == len(system)
    assert target.slot(2).tokens == system and target.slot(0).tokens == running
    assert host.prefix_cache.shares == 1 and host.prefix_cache.restores == 0
    # Host._prepare_cache offers every other slot; a saved state longer than any peer's prefix wins.
    saved = [*system, 7, 8, *range(200)]
    target.slot(1).eval(saved)
    host.prefix_cache.stash(target.slot(1))
    target.slot(1).reset()
    host._prepare_cache([*saved[:150], 5], 1)
    assert target.slot(1).tokens == saved and host.prefix_cache.restores == 1 and host.prefix_cache.shares == 1
    # Nothing longer elsewhere: the slot's own history stays as it is.
    host._prepare_cache([*running, 4], 0)
    assert target.slot(0).tokens == running and host.prefix_cache.shares == 1
    # A saved state and a running sequence offering as much: sharing is free, restoring a copy.
    target.slot(1).reset()
    target.slot(1).eval(running)
    host.prefix_cache.stash(target.slot(1))
    target.slot(1).reset()
    assert host.prefix_cache.prepare(target.slot(2), [*running[:60], 9], [target.slot(0), target.slot(2)]) == 60
    assert host.prefix_cache.shares == 2 and host.prefix_cache.restores == 1 and target.slot(2).tokens == running[:60]


def test_a_host_whose_slots_have_caches_of_their_own_still_lends_prefixes_keeps_idle_histories_and_packs_narrow_passes():
    from types import SimpleNamespace

    from homespec.config import Config
    from homespec.llama.kernels import EXACT_MAX_ROWS
    from homespec.serving.host import Host

    cfg = Config()
    cfg.runtime.exact = True  # a KV stream per slot
    target = FakeRuntime(n_seq=3, n_ctx=1024)
    target.shares_cells = False
    host = Host(cfg, SimpleNamespace(target=target, draft=None, mtp_head=None))  # type: ignore[arg-type]
    system = [(3 * i) % 60 for i in range(30)]
    running = [*system, 1, 2, 3, *range(100)]
    target.slot(0).eval(running)
    host._prepare_cache([*system, 7, 8, 9], 2)  # borrowed all the same (Slot.share_prefix copies it)
    assert target.slot(2).tokens == system and host.prefix_cache is not None and host.prefix_cache.shares == 1
    target.slot(1).eval(system)
    host.release_slot(1, busy=[0])  # no shared cache to slow the lone request: the history stays
    assert target.slot(1).tokens == system
    assert host.batch(prefill_chunk=64).max_rows == EXACT_MAX_ROWS


def test_a_conversation_saved_again_longer_is_written_where_its_restored_save_was():
    rt, cache = FakeRuntime(n_ctx=2048), PrefixCache(1 << 20, min_tokens=16)
    a, b = SYSTEM_A + list(range(200, 230)), SYSTEM_B + list(range(300, 330))
    rt.tokens = list(a)
    cache.prepare(rt, b)  # A is saved: B throws all of it away
    (saved_a,) = [e.state for e in cache._entries.values()]
    where = cache._arena.offset(saved_a.buf)
    rt.tokens = list(b)
    cache.prepare(rt, a + [1])  # B is saved, A restored and taken over by the slot: its memory is free
    assert rt.tokens == a and cache.restores == 1
    rt.tokens = a + [1, 2, 3, 4, 5]  # A answered again, longer than before
    cache.prepare(rt, b + [7])
    states = {tuple(e.tokens): e.state for e in cache._entries.values()}
    assert cache._arena.offset(states[tuple(a + [1, 2, 3, 4, 5])].buf) == where  # the same memory, grown
    assert rt.tokens == b  # and B came back whole from its own state


def test_a_full_cache_saves_into_the_memory_of_the_history_it_evicts():
    rt = FakeRuntime(n_ctx=2048)
    a, b, c = (SYSTEM_A + list(range(200 + 100 * i, 230 + 100 * i)) for i in range(3))
    # room for two histories: 4 bytes a token of state, in a block of whole cache lines, and 4 of tokens
    cache = PrefixCache(2 * (block_size(4 * len(a)) + 4 * len(a)), min_tokens=16)
    rt.tokens = list(a)
    cache.prepare(rt, SYSTEM_B)  # A saved
    (saved_a,) = [e.state for e in cache._entries.values()]
    where = cache._arena.offset(saved_a.buf)
    rt.tokens = list(b)
    cache.prepare(rt, SYSTEM_B)  # B saved: the cache is full
    rt.tokens = list(c)
    cache.prepare(rt, SYSTEM_B)  # C saved: A, the least recently used, makes room
    states = {tuple(e.tokens): e.state for e in cache._entries.values()}
    assert set(states) == {tuple(b), tuple(c)}
    assert cache._arena.offset(states[tuple(c)].buf) == where
    assert cache.bytes <= cache.budget


def test_every_save_lands_in_the_arena_and_no_two_saved_states_overlap_over_many_conversations():
    rng = random.Random(7)
    rt = FakeRuntime(n_ctx=4096)
    cache = PrefixCache(8 * 3 * 300, min_tokens=16)  # room for ~3 histories of 300 tokens
    convs = [[1000 * i + j for j in range(rng.randrange(20, 400))] for i in range(1, 12)]
    for _ in range(300):
        conv = rng.choice(convs)
        prompt = conv[: rng.randrange(17, len(conv) + 1)] + [rng.randrange(50_000, 60_000)]
        n = cache.prepare(rt, prompt)  # FakeRuntime.load_state asserts the restored bytes are the saved tokens
        assert rt.tokens[:n] == prompt[:n]
        rt.tokens = list(prompt)  # what sync and prefill leave
        assert cache.bytes <= cache.budget
        blocks = sorted((cache._arena.offset(e.state.buf), len(e.state.buf)) for e in cache._entries.values())
        assert all(o1 + n1 <= o2 for (o1, n1), (o2, _) in zip(blocks, blocks[1:], strict=False))
    assert cache.saves > 100 and cache.restores > 50


def test_a_history_larger_than_the_whole_budget_is_not_saved_and_evicts_nothing():
    rt = FakeRuntime(n_ctx=2048)
    a = SYSTEM_A + list(range(200, 230))
    cache = PrefixCache(block_size(4 * len(a)) + 4 * len(a) + 8, min_tokens=16)  # room for A, not for A 20 tokens longer
    rt.tokens = list(a)
    cache.prepare(rt, SYSTEM_B)
    rt.tokens = a + list(range(300, 320))
    cache.prepare(rt, SYSTEM_B)
    assert [e.tokens for e in cache._entries.values()] == [a]


def test_a_large_state_buffer_is_a_mapping_llama_cpp_writes_into_in_place():
    import ctypes
    import mmap

    size = 1000 * (28 << 10)  # bytes: a 1,000-token state of the 1.5B target
    buf = state_buffer(size)
    assert isinstance(buf, mmap.mmap)  # not a bytearray: that one is zeroed before it is written
    ctypes.memset((ctypes.c_uint8 * size).from_buffer(buf), 7, size)  # as llama_state_seq_get_data writes
    assert buf[0] == buf[size - 1] == 7
    assert isinstance(state_buffer(16 * (28 << 10)), bytearray)  # a short one: no mapping of its own


def test_a_prefix_borrowed_without_a_copy_takes_no_arena_memory_and_a_copied_one_does():
    rt = FakeRuntime(n_seq=2, n_ctx=1024)
    lender, slot = rt.slot(1), rt.slot(0)
    lender.eval(SYSTEM_A + list(range(200, 260)))
    for shares in (True, False):
        rt.shares_cells = shares
        cache = PrefixCache(1 << 20, min_tokens=16)
        blocks: list[int] = []  # sizes asked of the arena
        real_alloc = cache._arena.alloc
        cache._arena.alloc = lambda size, real_alloc=real_alloc, blocks=blocks: blocks.append(size) or real_alloc(size)
        slot.reset()
        assert cache.prepare(slot, SYSTEM_A + [1], peers=[lender]) == len(SYSTEM_A) and cache.shares == 1
        assert (blocks == []) == shares  # a unified cache tags cells: nothing to evict a history for
        assert cache._arena.used == 0
