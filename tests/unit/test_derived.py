"""The draft's served copy (models/derived.py): made once, remade when anything it came from
changes, and never in the way of serving. llama.cpp's quantizer is replaced by a copy here; the
real one runs in tests/integration/test_derived_draft.py."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from homespec.config import Config, ConfigError, DraftRef, ModelsConfig, load_config
from homespec.errors import ModelError
from homespec.llama import quantize
from homespec.models import derived
from homespec.models.derived import derived_path, served_draft
from tests.unit.test_gguf_info import write_gguf


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Path, str]]:
    """Every requantization asked for, as (source, type); the 'quantizer' copies the file."""
    calls: list[tuple[Path, str]] = []

    def fake(src: Path, dst: Path, qtype: str, threads: int) -> None:
        calls.append((src, qtype))
        shutil.copyfile(src, dst)

    monkeypatch.setattr(quantize, "requantize", fake)
    return calls


def _config(tmp_path: Path, source: Path, **draft: object) -> Config:
    return Config(models=ModelsConfig(dir=tmp_path / "models", draft=DraftRef(path=source, **draft)), base_dir=tmp_path)


def _q4_0_gguf(path: Path) -> Path:
    """A GGUF whose only matrix is Q4_0 (16 rows of one 32-weight block, 18 bytes each)."""
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(4096)
    w.add_embedding_length(32)
    w.add_block_count(1)
    w.add_head_count(4)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((16, 18), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_draft_is_requantized_once_and_reused_while_its_stamp_matches(tmp_path: Path, made: list) -> None:
    source = write_gguf(tmp_path / "draft.gguf")
    cfg = _config(tmp_path, source)
    first = served_draft(cfg, cfg.models.draft)
    assert first == tmp_path / "models" / "draft.q4_0.gguf" and first.is_file()
    assert served_draft(cfg, cfg.models.draft) == first
    assert made == [(source, "q4_0")]


def test_a_rewritten_source_makes_the_copy_again(tmp_path: Path, made: list) -> None:
    source = write_gguf(tmp_path / "draft.gguf")
    cfg = _config(tmp_path, source)
    served_draft(cfg, cfg.models.draft)
    write_gguf(source, name="Other")  # the same path, other bytes: a replaced model
    from homespec.models.fetch import record_local_checksum

    record_local_checksum(source)  # accepted as `homespec models verify` would
    served_draft(cfg, cfg.models.draft)
    assert len(made) == 2


def test_a_copy_changed_after_it_was_made_is_made_again(tmp_path: Path, made: list) -> None:
    source = write_gguf(tmp_path / "draft.gguf")
    cfg = _config(tmp_path, source)
    copy = served_draft(cfg, cfg.models.draft)
    copy.write_bytes(b"GGUF truncated")
    assert served_draft(cfg, cfg.models.draft) == copy
    assert len(made) == 2 and copy.read_bytes() == source.read_bytes()


def test_another_llama_cpp_makes_the_copy_again(tmp_path: Path, made: list, monkeypatch: pytest.MonkeyPatch) -> None:
    source = write_gguf(tmp_path / "draft.gguf")
    cfg = _config(tmp_path, source)
    served_draft(cfg, cfg.models.draft)
    monkeypatch.setattr(quantize, "quantizer_version", lambda: "0.0.0-other")
    served_draft(cfg, cfg.models.draft)
    assert len(made) == 2


def test_requantize_null_serves_the_published_file(tmp_path: Path, made: list) -> None:
    source = write_gguf(tmp_path / "draft.gguf")
    cfg = _config(tmp_path, source, requantize=None)
    assert served_draft(cfg, cfg.models.draft) == source
    assert made == []


def test_a_draft_already_in_that_type_is_served_as_it_is(tmp_path: Path, made: list) -> None:
    source = _q4_0_gguf(tmp_path / "draft.gguf")
    cfg = _config(tmp_path, source)
    assert served_draft(cfg, cfg.models.draft) == source
    assert made == []


def test_a_copy_that_cannot_be_made_serves_the_published_file_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(src: Path, dst: Path, qtype: str, threads: int) -> None:
        dst.write_bytes(b"half")  # a partial file must not stay behind
        raise ModelError("llama.cpp could not requantize draft.gguf to q4_0 (error 1; its log says why)")

    monkeypatch.setattr(quantize, "requantize", refuse)
    source = write_gguf(tmp_path / "draft.gguf")
    cfg = _config(tmp_path, source)
    with caplog.at_level(logging.WARNING, logger="homespec.models.derived"):
        assert served_draft(cfg, cfg.models.draft) == source
    assert "served as published" in caplog.text and "error 1" in caplog.text
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == []


def test_a_read_only_models_folder_puts_the_copy_in_the_state_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Root may write anywhere, so the check itself is what is replaced.
    models = tmp_path / "models"
    models.mkdir()
    monkeypatch.setattr(derived.os, "access", lambda p, mode: Path(p) != models)
    monkeypatch.setenv("HOMESPEC_STATE_DIR", str(tmp_path / "state"))
    cfg = _config(tmp_path, tmp_path / "draft.gguf")
    assert derived_path(cfg, tmp_path / "draft.gguf", "q4_0") == tmp_path / "state" / "models" / "draft.q4_0.gguf"


def test_the_quantizer_refuses_a_type_it_does_not_know(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="known types are q4_0"):
        quantize.requantize(tmp_path / "a.gguf", tmp_path / "b.gguf", "q3_x", threads=1)


def test_draft_is_served_as_q4_0_by_default_and_other_types_are_refused_naming_the_field(tmp_path: Path) -> None:
    assert Config().models.draft.requantize == "q4_0"
    bad = tmp_path / "config.yaml"
    bad.write_text("models:\n  draft:\n    name: d\n    requantize: q5_1\n")
    with pytest.raises(ConfigError, match="requantize"):
        load_config(bad)
    bad.write_text("models:\n  target:\n    name: t\n    requantize: q4_0\n")
    with pytest.raises(ConfigError, match="requantize"):
        load_config(bad)
