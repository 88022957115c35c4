"""Memory pressure: the draft model is unloaded and loaded back while the session keeps serving."""

from __future__ import annotations

import pytest

from homespec.config import Config, DraftRef, ModelRef, ModelsConfig, RuntimeConfig
from homespec.serving.host import GenerationRequest, Host, UnknownMode
from tests.conftest import DRAFT, ROOT, TARGET, require

pytestmark = pytest.mark.integration


def test_unloading_the_draft_keeps_serving_and_reloading_restores_it():
    cfg = Config(
        models=ModelsConfig(target=ModelRef(path=require(TARGET)), draft=DraftRef(path=require(DRAFT))),
        runtime=RuntimeConfig(n_ctx=512, n_batch=128),
        base_dir=ROOT,
    )
    with Host.open(cfg, calibrate=False) as s:
        prompt = s.models.encode_chat([{"role": "user", "content": "Count from 1 to 5."}])
        lookup = s.controller.proposers["ngram"]
        assert s.controller.proposers["draft"].copy == lookup.copy  # its guesses go on as the prompt does
        s.unload_draft()
        assert s.models.draft is None and "draft" not in s.controller.proposers
        with pytest.raises(UnknownMode):
            s.generate(prompt, GenerationRequest(max_tokens=4, mode="draft", k=2))
        plain = "".join(ev.text for ev in s.generate(prompt, GenerationRequest(max_tokens=6, mode="off")))
        s.reload_draft()
        assert s.models.draft is not None and "draft" in s.controller.proposers
        assert s.controller.proposers["draft"].copy == lookup.copy
        gen = s.generate(prompt, GenerationRequest(max_tokens=6, mode="draft", k=2))
        text = "".join(ev.text for ev in gen)
        assert gen.stats.proposed > 0 and text == plain
