"""Real small models, loaded once per session (loading is ~1 s; warm-up pays the page faults)."""

from __future__ import annotations

import pytest

from homespec.llama.runtime import Runtime, RuntimeOptions
from tests.conftest import DRAFT, TARGET, require
from tests.integration.server_fixtures import served  # noqa: F401 - one daemon for every module

# Small contexts keep the KV cache and the tests light; every prompt here is short.
OPTS = RuntimeOptions(n_ctx=1024, n_batch=256)


@pytest.fixture(scope="session")
def target_rt():
    rt = Runtime(require(TARGET), OPTS)
    yield rt
    rt.close()


@pytest.fixture(scope="session")
def draft_rt():
    """The draft as the daemon serves it by default: requantized to Q4_0 (models/derived.py),
    made in models/ beside the published file once per checkout."""
    from homespec.config import Config, DraftRef, ModelsConfig
    from homespec.models.derived import served_draft
    from tests.conftest import MODELS

    cfg = Config(models=ModelsConfig(dir=MODELS, draft=DraftRef(path=require(DRAFT))))
    rt = Runtime(served_draft(cfg, cfg.models.draft), OPTS)
    yield rt
    rt.close()


@pytest.fixture(scope="session")
def epsilon(target_rt):
    """llama.cpp's batch noise on this machine, decode passes and a prompt's wide pass: the
    near-tie threshold of DESIGN.md's rule (b)."""
    from tests.integration.exactness import measure_batch_noise

    return measure_batch_noise(target_rt)
