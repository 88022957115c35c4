"""The shared logits -> probabilities transform."""

from __future__ import annotations

import numpy as np
import pytest

from homespec.speculation.sampling import (
    SamplingParams,
    argmax_gaps,
    choose,
    penalize,
    probabilities,
    sample,
    target_view,
    token_logprobs,
    window,
    with_logit_bias,
)


def test_temperature_zero_is_argmax_point_mass():
    z = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    p = probabilities(z, SamplingParams(temperature=0))
    assert p.tolist() == [0, 1, 0, 0]


def test_temperature_one_is_softmax():
    z = np.array([1.0, 2.0, 3.0])
    p = probabilities(z, SamplingParams(temperature=1.0))
    e = np.exp(z - 3)
    assert np.allclose(p, e / e.sum())


def test_lower_temperature_sharpens_distribution():
    z = np.array([1.0, 2.0, 3.0])
    hot = probabilities(z, SamplingParams(temperature=2.0))
    cold = probabilities(z, SamplingParams(temperature=0.5))
    assert cold[2] > hot[2] and cold[0] < hot[0]


def test_top_k_keeps_exactly_k_most_likely():
    z = np.array([5.0, 1.0, 4.0, 3.0, 2.0])
    p = probabilities(z, SamplingParams(temperature=1.0, top_k=2))
    assert set(np.flatnonzero(p)) == {0, 2}
    assert p.sum() == pytest.approx(1.0)


def test_top_p_keeps_smallest_nucleus_reaching_mass():
    p0 = np.array([0.5, 0.3, 0.15, 0.05])
    z = np.log(p0)
    p = probabilities(z, SamplingParams(temperature=1.0, top_p=0.8))
    assert set(np.flatnonzero(p)) == {0, 1}  # 0.5 + 0.3 reaches 0.8
    p = probabilities(z, SamplingParams(temperature=1.0, top_p=0.81))
    assert set(np.flatnonzero(p)) == {0, 1, 2}


def test_top_p_zero_keeps_only_the_likeliest_token():
    """As llama.cpp's top-p keeps at least one token: some UIs send 0 for "no randomness"."""
    p = probabilities(np.log(np.array([0.2, 0.5, 0.3])), SamplingParams(temperature=1.0, top_p=0.0))
    assert p.tolist() == [0.0, 1.0, 0.0]


def test_top_p_on_large_vocab_matches_full_sort():
    rng = np.random.default_rng(0)
    z = rng.normal(size=50_000) * 0.3  # flat: the nucleus is far beyond the first candidate set
    p = probabilities(z, SamplingParams(temperature=1.0, top_p=0.9))
    full = np.exp(z - z.max())
    full /= full.sum()
    order = np.argsort(-full)
    n_keep = int(np.searchsorted(np.cumsum(full[order]), 0.9)) + 1
    assert set(np.flatnonzero(p)) == set(order[:n_keep])


def test_llama_cpps_order_cuts_before_tempering_and_the_default_after():
    z = np.log(np.array([0.6, 0.3, 0.1]))
    # Tempered first (Hugging Face): 0.473, 0.334, 0.193 -> the nucleus of 0.85 needs all three.
    hf = probabilities(z, SamplingParams(temperature=2.0, top_p=0.85))
    assert hf == pytest.approx(np.sqrt([0.6, 0.3, 0.1]) / np.sqrt([0.6, 0.3, 0.1]).sum())
    # Cut first (llama.cpp's default order): 0.6 + 0.3 reach 0.85; then the two are tempered.
    ll = probabilities(z, SamplingParams(temperature=2.0, top_p=0.85, order=("top_p", "temperature")))
    assert ll == pytest.approx(np.array([np.sqrt(0.6), np.sqrt(0.3), 0.0]) / (np.sqrt(0.6) + np.sqrt(0.3)))


def test_a_step_left_out_of_the_order_does_nothing():
    z = np.log(np.array([0.6, 0.3, 0.1]))
    assert probabilities(z, SamplingParams(temperature=1.0, top_k=1, order=("top_p",))) == pytest.approx([0.6, 0.3, 0.1])


