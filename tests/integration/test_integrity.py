"""A real model corrupted in place (1 MiB of noise, same size and mtime) is refused at load."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

from homespec.config import load_config
from homespec.errors import ModelError
from tests.conftest import MODELS, SMOLLM, require


@pytest.mark.integration
def test_registry_model_corrupted_in_place_is_refused_by_the_loader(tmp_path: Path, monkeypatch) -> None:
    from homespec.models import fetch
    from homespec.models.loader import load_model_set

    monkeypatch.setattr(fetch, "_checked", {})
    models = tmp_path / "models"
    models.mkdir()
    path = models / SMOLLM.name
    shutil.copyfile(require(SMOLLM), path)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "models": {"registry": str(MODELS / "registry.yaml"), "dir": str(models),
                   "target": {"name": "smollm2-135m-instruct-q4_1"}, "draft": None},
    }))  # fmt: skip
    cfg = load_config(config)
    assert fetch.resolve_model_path(cfg, cfg.models.target) == path  # genuine: hashed and stamped
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        f.write(os.urandom(2**20))  # 1 MiB of noise in the weights
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with pytest.raises(ModelError, match="does not match the registry"):
        load_model_set(cfg, with_draft=False)
