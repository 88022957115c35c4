"""The prefix cache on disk (prefix_store.py), on the scripted runtime: what a stopped daemon saved
is restored by the next one, and only by a daemon of the same model, build and settings."""

from __future__ import annotations

import os
import time
from pathlib import Path

from homespec.llama import prefix_store
from homespec.llama.prefix_cache import PrefixCache
from homespec.speculation.engine import Engine

from .fakes import FakeRuntime
from .test_prefix_cache import SYSTEM_A, SYSTEM_B, chat, cold

KEY = prefix_store.fingerprint({"model": "/models/a.gguf", "bytes": 1, "mtime_ns": 2})


def _stopped_daemon(root: Path, key: str = KEY) -> list[int]:
    """A daemon's life: two conversations (A saved when B came, B live), then saved at stop.
    Returns conversation A's prompt."""
    eng, cache = Engine(FakeRuntime(n_ctx=2048)), PrefixCache(1 << 20, min_tokens=16)
    prompt_a = SYSTEM_A + [5, 6, 7]
    chat(eng, cache, prompt_a)
    chat(eng, cache, SYSTEM_B + [1, 2])
    cache.stash(eng.target)  # the live one too, as Host.persist_prefixes does
    assert prefix_store.save(root, key, cache.saved()) == 2
    return prompt_a


def _started_daemon(root: Path, key: str = KEY) -> tuple[Engine, PrefixCache, int]:
    cache = PrefixCache(1 << 20, min_tokens=16)
    n = sum(cache.adopt(h.tokens, h.size, h.fill) for h in prefix_store.read(root, key))
    return Engine(FakeRuntime(n_ctx=2048)), cache, n


def test_a_restarted_daemon_reads_an_earlier_conversation_from_disk_and_answers_the_same(tmp_path: Path) -> None:
    prompt_a = _stopped_daemon(tmp_path)
    eng, cache, n = _started_daemon(tmp_path)
    assert n == 2
    out, st = chat(eng, cache, prompt_a)
    assert cache.restores == 1 and st.cached_tokens == len(prompt_a) - 1
    assert out == cold(prompt_a)


def test_histories_come_back_in_the_order_they_were_used(tmp_path: Path) -> None:
    _stopped_daemon(tmp_path)
    _, cache, _ = _started_daemon(tmp_path)
    newest = cache.newest()
    assert newest is not None and newest[0][: len(SYSTEM_B)] == SYSTEM_B  # B was live at the stop: the most recent


def test_another_model_or_setting_does_not_load_them(tmp_path: Path) -> None:
    _stopped_daemon(tmp_path)
    other = prefix_store.fingerprint({"model": "/models/a.gguf", "bytes": 1, "mtime_ns": 3})  # the file changed
    assert list(prefix_store.read(tmp_path, other)) == []
    (tmp_path / other).mkdir()
    for f in (tmp_path / KEY).iterdir():  # even a file moved into its folder: its header says whose it is
        f.rename(tmp_path / other / f.name)
    assert list(prefix_store.read(tmp_path, other)) == []


def test_a_file_cut_short_or_garbled_is_skipped_and_the_rest_load(tmp_path: Path) -> None:
    _stopped_daemon(tmp_path)
    files = sorted((tmp_path / KEY).iterdir())
    files[0].write_bytes(files[0].read_bytes()[:-5])
    (tmp_path / KEY / "noise.kv").write_bytes(b"not a cache at all")
    (tmp_path / KEY / "short.kv").write_bytes(prefix_store.MAGIC + b"\x01")
    (tmp_path / KEY / "header.kv").write_bytes(prefix_store.MAGIC + b"\x02\x00\x00\x00{}")
    _, cache, n = _started_daemon(tmp_path)
    assert n == 1 and len(cache) == 1


def test_saving_again_replaces_what_the_last_stop_left(tmp_path: Path) -> None:
    _stopped_daemon(tmp_path)
    cache = PrefixCache(1 << 20, min_tokens=16)
    rt = FakeRuntime(n_ctx=2048)
    rt.tokens = SYSTEM_A + [1] * 20
    cache.stash(rt)
    assert prefix_store.save(tmp_path, KEY, cache.saved()) == 1
    assert len(list((tmp_path / KEY).glob("*.kv"))) == 1


