"""llama.cpp's infill sampler (homespec/speculation/infill_sampler.py) on hand-made distributions,
each expected value worked out from llama.cpp's `llama_sampler_infill_apply` by hand."""

from __future__ import annotations

import numpy as np
import pytest

from homespec.speculation.infill_sampler import InfillVocab
from homespec.speculation.sampling import SamplingParams, probabilities

EOT, EOS = 8, 9
PIECES = {0: b"re", 1: b"return", 2: b"x", 3: b"y", 4: b"ret", 5: b"z", 6: b"w", 7: b"", EOT: b"", EOS: b""}
VOCAB = InfillVocab(piece=PIECES.__getitem__, is_eog=lambda t: t in (EOT, EOS), eot=EOT)


def dist(**mass: float) -> np.ndarray:
    """A [10] distribution from {"t<id>": p}."""
    p = np.zeros(10)
    for name, v in mass.items():
        p[int(name[1:])] = v
    return p


def infill_cut(p: np.ndarray, vocab: InfillVocab) -> np.ndarray:
    """The distribution llama.cpp draws from after top-k leaves p's support and infill cuts it,
    through homespec's one transform (sampling.probabilities)."""
    with np.errstate(divide="ignore"):
        logits = np.log(p)  # [10]; -inf outside the support
    return probabilities(logits, SamplingParams(temperature=1.0, top_k=int(np.count_nonzero(p)), infill=vocab))


def test_enough_end_of_text_mass_keeps_only_the_end_tokens():
    # 3 x p_eog (0.15) x 4 candidates = 1.8 > p_txt (0.85): end the completion, by the end tokens' own odds.
    out = infill_cut(dist(t0=0.5, t2=0.35, t8=0.1, t9=0.05), VOCAB)
    assert out == pytest.approx(dist(t8=2 / 3, t9=1 / 3))


def test_a_token_that_begins_another_merges_into_the_likelier_and_the_draw_keeps_the_original_odds():
    # "re" (0.30) takes "return" (0.25): merged 0.55; "x" 0.28 stays, "y" 0.17 < 0.2 goes.
    # Renormalised 0.663 / 0.337, both above 1/3; the draw then uses the two tokens' own masses.
    out = infill_cut(dist(t0=0.30, t2=0.28, t1=0.25, t3=0.17), VOCAB)
    assert out == pytest.approx(dist(t0=0.30 / 0.58, t2=0.28 / 0.58))


def test_the_longer_token_wins_the_merge_when_it_is_likelier():
    # "return" (0.40) takes "re" (0.10) and then "ret" (0.15): 0.65, alone above the cuts with "x".
    out = infill_cut(dist(t1=0.40, t2=0.35, t4=0.15, t0=0.10), VOCAB)
    assert out == pytest.approx(dist(t1=0.40 / 0.75, t2=0.35 / 0.75))


def test_the_second_cut_drops_text_below_one_over_the_kept_count_plus_one():
    # No merges. 0.44, 0.30, 0.26 all pass 0.2 and then 1/4: all stay.
    assert infill_cut(dist(t2=0.44, t3=0.30, t5=0.26), VOCAB) == pytest.approx(dist(t2=0.44, t3=0.30, t5=0.26))
    # 0.6 and 0.21 pass 0.2 (0.19 does not), renormalised 0.74 and 0.26: 0.26 < 1/3 goes.
    assert infill_cut(dist(t2=0.6, t3=0.21, t5=0.19), VOCAB) == pytest.approx(dist(t2=1.0))


def test_when_no_text_token_is_likely_enough_the_answer_ends():
    # Six tokens of 1/6, none the beginning of another, none an end token: none reaches 0.2.
    out = infill_cut(dist(t2=1 / 6, t3=1 / 6, t4=1 / 6, t5=1 / 6, t6=1 / 6, t7=1 / 6), VOCAB)
    assert out == pytest.approx(dist(t8=1.0))


def test_a_control_token_merges_with_nothing():
    # Token 7 renders as b"": not a prefix of every other token (llama.cpp needs len > 0).
    out = infill_cut(dist(t7=0.5, t2=0.5), VOCAB)
    assert out == pytest.approx(dist(t7=0.5, t2=0.5))


def test_infill_ends_the_chain_and_leaves_greedy_alone():
    logits = np.log(dist(t0=0.30, t2=0.28, t1=0.25, t3=0.17) + 1e-12)
    sampled = probabilities(logits, SamplingParams(temperature=1.0, top_k=4, infill=VOCAB))
    assert sampled == pytest.approx(dist(t0=0.30 / 0.58, t2=0.28 / 0.58), abs=1e-9)
    greedy = probabilities(logits, SamplingParams(temperature=0.0, infill=VOCAB))
    assert int(np.argmax(greedy)) == 0 and greedy.sum() == 1.0


def test_candidates_a_grammar_ruled_out_neither_count_nor_merge():
    # A grammar leaves 3 tokens of 152k; top_k 40 then keeps every tie at -inf. llama.cpp's sampler
    # treats those as dead: the end-token test counts 3 candidates, not 152k (and it stays fast).
    logits = np.full(152_000, -np.inf)
    logits[[2, 3, EOT]] = np.log([0.6, 0.35, 0.05])
    vocab = InfillVocab(piece=lambda t: PIECES.get(t, b"tok%d" % t), is_eog=lambda t: t == EOT, eot=EOT)
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=40, order=("top_k", "infill"), infill=vocab))
    # 3 x 0.05 x 3 = 0.45 < 0.95: the text stays ("x" and "y" pass both cuts, the end token too);
    # counted over 152k candidates, the end token alone would be kept
    assert set(np.flatnonzero(p)) == {2, 3, EOT}
