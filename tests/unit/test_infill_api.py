"""llama.cpp's /infill request and answer (homespec/serving/infill_api.py), without weights."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from homespec.serving.infill_api import Cutoff, InfillRequest, select_fields, stop_type, timings
from homespec.serving.llama_options import sampling_order
from homespec.speculation.engine import GenerationStats
from homespec.speculation.sampling import SamplingParams

BASE = {"input_prefix": "def f():\n", "input_suffix": "\n"}

# What llama.vscode sends with every completion (src/llama-server.ts; llama.vim's is the same but
# for response_fields).
LLAMA_VSCODE = {**BASE, "input_extra": [{"filename": "a.py", "text": "x = 1\n"}], "prompt": "    ",
                "n_predict": 128, "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
                "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "n_indent": 4}


def test_an_editor_request_maps_onto_homespec_sampling():
    r = InfillRequest.model_validate(LLAMA_VSCODE)
    assert r.limit() == 128 and r.input_extra[0].filename == "a.py"
    assert r.chain() == ["top_k", "top_p", "infill"]
    # No temperature listed: llama.cpp draws at temperature 1, whatever the request or server default.
    assert r.sampling()["top_k"] == 40 and r.sampling()["top_p"] == 0.99 and r.sampling()["temperature"] == 1.0
    assert sampling_order(r.chain(), SamplingParams(temperature=1.0, top_k=40, top_p=0.99)) == ("top_k", "top_p", "infill")


def test_without_samplers_unset_options_keep_the_servers_defaults():
    r = InfillRequest.model_validate({k: v for k, v in LLAMA_VSCODE.items() if k != "samplers"})
    assert r.chain() is None and r.sampling()["temperature"] is None and r.sampling()["top_k"] == 40


@pytest.mark.parametrize("samplers", [["top_k", "top_p", "infill"], "kpi", ["Top-K", "nucleus", "INFILL"], ["topk", "top-p", "infill"]])
def test_sampler_names_codes_and_aliases_read_as_llama_cpp_reads_them(samplers):
    assert InfillRequest.model_validate({**BASE, "samplers": samplers}).chain() == ["top_k", "top_p", "infill"]


def test_samplers_not_listed_do_nothing_whatever_their_values():
    r = InfillRequest.model_validate({**BASE, "samplers": ["top_k"], "temperature": 0.2, "top_p": 0.5, "min_p": 0.1,
                                      "repeat_penalty": 1.3, "top_k": 5})
    s = r.sampling()
    assert (s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["repetition_penalty"]) == (1.0, 5, 1.0, 0.0, 1.0)


@pytest.mark.parametrize(("samplers", "message"), [(["top_k", "bogus"], "unknown sampler 'bogus'"), ("kpq", "unknown sampler 'q'"),
                                                   (["adaptive_p"], "adaptive_p")])
def test_a_sampler_homespec_does_not_know_or_cannot_follow_is_refused_by_name(samplers, message):
    with pytest.raises(ValidationError, match=message):
        InfillRequest.model_validate({**BASE, "samplers": samplers})


@pytest.mark.parametrize(("fields", "expected"), [
    ({"temperature": -1, "top_k": -5, "seed": -1}, {"temperature": 0.0, "top_k": 0, "seed": None}),  # llama.cpp's "off"
    ({"repeat_penalty": 1.1, "seed": 7}, {"repetition_penalty": 1.1, "seed": 7}),
])
def test_llama_cpp_conventions_become_homespec_values(fields, expected):
    s = InfillRequest.model_validate({**BASE, **fields}).sampling()
    assert {k: s[k] for k in expected} == expected


@pytest.mark.parametrize(("n_predict", "max_tokens", "limit"), [(None, None, None), (-1, None, None), (0, None, 0),
                                                                 (None, 9, 9), (5, 9, 5)])
def test_n_predict_minus_one_is_the_server_default_and_max_tokens_is_its_alias(n_predict, max_tokens, limit):
    r = InfillRequest.model_validate({**BASE, "n_predict": n_predict, "max_tokens": max_tokens})
    assert r.limit() == limit


def test_max_completion_tokens_is_an_alias_of_n_predict_ahead_of_max_tokens():
    assert InfillRequest.model_validate({**BASE, "max_completion_tokens": 7, "max_tokens": 9}).limit() == 7
    assert InfillRequest.model_validate({**BASE, "n_predict": 5, "max_completion_tokens": 7}).limit() == 5


@pytest.mark.parametrize(("fields", "n_cmpl"), [({}, 1), ({"n": 3}, 3), ({"n_cmpl": 2, "n": 3}, 2)])
def test_n_is_the_number_of_completions_when_n_cmpl_is_not_given(fields, n_cmpl):
    assert InfillRequest.model_validate({**BASE, **fields}).n_cmpl == n_cmpl


def test_up_to_64_stop_strings_are_accepted_and_65_refused():
    assert len(InfillRequest.model_validate({**BASE, "stop": [f"s{i}" for i in range(64)]}).stops()) == 64
    with pytest.raises(ValidationError, match="at most 64"):
        InfillRequest.model_validate({**BASE, "stop": [f"s{i}" for i in range(65)]})


@pytest.mark.parametrize("field", [{"typical_p": 0.9}, {"mirostat": 2}, {"grammar": "root ::= \"x\""}, {"n_probs": 3},
                                   {"logit_bias": [[15043, 1.0]]}, {"ignore_eos": True},
                                   {"return_tokens": True}, {"repeat_penalty": 1.2, "repeat_last_n": 128},
                                   {"logprobs": 3}])
def test_options_that_would_change_the_answer_are_refused_by_name(field):
    with pytest.raises(ValidationError) as e:
        InfillRequest.model_validate({**BASE, **field})
    name = next(k for k in field if k != "repeat_penalty")
    assert name in str(e.value) and "not supported" in str(e.value)


@pytest.mark.parametrize("field", [{"typical_p": 1.0}, {"mirostat": 0}, {"grammar": ""}, {"n_probs": 0}, {"logit_bias": []},
                                   {"samplers": [], "n_predict": 0}, {"repeat_last_n": 256}, {"repeat_penalty": 1.1, "repeat_last_n": 64},
                                   {"cache_prompt": False, "id_slot": 0, "t_max_prompt_ms": 100}])
def test_the_same_options_at_their_neutral_value_are_accepted(field):
    InfillRequest.model_validate({**BASE, **field})


@pytest.mark.parametrize("field", [{"n_predict": "128"}, {"n_predict": True}, {"stream": "true"}, {"top_p": "0.9"},
                                   {"cache_prompt": 1}, {"n_indent": 4.5}, {"t_max_predict_ms": "1000"}])
def test_a_value_of_another_json_type_is_refused_by_name_as_llama_server_refuses_it(field):
    # llama-server reads its fields with nlohmann json, which throws "type must be number"
    with pytest.raises(ValidationError, match=next(iter(field))):
        InfillRequest.model_validate({**BASE, **field})


def test_numbers_written_as_floats_or_integers_are_accepted():
    r = InfillRequest.model_validate({**BASE, "n_predict": 16.0, "temperature": 0, "top_p": 1})
    assert r.n_predict == 16 and r.temperature == 0.0


def test_prefix_and_suffix_are_required_as_in_llama_cpp():
    for missing in ("input_prefix", "input_suffix"):
        with pytest.raises(ValidationError, match=missing):
            InfillRequest.model_validate({k: v for k, v in BASE.items() if k != missing})


def test_an_extra_chunk_needs_text_and_its_filename_defaults_to_tmp():
    assert InfillRequest.model_validate({**BASE, "input_extra": [{"text": "x"}]}).input_extra[0].filename == "tmp"
    with pytest.raises(ValidationError):
        InfillRequest.model_validate({**BASE, "input_extra": [{"filename": "a.py"}]})


# -- the two stops editors ask for ------------------------------------------------------------------


def feed(cutoff: Cutoff, *deltas: str) -> str:
    return "".join(cutoff.push(d) for d in deltas)


def test_n_indent_cuts_before_the_first_later_line_left_of_the_indent():
    c = Cutoff(n_indent=4)
    kept = feed(c, "x = 1\n", "    y = 2\n", "z = 3\n", "never")
    assert kept == "x = 1\n    y = 2\n" and c.hit and c.text == kept


def test_n_indent_never_cuts_the_first_line_and_waits_for_a_lines_first_character():
    c = Cutoff(n_indent=4)
    assert feed(c, "a", "\n", "  ") == "a\n  " and not c.hit  # two blanks so far: not yet known
    assert feed(c, "  b") == "  b" and not c.hit  # four: deep enough


def test_n_indent_cut_keeps_the_blanks_before_the_character_as_llama_cpp_does():
    c = Cutoff(n_indent=8)
    assert feed(c, "a\n    return 1") == "a\n    " and c.hit


def test_n_indent_treats_a_blank_line_as_the_end_of_the_block_as_llama_cpp_does():
    c = Cutoff(n_indent=4)
    assert feed(c, "a\n", "\n    b") == "a\n" and c.hit


def test_a_cut_inside_one_delta_of_several_lines_keeps_what_comes_before_it():
    c = Cutoff(n_indent=2)
    assert feed(c, "a\n  b\n  c\nd\n  e") == "a\n  b\n  c\n" and c.hit


def test_t_max_predict_ms_ends_the_answer_only_after_a_newline():
    now = [0.0]
    c = Cutoff(t_max_predict_ms=100, clock=lambda: now[0])
    feed(c, "a")
    now[0] = 5.0
    assert feed(c, "b") == "b" and not c.hit  # late, but still on the first line
    assert feed(c, "\nc") == "\nc" and c.hit
    assert feed(c, "more") == ""


def test_without_limits_nothing_is_cut():
    c = Cutoff()
    assert feed(c, "a\n", "b\n", "\n", "c") == "a\nb\n\nc" and not c.hit


# -- the answer --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("finish", "word", "cut", "expected"), [
    ("stop", None, False, "eos"), ("stop", "\n\n", False, "word"), ("length", None, False, "limit"),
    ("context", None, False, "limit"), ("cancelled", None, True, "limit"),
])
def test_stop_type_tells_eos_from_a_stop_word_from_a_limit(finish, word, cut, expected):
    assert stop_type(finish, word, cut) == expected


def test_timings_count_only_the_prompt_tokens_evaluated_now_and_report_drafts():
    st = GenerationStats(prompt_tokens=100, cached_tokens=60, completion_tokens=11, prefill_s=0.4, total_s=1.4,
                         proposed=8, accepted=6)
    t = timings(st, wall_s=9.0)
    assert t["prompt_n"] == 40 and t["cache_n"] == 60 and t["prompt_ms"] == pytest.approx(400)
    assert t["predicted_n"] == 11 and t["predicted_ms"] == pytest.approx(1000) and t["predicted_per_second"] == pytest.approx(11)
    assert (t["draft_n"], t["draft_n_accepted"]) == (8, 6)
    stopped = timings(GenerationStats(prompt_tokens=5, completion_tokens=2, prefill_s=0.5), wall_s=1.5)  # cancelled: no total_s
    assert stopped["predicted_ms"] == pytest.approx(1000) and "draft_n" not in stopped


def test_response_fields_keep_the_named_fields_and_unnest_paths():
    body = {"content": "x", "timings": {"prompt_n": 3}, "stop": True}
    assert select_fields(body, ["content", "timings/prompt_n", "missing", "content/x"]) == {"content": "x", "timings/prompt_n": 3}
