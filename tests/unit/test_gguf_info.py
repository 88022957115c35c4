"""GGUF header reading and tokenizer compatibility, on small real GGUF files written with gguf."""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from homespec.errors import IncompatibleTokenizer, ModelError
from homespec.llama.gguf_info import (
    check_tokenizer_compat,
    compare_tokenizers,
    read_gguf_info,
    read_token_texts,
)

TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "Ġthe", "\n", "é", "你好", "x" * 60]


def write_gguf(
    path: Path,
    tokens: list[str] = TOKENS,
    *,
    name: str | None = "Tiny",
    pre: str | None = "qwen2",
    bos: int = 0,
    eos: int = 2,
    eot: int | None = None,
    head_count_kv: int | None = 2,
    key_length: int | None = None,
    merges: int = 0,
    output: bool = False,
) -> Path:
    w = gguf.GGUFWriter(str(path), "qwen2")
    if name:
        w.add_name(name)
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_block_count(3)
    w.add_head_count(8)
    if head_count_kv is not None:
        w.add_head_count_kv(head_count_kv)
    if key_length is not None:
        w.add_key_length(key_length)
        w.add_value_length(key_length)
    w.add_tokenizer_model("gpt2")
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    if merges:
        w.add_token_merges([f"m{i} n{i}" for i in range(merges)])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    if eot is not None:
        w.add_eot_token_id(eot)
    w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    w.add_tensor("token_embd.weight", np.ones((16, 16), dtype=np.float32))  # 1,024 bytes
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float16))  # 128 bytes
    if output:  # an untied output matrix
        w.add_tensor("output.weight", np.ones((16, 8), dtype=np.float16))  # 256 bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_read_gguf_info_reports_architecture_shapes_and_tokenizer(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tiny.gguf")
    info = read_gguf_info(path)
    assert (info.architecture, info.name, info.n_vocab, info.n_ctx_train) == ("qwen2", "Tiny", len(TOKENS), 4096)
    assert (info.n_embd, info.n_layer, info.n_head, info.n_head_kv) == (64, 3, 8, 2)
    assert (info.head_dim_k, info.head_dim_v) == (8, 8)  # n_embd // n_head when not stated
    assert (info.tokenizer_model, info.tokenizer_pre) == ("gpt2", "qwen2")
    assert (info.bos_token_id, info.eos_token_id, info.eot_token_id, info.pad_token_id) == (0, 2, None, None)
    assert info.chat_template and info.chat_template.startswith("{% for m in messages %}")
    assert info.tensor_bytes == 1024 + 128
    assert info.file_size == path.stat().st_size
    assert info.kv_bytes_per_token() == 3 * 2 * (8 + 8) * 2  # layers * kv heads * (K + V dims) * f16
    assert (info.token_embd_bytes, info.output_bytes) == (1024, 0)  # no output.weight: tied


def test_read_gguf_info_measures_token_embd_and_output_from_the_tensor_table(tmp_path: Path) -> None:
    info = read_gguf_info(write_gguf(tmp_path / "tiny.gguf", output=True))
    assert (info.token_embd_bytes, info.output_bytes, info.tensor_bytes) == (1024, 256, 1024 + 128 + 256)
    # Matrices only (the F16 output layer, the F32 embedding); a norm's vector is no matrix.
    assert info.matrix_types == {"F16", "F32"}
    assert read_gguf_info(write_gguf(tmp_path / "tied.gguf")).matrix_types == {"F32"}


def test_info_defaults_kv_heads_to_heads_and_name_to_file_stem(tmp_path: Path) -> None:
    info = read_gguf_info(write_gguf(tmp_path / "no-name.gguf", name=None, head_count_kv=None, key_length=32))
    assert info.name == "no-name" and info.n_head_kv == 8
    assert (info.head_dim_k, info.head_dim_v) == (32, 32)
    assert info.kv_bytes_per_token() == 3 * 8 * (32 + 32) * 2  # f16
    assert info.kv_bytes_per_token("q8_0") == 3 * 8 * (32 + 32) // 32 * 34  # blocks of 32 elements in 34 bytes


def test_token_texts_round_trip_exactly(tmp_path: Path) -> None:
    assert read_token_texts(write_gguf(tmp_path / "t.gguf")) == TOKENS


def test_qwen_sized_vocabulary_reads_well_under_two_seconds(tmp_path: Path) -> None:
    tokens = [f"tok{i}" for i in range(151_936)]
    path = write_gguf(tmp_path / "big.gguf", tokens, merges=151_387)
    read_gguf_info(path)  # first call pays the one-off import of gguf's tables
    t0 = time.perf_counter()
    info = read_gguf_info(path)
    texts = read_token_texts(path)
    elapsed = time.perf_counter() - t0  # s; measured ~0.1 s on a 2-core box, gguf.GGUFReader 7.5 s
    assert info.n_vocab == len(texts) == 151_936 and texts[-1] == "tok151935"
    assert elapsed < 2.0


