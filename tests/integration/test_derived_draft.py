"""The default draft served requantized to Q4_0 by llama.cpp's own quantizer (models/derived.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from homespec.config import Config, DraftRef, ModelRef, ModelsConfig, RuntimeConfig
from homespec.llama.gguf_info import check_tokenizer_compat, read_gguf_info
from homespec.models.derived import served_draft
from homespec.models.loader import load_model_set
from homespec.speculation.engine import Engine, FixedPolicy, GenerationStats
from homespec.speculation.proposers.draft import DraftProposer
from tests.conftest import DRAFT, TARGET, require
from tests.integration.exactness import encode

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
    models = tmp_path_factory.mktemp("models")
    return Config(
        models=ModelsConfig(dir=models, target=ModelRef(path=require(TARGET)), draft=DraftRef(path=require(DRAFT))),
        runtime=RuntimeConfig(n_ctx=1024, n_batch=256),
    )


def test_the_served_draft_is_q4_0_smaller_and_keeps_the_tokenizer(cfg: Config) -> None:
    path = served_draft(cfg, cfg.models.draft)
    assert path == cfg.models.dir / "qwen2.5-coder-0.5b-instruct-q4_k_m.q4_0.gguf"
    info, published = read_gguf_info(path), read_gguf_info(require(DRAFT))
    assert published.matrix_types == {"Q5_0", "Q4_K", "Q6_K", "Q8_0"}
    assert info.matrix_types == {"Q4_0"}  # the output layer and embeddings too
    assert info.file_size < 0.8 * published.file_size
    check_tokenizer_compat(require(TARGET), path)  # no IncompatibleTokenizer
    made = path.stat().st_mtime_ns
    assert served_draft(cfg, cfg.models.draft) == path and path.stat().st_mtime_ns == made


def test_the_served_draft_drafts_code_that_the_target_keeps(target_rt, draft_rt) -> None:
    """The copy the tests' draft_rt loads is the served Q4_0 one; the exactness tests check its
    drafts change nothing. Here: a broken copy (another tokenizer's ids, garbage weights) would
    draft nothing the target keeps, while the Q4_0 draft was accepted 0.77-0.83 on code."""
    assert draft_rt.path.name == "qwen2.5-coder-0.5b-instruct-q4_k_m.q4_0.gguf"
    engine = Engine(target_rt)
    prompt = encode(target_rt, "Write a Python function that returns the n-th Fibonacci number iteratively.")
    target_rt.reset()
    st = GenerationStats()
    for _ in engine.generate(prompt, max_tokens=48, policy=FixedPolicy(DraftProposer(draft_rt, target_rt.n_vocab), 4), stats=st):
        pass
    draft_rt.reset()
    assert st.proposed > 0 and st.accepted / st.proposed > 0.5, f"{st.accepted}/{st.proposed} accepted"


def test_the_daemons_model_set_loads_the_served_copy(cfg: Config) -> None:
    ms = load_model_set(cfg)
    try:
        assert ms.draft_path == served_draft(cfg, cfg.models.draft)
        assert ms.draft_name == "qwen2.5-coder-0.5b-instruct-q4_k_m.q4_0"
    finally:
        ms.close()


def test_an_incompatible_draft_is_refused_before_any_copy_is_made(tmp_path: Path) -> None:
    from homespec.errors import IncompatibleTokenizer
    from tests.conftest import SMOLLM

    cfg = Config(models=ModelsConfig(dir=tmp_path, target=ModelRef(path=require(TARGET)),
                                     draft=DraftRef(path=require(SMOLLM))))
    with pytest.raises(IncompatibleTokenizer):
        load_model_set(cfg)
    assert list(tmp_path.iterdir()) == []
