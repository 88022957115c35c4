"""The controller replayed over recorded greedy outputs of the real target (no weights needed):
issue 3's bars, checked on modelled step costs instead of a noisy clock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from homespec.config import ControllerConfig
from homespec.speculation.controller import Controller
from homespec.speculation.engine import FixedPolicy
from homespec.speculation.proposers.ngram import NgramProposer
from homespec.speculation.replay import Recording, by_evidence, compare, load_recordings, oracle, pass_cost, replay

DATA = Path(__file__).resolve().parent.parent / "data"
K_MAX = 16


def measured_cpu_cost():
    """Target pass cost over n tokens as calibrated on the 2-core development machine."""
    samples = {int(n): s for n, s in json.loads((DATA / "cpu_pass_costs.json").read_text()).items()}
    return samples, pass_cost(samples)


def gpu_cost():
    samples = {n: 0.020 * (1 + 0.01 * (n - 1)) for n in range(1, K_MAX + 2)}  # memory-bound: nearly flat
    return samples, lambda n: samples[n]


def controller_for(samples):
    def make(ngram: NgramProposer) -> Controller:
        c = Controller([ngram], ControllerConfig(), k_max=K_MAX)
        c.cost.set_verify(samples)
        return c

    return make


def test_replayed_plain_decoding_costs_one_pass_per_token():
    rec = Recording(prompt=[1, 2, 3], output=[4, 5, 6, 7])
    r = replay([rec], FixedPolicy(), NgramProposer(2, 4), lambda n: 0.1 * n)
    assert r.emitted == 3 and r.verify_s == pytest.approx(0.3) and r.by_choice == {"off:0": 3}


def test_a_replayed_copy_of_the_prompt_is_accepted_in_long_steps():
    text = list(range(10, 40))
    rec = Recording(prompt=[1, *text, 2], output=text)
    r = replay([rec], FixedPolicy(ngram := NgramProposer(2, 4), 8), ngram, lambda n: 0.1)
    assert r.emitted == len(text) - 1
    assert r.by_choice.get("ngram:8", 0) >= 3 and r.steps <= 6


@pytest.fixture(scope="module")
def recorded() -> dict[str, list[Recording]]:
    return load_recordings(DATA / "greedy_outputs.json")


def test_on_a_cpu_auto_never_loses_to_plain_and_keeps_up_with_the_best_fixed_ngram_k(recorded):
    samples, cost = measured_cpu_cost()
    table = compare(recorded, controller_for(samples), cost)
    auto = table.pop("auto")  # the worst over the workload orders
    for w in recorded:
        best = max([1.0, *(row[w] for row in table.values())])
        assert auto[w] >= 0.97, f"{w}: auto {auto[w]:.3f}x plain"
        assert auto[w] >= 0.95 * best, f"{w}: auto {auto[w]:.3f}x, best fixed arm {best:.3f}x"
    assert auto["edit"] >= 1.6


def test_on_a_gpu_like_flat_cost_auto_speculates_everywhere_and_keeps_up_with_the_best_k(recorded):
    samples, cost = gpu_cost()
    table = compare(recorded, controller_for(samples), cost)
    auto = table.pop("auto")
    for w in recorded:
        best = max(row[w] for row in table.values())
        assert auto[w] > 1.05 and auto[w] >= 0.95 * best, f"{w}: auto {auto[w]:.3f}x, best fixed {best:.3f}x"


def test_the_oracle_takes_a_copy_of_the_prompt_in_one_step_and_new_text_one_token_at_a_time():
    text = list(range(10, 40))
    copy = Recording(prompt=[1, *text, 2], output=text)
    fresh = Recording(prompt=[1, 2, 3], output=list(range(50, 80)))
    step = lambda n: 0.1 + 0.01 * n  # noqa: E731  # seconds: nearly flat, so whole copies pay
    r = oracle([copy], NgramProposer(2, 4), step, k_max=len(text))
    assert r.emitted == len(text) - 1 and r.steps == 2 and r.accepted == len(text) - 3  # the first lookups need 2 tokens
    r = oracle([fresh], NgramProposer(2, 4), step, k_max=16)
    assert r.by_choice == {"off:0": len(fresh.output) - 1}


def test_the_oracle_drafts_nothing_where_a_pass_costs_its_tokens_decoded_one_by_one():
    text = list(range(10, 40))
    r = oracle([Recording(prompt=[1, *text, 2], output=text)], NgramProposer(2, 4), lambda n: 0.1 * n, k_max=16)
    assert r.proposed == 0 and r.emitted == len(text) - 1


def test_steps_by_evidence_sum_what_each_kind_of_match_drafted_kept_and_saved():
    text = list(range(10, 40))
    copy = Recording(prompt=[1, *text, 2], output=[*text[:12], 99, 98, *text[12:20]])  # leaves the copy once
    step = lambda n: 0.1 + 0.01 * n  # noqa: E731  # seconds
    steps: list = []
    total = replay([copy], FixedPolicy(ngram := NgramProposer(2, 4), 4), ngram, step, steps)
    tallies = by_evidence(steps, step)
    assert all(e.from_prompt for e in tallies)  # every match is into the prompt
    drafting = [s for s in steps if s.proposed]
    assert sum(t.steps for t in tallies.values()) == len(drafting) == total.spec_steps
    assert sum(t.accepted for t in tallies.values()) == total.accepted
    assert sum(t.first_kept for t in tallies.values()) == sum(s.accepted > 0 for s in drafting) < len(drafting)
    saved = sum((s.accepted + 1) * step(1) - step(s.proposed + 1) for s in drafting)  # against one pass a token
    assert sum(t.saved_s for t in tallies.values()) == pytest.approx(saved)