def test_more_than_the_memory_budget_keeps_the_most_recent(tmp_path: Path) -> None:
    _stopped_daemon(tmp_path)
    # Each conversation's entry: ~50 tokens, a 4-byte token each, in its state and its token
    # list (~456 bytes): room for one of the two.
    cache = PrefixCache(700, min_tokens=16)
    n = sum(cache.adopt(h.tokens, h.size, h.fill) for h in prefix_store.read(tmp_path, KEY))
    assert n == 2 and len(cache) == 1
    newest = cache.newest()
    assert newest is not None and newest[0][: len(SYSTEM_B)] == SYSTEM_B


def test_the_files_are_the_daemons_users_alone(tmp_path: Path) -> None:
    """They hold recent conversations: the prompts' tokens are their text."""
    _stopped_daemon(tmp_path)
    assert (tmp_path / KEY).stat().st_mode & 0o077 == 0
    assert all(f.stat().st_mode & 0o077 == 0 for f in (tmp_path / KEY).iterdir())


def test_past_its_time_budget_a_stop_saves_only_the_most_recent(tmp_path: Path) -> None:
    """A service manager kills a stop that takes too long: the newest history goes first."""
    eng, cache = Engine(FakeRuntime(n_ctx=2048)), PrefixCache(1 << 20, min_tokens=16)
    chat(eng, cache, SYSTEM_A + [5, 6, 7])
    chat(eng, cache, SYSTEM_B + [1, 2])
    cache.stash(eng.target)
    assert prefix_store.save(tmp_path, KEY, cache.saved(), budget_s=0) == 1
    (saved,) = prefix_store.read(tmp_path, KEY)
    assert saved.tokens[: len(SYSTEM_B)] == SYSTEM_B


def test_a_file_left_half_written_by_a_killed_stop_is_cleared_at_the_next(tmp_path: Path) -> None:
    _stopped_daemon(tmp_path)
    (tmp_path / KEY / ".abc.kv.123.tmp").write_bytes(b"half")
    _stopped_daemon(tmp_path)
    assert not list((tmp_path / KEY).glob("*.tmp"))


def test_another_fingerprints_folder_untouched_for_weeks_is_removed_at_a_save(tmp_path: Path) -> None:
    old_key = prefix_store.fingerprint({"model": "/models/old.gguf"})
    recent_key = prefix_store.fingerprint({"model": "/models/recent.gguf"})
    _stopped_daemon(tmp_path, old_key)
    _stopped_daemon(tmp_path, recent_key)
    weeks_ago = time.time() - prefix_store.STALE_S - 60
    for f in [*(tmp_path / old_key).iterdir(), tmp_path / old_key]:
        os.utime(f, (weeks_ago, weeks_ago))
    _stopped_daemon(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([KEY, recent_key])


class _Refusing(FakeRuntime):
    """llama.cpp refusing a state (another layout): Slot.load_state empties the slot and raises."""

    def load_state(self, state, tokens) -> None:  # type: ignore[no-untyped-def]
        self.reset()
        raise RuntimeError("llama.cpp refused a saved KV state")


def test_a_state_llama_cpp_refuses_is_dropped_and_the_prompt_read_instead(tmp_path: Path) -> None:
    prompt_a = _stopped_daemon(tmp_path)
    _, cache, n = _started_daemon(tmp_path)
    eng = Engine(_Refusing(n_ctx=2048))
    out, st = chat(eng, cache, prompt_a)
    assert st.cached_tokens == 0 and len(cache) == n - 1
    assert out == cold(prompt_a)


def test_a_save_writes_only_the_histories_it_has_not_written_before(tmp_path: Path) -> None:
    """The daemon also saves while idle: what is on disk already is kept, not written again."""
    eng, cache = Engine(FakeRuntime(n_ctx=2048)), PrefixCache(1 << 20, min_tokens=16)
    chat(eng, cache, SYSTEM_A + [5, 6, 7])
    chat(eng, cache, SYSTEM_B + [1, 2])  # A saved
    prefix_store.save(tmp_path, KEY, cache.saved())
    (first,) = (tmp_path / KEY).iterdir()
    inode = first.stat().st_ino
    cache.stash(eng.target)  # B now too
    assert prefix_store.save(tmp_path, KEY, cache.saved()) == 2
    assert first.stat().st_ino == inode  # the same file, not a new one renamed over it
    _, restarted, n = _started_daemon(tmp_path)
    newest = restarted.newest()
    assert n == 2 and newest is not None and newest[0][: len(SYSTEM_B)] == SYSTEM_B
