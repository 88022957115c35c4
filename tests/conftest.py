"""Shared fixtures. Integration tests need the real models in models/ (`make test` pulls them)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
TARGET = MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
DRAFT = MODELS / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SMOLLM = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"


def require(path: Path) -> Path:
    """Integration tests fail (not skip) without their model: `make test` is meant to pull it."""
    if not path.exists():
        pytest.fail(f"{path.name} missing: run `homespec models pull --with-test-models`")
    return path


@pytest.fixture(scope="session", autouse=True)
def _state_folder(tmp_path_factory: pytest.TempPathFactory):
    """The daemon's state folder (checksums of `path:` models, the prompt cache kept across
    restarts) is a temporary one: a test must neither read nor replace a user's. Daemons that
    tests start as processes inherit it."""
    mp = pytest.MonkeyPatch()
    folder = tmp_path_factory.mktemp("state")
    mp.setenv("HOMESPEC_STATE_DIR", str(folder))
    yield folder
    mp.undo()


@pytest.fixture(autouse=True)
def _no_prompt_cache_of_other_tests(_state_folder: Path) -> None:
    """What one test's daemon kept across its stop (memory.prefix_cache_persist) is not the
    next test's: a remembered answer drafts, and a test's counts must not depend on the order."""
    shutil.rmtree(_state_folder / "prompt-cache", ignore_errors=True)