@pytest.mark.parametrize(("fields", "name"), [({"order": ("top_k", "top_k")}, "order"), ({"order": ("mirostat",)}, "order"),
                                              ({"temperature": 0.5, "order": ("top_k",)}, "temperature")])
def test_an_order_with_a_step_twice_an_unknown_step_or_an_unused_temperature_is_refused(fields, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**fields)


def test_min_p_drops_tokens_below_fraction_of_top():
    p0 = np.array([0.6, 0.3, 0.06, 0.04])
    p = probabilities(np.log(p0), SamplingParams(temperature=1.0, min_p=0.1))
    assert set(np.flatnonzero(p)) == {0, 1}


def test_repetition_penalty_lowers_recent_tokens_whatever_the_sign():
    z = np.array([2.0, -2.0, 1.0], dtype=np.float32)
    out = penalize(z, SamplingParams(repetition_penalty=2.0), [0, 1])
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_presence_and_frequency_penalties_follow_openai_definition():
    z = np.zeros(3, dtype=np.float32)
    out = penalize(z, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [1, 1, 1, 2])
    assert out.tolist() == pytest.approx([0.0, -0.5 - 0.75, -0.5 - 0.25])


def test_penalties_only_see_the_last_n_tokens():
    z = np.array([1.0, 0.0, 0.0, 0.0], dtype=np.float32)  # token 0 wins unless it is penalised
    params = SamplingParams(presence_penalty=2.0, penalty_last_n=2)
    ctx = [0, 0, 1, 2]  # 0 only before the window
    rng = np.random.default_rng(0)
    assert list(window(ctx, params)) == [1, 2]
    assert choose(z, params, window(ctx, params), rng) == 0  # plain decoding: 0 not penalised
    assert choose(z, params, ctx, rng) != 0  # the control: seen, it loses
    # the verifier's rows: the window slides over the drafted tokens too
    view = target_view(np.stack([z, z]), params, context=ctx, continuation=[0])
    assert view[0] == 0 and view[1] != 0  # row 1's window is [2, 0]


def test_target_view_applies_penalties_with_proposed_tokens_in_history():
    logits = np.zeros((3, 4), dtype=np.float32)
    logits[:, 1] = 1.0  # token 1 is the plain argmax everywhere
    params = SamplingParams(presence_penalty=2.0)
    view = target_view(logits, params, context=[0], continuation=[1, 2])
    # Row 0 has not seen token 1; rows 1 and 2 have (it was proposed), so it loses there.
    assert view[0] == 1 and view[1] != 1 and view[2] != 1


def test_sample_never_draws_a_zero_probability_token():
    rng = np.random.default_rng(5)
    p = np.array([0.0, 0.5, 0.0, 0.5])
    draws = {sample(p, rng) for _ in range(2000)}
    assert draws == {1, 3}


@pytest.mark.parametrize("field, value", [("temperature", -1), ("top_p", -0.1), ("top_p", 1.5), ("min_p", 2.0), ("top_k", -1)])
def test_out_of_range_parameters_are_refused_with_their_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


# -- logit_bias ------------------------------------------------------------------------------------


def test_logit_bias_adds_to_the_named_logits_before_the_penalties():
    z = np.array([2.0, 1.0, 0.0], dtype=np.float32)
    params = with_logit_bias(SamplingParams(repetition_penalty=2.0), {2: 3.0, 0: -1.0})
    # token 0: (2 - 1) / 2 (seen, penalised after the bias); token 2: 0 + 3, not seen
    assert penalize(z, params, [0]).tolist() == [0.5, 1.0, 3.0]
    assert z.tolist() == [2.0, 1.0, 0.0]  # the model's row is not modified in place


