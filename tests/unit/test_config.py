"""config.yaml: the defaults that depend on the machine, and errors that name the field."""

from __future__ import annotations

import pytest

from homespec.config import Config, ConfigError, RuntimeConfig, load_config


def test_flash_attention_auto_is_on_for_a_cpu_build_with_the_grouped_kernel_and_left_to_llama_cpp_with_a_gpu():
    auto = RuntimeConfig()
    assert auto.flash_attn_for(n_gpu_layers=0, grouped_kernel=True) is True
    assert auto.flash_attn_for(n_gpu_layers=0, grouped_kernel=False) is False  # verify passes would pay for it
    assert auto.flash_attn_for(n_gpu_layers=-1) is None
    assert RuntimeConfig(flash_attn="on").flash_attn_for(0) is True
    assert RuntimeConfig(flash_attn="off").flash_attn_for(-1) is False
    assert RuntimeConfig(exact=True, flash_attn="on").flash_attn_for(0) is True


def test_unquoted_yaml_off_and_on_read_as_the_words_not_as_booleans(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("speculation:\n  mode: off\nruntime:\n  flash_attn: on\n")
    cfg = load_config(path)
    assert cfg.speculation.mode == "off" and cfg.runtime.flash_attn == "on"
    path.write_text("speculation:\n  mode: on\n")
    with pytest.raises(ConfigError, match=r"speculation\.mode"):
        load_config(path)


@pytest.mark.parametrize("text, field", [
    ("runtime:\n  flash_attn: sometimes\n", r"runtime\.flash_attn"),
    # Exact mode needs flash attention: without it one-token and batched attention differ.
    ("runtime:\n  exact: true\n  flash_attn: 'off'\n", r"runtime.*exact.*flash_attn"),
    # ... and a KV stream per sequence: in one shared buffer its cells leave position order.
    ("runtime:\n  exact: true\n  kv_unified: true\n", r"runtime.*exact.*kv_unified"),
])
def test_a_bad_attention_setting_is_one_line_naming_the_field(tmp_path, text, field):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=field) as e:
        load_config(path)
    assert "\n" not in str(e.value)


def test_the_shipped_config_yaml_is_valid_and_matches_the_defaults():
    from pathlib import Path

    shipped = load_config(Path(__file__).resolve().parents[2] / "config.yaml")
    # Every section, every key (base_dir, where the file lies, is excluded from the dump).
    assert shipped.model_dump() == Config().model_dump()


@pytest.mark.parametrize("value", ["-1", "3601", "soon"])
def test_a_bad_sse_ping_interval_is_refused_naming_the_field(tmp_path, value):
    path = tmp_path / "config.yaml"
    path.write_text(f"server:\n  sse_ping_s: {value}\n")
    with pytest.raises(ConfigError, match=r"server\.sse_ping_s"):
        load_config(path)


@pytest.mark.parametrize("value", ["1", "100", "true", "'4096'", "-1"])
def test_an_answer_memory_too_small_to_hold_answers_or_not_a_number_is_refused_naming_the_field(tmp_path, value):
    path = tmp_path / "config.yaml"
    path.write_text(f"speculation:\n  ngram:\n    memory_tokens: {value}\n")
    with pytest.raises(ConfigError, match=r"speculation\.ngram\.memory_tokens") as e:
        load_config(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", [0, 1024, 65536])
def test_an_answer_memory_of_0_off_or_of_a_thousand_tokens_and_more_is_accepted(tmp_path, value):
    path = tmp_path / "config.yaml"
    path.write_text(f"speculation:\n  ngram:\n    memory_tokens: {value}\n")
    assert load_config(path).speculation.ngram.memory_tokens == value
