"""Loading refuses a model file whose content no longer matches what was verified (issue #12, 1).

Tiny fake files and the fake registry of test_models: no weights, no network.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from homespec.config import Config, load_config
from homespec.errors import ModelError
from homespec.models import fetch
from homespec.models.fetch import local_stamp_path, resolve_model_path, stamp_path
from tests.unit.test_models import EXPECTED, run_cli, write_config


@pytest.fixture(autouse=True)
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private state folder, and no hashes remembered from other tests in this process."""
    folder = tmp_path / "state"
    monkeypatch.setenv("HOMESPEC_STATE_DIR", str(folder))
    monkeypatch.setattr(fetch, "_checked", {})
    return folder


def corrupt_in_place(path: Path, offset: int = 100) -> None:
    """Overwrite bytes without changing the size, then put the mtime back (a stealthy edit)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\x99" * 64)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def registry_config(tmp_path: Path, data: bytes = EXPECTED) -> tuple[Config, Path]:
    cfg = load_config(write_config(tmp_path, {"target": {"name": "fake-target"}, "draft": None}))
    (tmp_path / "models").mkdir()
    path = tmp_path / "models" / "fake-target.gguf"
    path.write_bytes(data)
    return cfg, path


def count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    hashed: list[Path] = []
    real = fetch._sha256_file
    monkeypatch.setattr(fetch, "_sha256_file", lambda p, progress=None: hashed.append(p) or real(p, progress))
    return hashed


# --- registry models ----------------------------------------------------------------------------


def test_unstamped_same_size_corrupt_registry_model_is_refused(tmp_path: Path) -> None:
    cfg, path = registry_config(tmp_path, EXPECTED[:-1] + b"\xff")  # right size, wrong bytes
    with pytest.raises(ModelError, match=r"refusing to load fake-target: sha256 \w+ does not match") as err:
        resolve_model_path(cfg, cfg.models.target)
    assert "\n" not in str(err.value) and "homespec models pull" in str(err.value)
    assert not stamp_path(path).exists()


def test_corruption_after_verify_keeping_size_and_mtime_is_refused(tmp_path: Path) -> None:
    cfg, path = registry_config(tmp_path)
    assert resolve_model_path(cfg, cfg.models.target) == path  # hashes, then stamps
    assert stamp_path(path).exists()
    corrupt_in_place(path)  # ctime moved: the stamp no longer vouches for the file
    with pytest.raises(ModelError, match="does not match the registry"):
        resolve_model_path(cfg, cfg.models.target)


def test_a_current_stamp_skips_the_hash_and_a_stale_one_is_rehashed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, path = registry_config(tmp_path)
    hashed = count_hashes(monkeypatch)
    resolve_model_path(cfg, cfg.models.target)
    resolve_model_path(cfg, cfg.models.target)
    assert hashed == [path]  # the second load trusted the stamp
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes, new mtime
    resolve_model_path(cfg, cfg.models.target)
    assert hashed == [path, path]
    assert fetch.is_verified(path, fetch.get_entry(fetch.load_registry(tmp_path / "registry.yaml"), "fake-target"))


def test_a_stamp_without_inode_and_ctime_is_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, path = registry_config(tmp_path)
    st = path.stat()
    # The stamp format before this check: size and mtime only.
    old = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": fetch.hashlib.sha256(EXPECTED).hexdigest()}
    stamp_path(path).write_text(json.dumps(old))
    hashed = count_hashes(monkeypatch)
    resolve_model_path(cfg, cfg.models.target)
    assert hashed == [path]
    assert set(json.loads(stamp_path(path).read_text())) == {"size", "mtime_ns", "ino", "ctime_ns", "sha256"}


def test_a_replaced_file_with_a_copied_stamp_is_rehashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, path = registry_config(tmp_path)
    resolve_model_path(cfg, cfg.models.target)
    stamp = stamp_path(path).read_text()
    replacement = path.with_name("new.gguf")
    replacement.write_bytes(EXPECTED[:-1] + b"\x00")
    os.replace(replacement, path)  # a new inode under the old name
    stamp_path(path).write_text(stamp)
    with pytest.raises(ModelError, match="does not match the registry"):
        resolve_model_path(cfg, cfg.models.target)


def test_hash_progress_is_reported(tmp_path: Path) -> None:
    cfg, _path = registry_config(tmp_path)
    seen: list[tuple[int, int]] = []
    resolve_model_path(cfg, cfg.models.target, progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1] == (len(EXPECTED), len(EXPECTED))


def test_stderr_progress_prints_a_line_per_quarter_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    bar = fetch.StderrHashProgress("big.gguf")
    for done in range(0, 101, 5):
        bar(done, 100)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"checking sha256 of big.gguf: {p} %" for p in (0, 25, 50, 75, 100)]


# --- path: models -------------------------------------------------------------------------------


def local_config(tmp_path: Path) -> tuple[Config, Path]:
    cfg = load_config(write_config(tmp_path, {"target": {"path": "mine.gguf"}, "draft": None}))
    path = tmp_path / "mine.gguf"
    path.write_bytes(EXPECTED)
    return cfg, path


def test_local_model_checksum_is_recorded_in_the_state_folder_on_first_load(tmp_path: Path, state: Path) -> None:
    cfg, path = local_config(tmp_path)
    assert resolve_model_path(cfg, cfg.models.target) == path
    record = json.loads(local_stamp_path(path).read_text())
    assert local_stamp_path(path).is_relative_to(state)
    assert record["sha256"] == fetch.hashlib.sha256(EXPECTED).hexdigest() and record["path"] == str(path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # nothing beside it


def test_local_model_changed_in_place_is_refused_until_verify_accepts_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, path = local_config(tmp_path)
    resolve_model_path(cfg, cfg.models.target)
    corrupt_in_place(path)
    with pytest.raises(ModelError, match=r"changed since it was first loaded .*run `homespec models verify`") as err:
        resolve_model_path(cfg, cfg.models.target)
    assert "\n" not in str(err.value)
    # The user replaced it on purpose: verify records the new checksum (its header is not a real
    # GGUF here, so accept it through the function the CLI calls).
    fetch.record_local_checksum(path)
    assert resolve_model_path(cfg, cfg.models.target) == path


def test_local_model_touched_but_unchanged_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, path = local_config(tmp_path)
    resolve_model_path(cfg, cfg.models.target)
    hashed = count_hashes(monkeypatch)
    resolve_model_path(cfg, cfg.models.target)
    assert hashed == []
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    resolve_model_path(cfg, cfg.models.target)
    assert hashed == [path]


def test_cli_verify_records_the_checksum_of_a_local_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.unit.test_gguf_info import write_gguf

    cfg = write_config(tmp_path, {"target": {"path": "mine.gguf"}, "draft": None})
    path = write_gguf(tmp_path / "mine.gguf")
    assert run_cli(["verify", "--config", str(cfg)]) == 0
    assert "checksum recorded" in capsys.readouterr().out
    assert json.loads(local_stamp_path(path).read_text())["sha256"] == fetch.hashlib.sha256(path.read_bytes()).hexdigest()


# --- models whose cache cannot drop a suffix (issue #12, 4) ---------------------------------------


@pytest.mark.parametrize(("flag", "kind"), [("llama_model_is_recurrent", "recurrent"), ("llama_model_is_hybrid", "hybrid")])
def test_recurrent_and_hybrid_models_are_refused_at_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: str, kind: str
) -> None:
    from homespec.llama import runtime

    freed: list[object] = []
    fake_model = object()
    monkeypatch.setattr(runtime.llama_cpp, "llama_model_load_from_file", lambda path, params: fake_model)
    monkeypatch.setattr(runtime.llama_cpp, "llama_model_is_recurrent", lambda m: flag == "llama_model_is_recurrent")
    monkeypatch.setattr(runtime.llama_cpp, "llama_model_is_hybrid", lambda m: flag == "llama_model_is_hybrid")
    monkeypatch.setattr(runtime.llama_cpp, "llama_model_free", freed.append)
    path = tmp_path / "mamba.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(ModelError, match=rf"mamba.gguf: {kind}.* models are not supported") as err:
        runtime.Runtime(path)
    assert "\n" not in str(err.value) and freed == [fake_model]


def test_a_failed_truncate_raises_and_keeps_the_cache_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    from homespec.llama import runtime

    cleared: list[object] = []
    monkeypatch.setattr(runtime.llama_cpp, "llama_memory_seq_rm", lambda mem, seq, p0, p1: False)
    monkeypatch.setattr(runtime.llama_cpp, "llama_memory_clear", lambda mem, data: cleared.append(mem))
    rt = runtime.Runtime.__new__(runtime.Runtime)  # no model: only the bookkeeping truncate touches
    rt.path, rt._mem, rt.tokens, rt._hid_start, rt._hid_n = Path("m.gguf"), object(), [1, 2, 3, 4], 0, 0
    with pytest.raises(RuntimeError, match="could not truncate the KV cache of m.gguf to 2 of 4 positions"):
        rt.truncate(2)
    assert rt.tokens == [1, 2, 3, 4] and cleared == []  # before: silently cleared, decoding from 0
