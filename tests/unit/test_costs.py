"""costs.ceiling: the most speculation can give on a measured cost curve (pure arithmetic)."""

from __future__ import annotations

import pytest

from homespec.speculation.costs import ceiling


def test_on_a_flat_gpu_like_curve_the_ceiling_is_the_longest_draft_accepted_whole():
    curve = {n: 0.020 * (1 + 0.01 * (n - 1)) for n in (1, 2, 5, 9, 17)}  # seconds
    k, gain = ceiling(curve)
    assert k == 16 and gain == pytest.approx(17 / 1.16)


def test_when_a_pass_costs_as_much_as_its_tokens_decoded_one_by_one_nothing_pays():
    assert ceiling({1: 0.08, 2: 0.16, 5: 0.40, 17: 1.36}) == (0, 1.0)


def test_a_proposers_cost_per_token_lowers_the_ceiling_and_can_switch_speculation_off():
    # The 2-core AVX2 curve of one bench run (seconds) and the 0.5B draft model's 42 ms a token.
    curve = {1: 0.081, 2: 0.126, 3: 0.168, 5: 0.272, 9: 0.603, 17: 0.881}
    k, free = ceiling(curve)
    assert k == 16 and free == pytest.approx(17 * 0.081 / 0.881)
    k, drafted = ceiling(curve, propose_s=0.010)  # a head at ~1/8 of a pass
    assert k == 16 and drafted == pytest.approx(17 * 0.081 / (0.881 + 16 * 0.010)) and drafted < free
    assert ceiling(curve, propose_s=0.042) == (0, 1.0)