def test_logit_bias_minus_100_bans_the_greedy_token():
    logits = np.array([[0.0, 9.0, 8.5, 1.0]] * 3, dtype=np.float32)  # token 1 is the argmax
    banned = with_logit_bias(SamplingParams(), {1: -100})
    # target_view's fast path (argmax of the raw rows) must not be taken with a bias
    assert target_view(logits, SamplingParams(), [0], [2, 2]).tolist() == [1, 1, 1]
    assert target_view(logits, banned, [0], [2, 2]).tolist() == [2, 2, 2]
    assert choose(logits[0], banned, [], np.random.default_rng(0)) == 2  # and the first token
    assert choose(logits[0], with_logit_bias(SamplingParams(), {3: 100}), [], np.random.default_rng(0)) == 3


def test_logit_bias_minus_100_bans_the_token_when_sampling():
    z = np.array([0.0, 3.0, 2.0, 1.0])
    p = probabilities(penalize(z, with_logit_bias(SamplingParams(temperature=1.0), {1: -100}), []), SamplingParams(temperature=1.0))
    assert p[1] < 1e-40 and p.sum() == pytest.approx(1.0)


def test_logit_bias_ids_beyond_a_shorter_draft_vocab_are_skipped():
    z = np.zeros(4, dtype=np.float32)
    assert penalize(z, with_logit_bias(SamplingParams(), {2: 1.0, 6: 5.0}), []).tolist() == [0, 0, 1, 0]


@pytest.mark.parametrize("bias", [{0: 100.5}, {0: -101}, {-1: 1.0}])
def test_a_bias_beyond_100_or_a_negative_id_is_refused(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        with_logit_bias(SamplingParams(), bias)


# -- logprobs --------------------------------------------------------------------------------------


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    return z - np.log(np.exp(z - z.max()).sum()) - z.max()


def test_token_logprobs_are_the_log_softmax_of_the_biased_rows_without_temperature_or_truncation():
    rows = np.array([[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 3.0, 1.0]], dtype=np.float32)
    bias = {0: 1.5}
    plain = token_logprobs(rows, with_logit_bias(SamplingParams(), bias), [3], [1, 2], top=2)
    hot = token_logprobs(rows, with_logit_bias(SamplingParams(temperature=0.3, top_k=1, top_p=0.5), bias), [3], [1, 2], top=2)
    assert plain == hot  # temperature and truncation shape the draw, not the reported logprobs
    want0 = _log_softmax(rows[0] + np.array([1.5, 0, 0, 0]))
    assert plain[0].token == 1 and plain[0].logprob == pytest.approx(want0[1])
    assert [t for t, _ in plain[0].top] == [0, 1]  # 2.5 then 2.0: likeliest first
    assert plain[0].top[0][1] == pytest.approx(want0[0])
    assert plain[1].logprob == pytest.approx(_log_softmax(rows[1] + np.array([1.5, 0, 0, 0]))[2])


def test_token_logprobs_see_the_tokens_before_them_in_the_penalty_window():
    rows = np.zeros((2, 3), dtype=np.float32)
    params = SamplingParams(presence_penalty=1.0)
    lps = token_logprobs(rows, params, [0], [1, 1], top=0)
    # row 0 penalises token 0 (the context); row 1 also token 1 (emitted just before it)
    assert lps[0].logprob == pytest.approx(_log_softmax(np.array([-1.0, 0, 0]))[1])
    assert lps[1].logprob == pytest.approx(_log_softmax(np.array([-1.0, -1.0, 0]))[1])
    assert lps[1].top == ()


def test_argmax_gap_is_each_tokens_lead_over_the_runner_up_and_leaves_the_rows_as_they_were() -> None:
    rows = np.array([[0.0, 2.5, 2.0, -1.0], [1.0, -np.inf, -np.inf, -np.inf], [3.0, 3.0, 0.0, 0.0]], np.float32)
    before = rows.copy()
    gaps = argmax_gaps(rows, [1, 0, 0])
    assert gaps.tolist() == [0.5, np.inf, 0.0]  # a grammar's forced token: nothing else allowed
    assert np.array_equal(rows, before)
    read_only = before.copy()
    read_only.flags.writeable = False
    assert argmax_gaps(read_only, [1, 0]).tolist() == [0.5, np.inf]
