"""A new proposer plugs in through the Proposer protocol alone: registered with the controller,
chosen on its measured merit, verified exactly — with no change to the controller."""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence

import numpy as np

from homespec.config import ControllerConfig
from homespec.speculation.controller import Controller
from homespec.speculation.engine import Engine, FixedPolicy, GenerationStats
from homespec.speculation.proposers.base import Preview, Proposal, Proposer, ProposerCost
from homespec.speculation.proposers.draft import DraftProposer
from homespec.speculation.proposers.mtp import MTPProposer
from homespec.speculation.proposers.ngram import NgramProposer
from homespec.speculation.sampling import SamplingParams

from .fakes import FakeRuntime

PROMPT = [5, 9, 2, 7, 3, 8]


class RepeatLast:
    """Guesses that the last token repeats k times: the whole proposer, one class."""

    name = "repeat"
    free_prefill = True

    def begin(self, prompt: Sequence[int], shaping: Hashable = ()) -> None:
        pass

    def preview(self, context: Sequence[int], k: int) -> Preview:
        return Preview(k)

    def lag(self, context: Sequence[int]) -> int:
        return 0

    def end(self, context: Sequence[int], gaps: Sequence[float] = ()) -> None:
        pass

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Proposal:
        t0 = time.perf_counter()
        return Proposal([context[-1]] * k, None, time.perf_counter() - t0)

    def measure_cost(self, context: Sequence[int], probe: Sequence[int], passes: int) -> ProposerCost | None:
        return None

    def close(self) -> None:
        pass


class Stutter(FakeRuntime):
    """A target that mostly repeats its last token: after token t, t stays the argmax unless
    t % 5 == 0 (then the scripted logits decide), so repeat-last guesses are often right."""

    def logits_after(self, context: Sequence[int]) -> np.ndarray:  # [vocab]
        z = super().logits_after(context)
        if context[-1] % 5:
            z[context[-1]] = z.max() + 1.0
        return z


def run(engine: Engine, policy, max_tokens: int = 60) -> tuple[list[int], GenerationStats]:
    engine.target.reset()
    st = GenerationStats()
    out = [t for ev in engine.generate(PROMPT, max_tokens=max_tokens, policy=policy, stats=st) for t in ev.tokens]
    return out, st


def test_every_shipped_proposer_and_a_new_one_satisfy_the_protocol():
    for cls in (NgramProposer, DraftProposer, MTPProposer, RepeatLast):
        missing = [m for m in ("begin", "preview", "lag", "propose", "measure_cost", "close") if not callable(getattr(cls, m, None))]
        assert not missing, f"{cls.__name__} lacks {missing}"
        assert hasattr(cls, "name") and hasattr(cls, "free_prefill")
    assert isinstance(RepeatLast(), Proposer)


def test_a_new_proposer_is_chosen_by_the_controller_on_merit_and_keeps_greedy_output_exact():
    engine = Engine(Stutter(vocab=32, n_ctx=512))
    plain, _ = run(engine, FixedPolicy())
    controller = Controller([RepeatLast()], ControllerConfig(), k_max=8)
    # A GPU-like flat cost curve: verifying 8 guesses costs about what one token does.
    controller.calibrate(lambda n: 0.02 * (1 + 0.01 * (n - 1)), passes=1)
    out, st = run(engine, controller)
    assert out == plain  # exact: every emitted token is the target's argmax
    assert any(choice.startswith("repeat:") for choice in st.by_choice)
    assert st.accepted > 0 and st.acceptance_length > 1.5
    assert controller.view.gains["repeat"]  # the view shows it like any other proposer


def test_a_removed_proposer_is_no_longer_chosen_and_comes_back_with_its_costs():
    controller = Controller([RepeatLast()], ControllerConfig(), k_max=8)
    controller.calibrate(lambda n: 0.02, passes=1)
    controller.set_proposer_cost("repeat", 0.001)
    removed = controller.remove_proposer("repeat")
    assert controller.decide(PROMPT).proposer is None
    controller.add_proposer(removed)
    assert controller.cost.propose("repeat", 1) == 0.001  # measured costs are kept
    assert controller.decide(PROMPT).name == "repeat"
