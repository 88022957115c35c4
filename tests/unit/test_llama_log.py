"""How llama.cpp's log lines reach homespec's log: its warnings and errors stay visible."""

from __future__ import annotations

import logging

from homespec.llama.runtime import llama_log_level


def test_llama_cpp_warnings_and_errors_stay_visible_and_its_load_chatter_goes_to_debug() -> None:
    assert llama_log_level(3, "llama_context: n_ctx_per_seq (4096) < n_ctx_train (32768)") == logging.WARNING
    assert llama_log_level(4, "failed to allocate buffer") == logging.ERROR
    assert llama_log_level(2, "llama_model_loader: loaded meta data") == logging.DEBUG
    assert llama_log_level(5, "...") == logging.DEBUG


def test_a_warning_about_a_model_file_that_llama_cpp_handles_itself_goes_to_debug() -> None:
    msg = "load: control-looking token: 128247 '</s>' was not control-type; this is probably a bug in the model. its type will be overridden"
    assert llama_log_level(3, msg) == logging.DEBUG
