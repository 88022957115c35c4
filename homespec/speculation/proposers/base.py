"""The proposer role: one protocol shared by draft, ngram and mtp (and any proposer to come).

A proposer sees the committed context (prompt + output so far, the last token not yet verified
by the target) and returns up to k guessed continuation tokens. It never decides what is
emitted: the verifier does. Its state (a KV cache, an index) follows the context it is shown.

The controller names no proposer: everything it needs to choose one comes through this protocol
— `preview` (how many tokens it could offer now, and under which evidence its acceptance is
learned), `lag` (what using it now would first cost in catching up), `measure_cost` (warm-up
timing) and the typed `ProposalInfo` of each proposal. Adding a proposer is one module that
implements `Proposer`, plus registering it with the controller (`Controller.add_proposer`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from homespec.speculation.sampling import SamplingParams
from homespec.speculation.target import Pass


@dataclass(frozen=True)
class Evidence:
    """What a proposal's acceptance is learned under, beside the proposer's name: proposals with
    the same evidence are alike. Model proposers have one kind (the default); ngram's depends on
    its match (a 32-token copy of the prompt is kept far more often than a 2-token repeat)."""

    match: int = 0  # evidence strength: ngram's match-length bucket; 0 = not applicable
    from_prompt: bool = False  # the proposal copies the prompt rather than repeating the answer
    from_memory: bool = False  # the proposal copies an earlier request's answer
    # ... the answer to this very prompt, and this answer has so far said what that one did: the
    # same question again. A greedy answer to it is the same text up to a near-tie.
    repeat: bool = False
    # A short match into the prompt just past where this answer's last long copy of it broke off:
    # an edit's copy going on after the lines it changed, kept far longer than a coincidence.
    resumes: bool = False


NO_GAPS = np.empty(0, np.float32)  # argmax gaps not known
NO_GAPS.flags.writeable = False


@dataclass(frozen=True)
class Preview:
    """What a proposer could offer for a context now, found without paying for a proposal."""

    available: int  # tokens it could propose (<= the k asked); 0 = nothing worth proposing
    evidence: Evidence = Evidence()
    # [available] the same question's draft: each token's argmax gap when the remembered answer
    # gave it (sampling.argmax_gaps), where a greedy answer asked again may break; else empty
    gaps: np.ndarray = field(default_factory=lambda: NO_GAPS, compare=False)


@dataclass(frozen=True)
class ProposalInfo:
    """What the controller learns from a proposal besides its tokens."""

    evidence: Evidence = Evidence()
    # Catching up on context the proposer missed (it sat out some steps) is a switching cost, not
    # a cost per drafted token: reported apart so the cost model stays clean.
    catchup_s: float = 0.0  # seconds of draft_s spent catching up
    catchup_tokens: int = 0  # tokens (or head entries) caught up on
    # Its model's passes ran beside other requests' (batch.py): their seconds are no measure of
    # proposing alone, which the cost model keeps (the 0.5B draft on 2 cores: a token for one
    # request 9 ms, for three at once 19.5).
    shared: bool = False
    # Of the tokens proposed, the last ones copied from the prompt rather than proposed by the
    # proposer's model (DraftProposer.copy): they cost nothing, so they teach no cost per token.
    copied: int = 0
    gaps: np.ndarray = field(default_factory=lambda: NO_GAPS, compare=False)  # [proposed] as Preview.gaps


@dataclass
class Proposal:
    tokens: list[int]  # [k'] proposed ids, k' <= k requested; empty = nothing worth proposing
    # [k', vocab] probabilities each token was drawn from, or None for a deterministic proposer
    # (a point mass on each token: ngram, or any proposer under greedy decoding).
    q: np.ndarray | None = None
    draft_s: float = 0.0  # seconds spent proposing
    info: ProposalInfo = field(default_factory=ProposalInfo)


# Tokens a proposer that drafted the last step is still behind (the bonus token and the last
# accepted one): reading them is part of proposing; a longer lag is a switching cost.
IN_STEP_LAG = 2


@dataclass(frozen=True)
class ProposerCost:
    """A proposer's cost measured at warm-up (seconds, on this machine)."""

    per_token_s: float  # proposing one token during a step
    catchup_per_token_s: float  # catching up one token of context it missed
    catchup_tokens: int  # how many tokens the catch-up timing covered


@runtime_checkable
class Proposer(Protocol):
    name: str  # registry key, the speculation mode that fixes it, and its label in stats
    # True when begin() costs ~nothing (ngram indexes the prompt): always worth doing, since it
    # also tells the proposer where the prompt ends. False: prefilled only while it pays.
    free_prefill: bool

    def begin(self, prompt: Sequence[int], shaping: Hashable = ()) -> None:
        """A new generation starts with this prompt: catch up (prefill) now. shaping: what
        besides the prompt decides its greedy answer (engine.shaping: a grammar, a bias, a
        penalty; () for none): the same prompt under another shaping asks another question."""

    def preview(self, context: Sequence[int], k: int) -> Preview:
        """How many tokens (<= k) it could propose after `context`, and under which evidence."""
        ...

    def lag(self, context: Sequence[int]) -> int:
        """Tokens of `context` it must catch up on before it can propose (at most IN_STEP_LAG
        when it drafted the step before)."""
        ...

    def propose(
        self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        """Guess up to k tokens that follow `context`."""
        ...

    def end(self, context: Sequence[int], gaps: Sequence[float] = ()) -> None:
        """The generation it was begun for ended with `context` (prompt + answer), a greedy
        answer (SpeculationPolicy.end; gaps: [len(answer)] its argmax gaps, or () when not
        known): keep what helps later requests (prompt lookup remembers the answer, filed under
        its prompt and shaping, and where it was a near-tie)."""
        ...

    def measure_cost(self, context: Sequence[int], probe: Sequence[int], passes: int) -> ProposerCost | None:
        """Warm-up: time proposing after `context` (the target holds context[:-1]); `probe` is
        text to catch up on. Leave every cache as found. None: costs ~nothing to measure."""
        ...

    def close(self) -> None:
        """Free resources (a model) — the proposer is not used afterwards."""


@runtime_checkable
class SteppedProposer(Proposer, Protocol):
    """A proposer with a model whose passes a batch driver may run beside other requests' (a
    draft model: one pass per drafted token for all requests drafting, rather than one per
    request and token)."""

    # Runs several of its passes (of several sequences of its model) as one; None: alone.
    together: Callable[[Sequence[Any]], list[np.ndarray]] | None

    def propose_steps(
        self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Generator[Pass, np.ndarray, Proposal]:
        """`propose`, yielding each pass of its model (target.Pass, draft=True) for the logits."""
        ...
