"""Pairing models: the default draft is accepted, a different tokenizer is refused clearly."""

from __future__ import annotations

import pytest

from homespec.errors import IncompatibleTokenizer
from homespec.llama.gguf_info import check_tokenizer_compat
from tests.conftest import DRAFT, SMOLLM, TARGET, require


@pytest.mark.integration
def test_default_draft_is_compatible_with_default_target():
    check_tokenizer_compat(require(TARGET), require(DRAFT))


@pytest.mark.integration
def test_smollm_draft_is_refused_with_a_message_naming_the_difference():
    with pytest.raises(IncompatibleTokenizer) as e:
        check_tokenizer_compat(require(TARGET), require(SMOLLM))
    msg = str(e.value)
    assert "49152" in msg and "151936" in msg and "\n" not in msg


@pytest.mark.integration
def test_loading_an_incompatible_draft_fails_before_loading_weights(tmp_path):
    from homespec.config import Config, ModelRef
    from homespec.models.loader import load_model_set

    cfg = Config()
    cfg.models.target = ModelRef(path=require(TARGET))
    cfg.models.draft = ModelRef(path=require(SMOLLM))
    with pytest.raises(IncompatibleTokenizer):
        load_model_set(cfg)