def test_missing_file_is_a_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="model file not found"):
        read_gguf_info(tmp_path / "absent.gguf")


def test_non_gguf_file_is_rejected_by_magic(tmp_path: Path) -> None:
    path = tmp_path / "page.gguf"
    path.write_bytes(b"<!doctype html><html>" + b" " * 100)
    with pytest.raises(ModelError, match=r"not a GGUF file \(magic b'<!do'"):
        read_gguf_info(path)


def test_file_cut_inside_the_tensor_data_is_truncated(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "cut.gguf")
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 600)  # bytes: inside the last tensors, past any padding
    with pytest.raises(ModelError, match=r"truncated: tensor \S+ ends at byte"):
        read_gguf_info(path)


def test_file_cut_inside_the_header_is_a_one_line_error(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "cut.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: data.index(b"tokenizer.ggml.tokens") + 40])
    with pytest.raises(ModelError, match="corrupt") as err:
        read_gguf_info(path)
    assert "\n" not in str(err.value)


def test_identical_tokenizers_are_compatible(tmp_path: Path) -> None:
    target = write_gguf(tmp_path / "t.gguf", name="Target")
    draft = write_gguf(tmp_path / "d.gguf", name="Draft")
    report = compare_tokenizers(target, draft)
    assert report.compatible and report.problems == []
    check_tokenizer_compat(target, draft)  # does not raise


def test_padding_of_up_to_128_tokens_is_allowed(tmp_path: Path) -> None:
    target = write_gguf(tmp_path / "t.gguf", TOKENS + [f"<pad{i}>" for i in range(128)])
    report = compare_tokenizers(target, write_gguf(tmp_path / "d.gguf"))
    assert report.compatible
    assert any("padding" in note for note in report.notes)


def test_vocab_larger_by_more_than_128_is_incompatible(tmp_path: Path) -> None:
    target = write_gguf(tmp_path / "t.gguf", TOKENS + [f"<pad{i}>" for i in range(129)])
    report = compare_tokenizers(target, write_gguf(tmp_path / "d.gguf"))
    assert not report.compatible
    assert report.problems == [f"vocab {len(TOKENS)} vs {len(TOKENS) + 129} tokens"]


def test_different_token_text_names_first_differing_id_and_count(tmp_path: Path) -> None:
    changed = list(TOKENS)
    changed[3], changed[5] = "A", "Ġa"
    target = write_gguf(tmp_path / "t.gguf", name="Target")
    draft = write_gguf(tmp_path / "d.gguf", changed, name="Draft")
    with pytest.raises(IncompatibleTokenizer) as err:
        check_tokenizer_compat(target, draft)
    assert str(err.value) == (
        "draft Draft is not compatible with target Target: "
        f"first differing token id 3: 'A' vs 'a' (2 of {len(TOKENS)} shared ids differ)"
    )


def test_different_eos_and_pre_tokenizer_are_each_named(tmp_path: Path) -> None:
    target = write_gguf(tmp_path / "t.gguf", name="Target")
    draft = write_gguf(tmp_path / "d.gguf", name="Draft", eos=1, pre="smollm")
    report = compare_tokenizers(target, draft)
    assert report.problems == ["tokenizer model gpt2/smollm vs gpt2/qwen2", "EOS token 1 vs 2"]


def test_eot_is_compared_only_when_both_define_it(tmp_path: Path) -> None:
    target = write_gguf(tmp_path / "t.gguf", eot=2)
    assert compare_tokenizers(target, write_gguf(tmp_path / "d.gguf")).compatible
    other = write_gguf(tmp_path / "o.gguf", eot=1)
    assert compare_tokenizers(target, other).problems == ["EOT token 1 vs 2"]


def test_smollm_style_draft_message_lists_every_difference_on_one_line(tmp_path: Path) -> None:
    target = write_gguf(tmp_path / "t.gguf", ["!", "b"] + [f"q{i}" for i in range(300)], name="Qwen", eos=1)
    draft = write_gguf(tmp_path / "d.gguf", ["<|endoftext|>", "b"] + [f"s{i}" for i in range(8)], name="Smol",
                       pre="smollm", eos=0)
    with pytest.raises(IncompatibleTokenizer) as err:
        check_tokenizer_compat(target, draft)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("draft Smol is not compatible with target Qwen: vocab 10 vs 302 tokens; ")
    assert "tokenizer model gpt2/smollm vs gpt2/qwen2" in msg and "EOS token 0 vs 1" in msg
    assert msg.endswith("first differing token id 0: '<|endoftext|>' vs '!' (9 of 10 shared ids differ)")
