"""costs: the most speculation can give on a measured cost curve, and pricing and acceptance
as the controller reads them (pure arithmetic)."""

from __future__ import annotations

import numpy as np
import pytest

from homespec.speculation.costs import AcceptanceModel, CostModel, NearTieModel, ceiling


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


def test_pricing_many_pass_sizes_at_once_gives_each_sizes_own_price():
    # The controller prices every draft length in one array call; beside other requests' rows,
    # and past the measured sizes (the linear extension), each must equal its one-size price.
    cost = CostModel(n_max=17, alpha=0.1)
    cost.set_verify({1: 0.040, 2: 0.066, 5: 0.156, 9: 0.270, 17: 0.346})  # seconds
    cost.observe_verify(5, 0.170)  # the pace has moved since calibration
    sizes = np.arange(1, 30)
    for alongside in (0, 3, 14):
        at_once = cost.added(sizes, alongside)  # [29] seconds
        assert at_once.shape == sizes.shape
        assert at_once.tolist() == pytest.approx([cost.added(int(n), alongside) for n in sizes], rel=1e-12)
    assert isinstance(cost.verify(3), float) and isinstance(cost.added(3, 2), float)


def test_acceptance_rates_follow_each_new_observation_of_their_key():
    acc = AcceptanceModel(k_max=4, alpha=0.1, prior=0.5)
    before = acc.rates("ngram").copy()
    assert not acc.rates("ngram").flags.writeable  # shared between reads: no caller may edit it
    acc.observe("ngram", [True, True, True, True])
    after = acc.rates("ngram")
    assert (after > before).all()
    acc.observe("draft", [False])  # another key's outcomes leave this one's rates alone
    assert acc.rates("ngram") is after


def test_no_position_of_a_pooled_key_falls_below_its_rate_over_every_position_it_tested():
    # One answer said again left the remembered one at its 8th token; three drafts of 4 kept
    # whole since. Per position, a_8 stays at its one failure, untested by the short drafts.
    acc = AcceptanceModel(k_max=32, alpha=0.1, prior=0.97, pooled=lambda key: key == "repeat")
    for key in ("repeat", "phrase"):
        acc.observe(key, [True] * 7 + [False])
        for _ in range(3):
            acc.observe(key, [True] * 4)
    pooled, per_position = acc.rates("repeat"), acc.rates("phrase")
    # every step's counts decay by alpha per later step; the prior weighs SHRINK outcomes
    accepted, tested = 7 * 0.9**3 + 4 * (0.9**2 + 0.9 + 1), 8 * 0.9**3 + 4 * (0.9**2 + 0.9 + 1)
    floor = (accepted + 2 * 0.97) / (tested + 2)
    assert per_position[7] < 0.7 < floor
    assert pooled[7:] == pytest.approx(floor)  # the failed position and those never tested
    assert pooled[:4].tolist() == per_position[:4].tolist()  # where a position's own record says more, it decides


def test_a_near_tie_is_given_again_less_often_than_a_clear_lead_until_seen_otherwise() -> None:
    gaps = np.array([0.01, 0.07, 0.15, 0.3, 0.6, 3.0, np.inf], np.float32)
    before = NearTieModel().keep(gaps)
    assert np.all(np.diff(before) >= 0) and before[0] < 0.6 and before[-2] == 1.0
    assert before[-1] == before[-2]  # a forced token: nothing else was allowed
    exact = NearTieModel()
    for _ in range(30):  # passes that flip nothing (exact mode): coin tosses are given again too
        exact.observe(np.array([0.01, 0.01, 3.0], np.float32), [True, True, True])
    assert exact.keep(gaps)[0] > 0.9
    noisy = NearTieModel()
    for _ in range(30):  # and where they flip more often than measured here, the estimate follows
        noisy.observe(np.array([0.01, 3.0], np.float32), [False])
    assert noisy.keep(gaps)[0] < 0.3 and noisy.keep(gaps)[-1] == before[-1]


def test_a_lag_is_priced_beyond_what_a_step_reads_anyway() -> None:
    c = CostModel(17, 0.05)
    c.set_verify({1: 0.03, 17: 0.17})
    c.catchup_s["draft"] = 0.003  # seconds a missed token (the 0.5B Q4_0 draft: ~3 ms at any lag)
    assert c.catchup("draft", 3, base=2) == pytest.approx(0.003)  # a step's first pass reads 2 anyway
    assert c.catchup("draft", 2, base=2) == 0.0
    assert c.catchup("draft", 300) == pytest.approx(0.9)  # a prompt it never read
