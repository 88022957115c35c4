"""A small GGUF model with the target's tokenizer guesses the next k tokens, one pass each.

Its KV cache follows the committed context as `Target.sync` would: before each proposal the
draft evaluates only what it has not seen (after a step: the bonus token, plus the last
accepted token when all k were accepted) in one batch, and that batch's last logits give the
first guess — no pass is spent twice. Rejected guesses are truncated away on the next sync.
Each pass is yielded (`propose_steps`), so that a batch driver runs the passes of all requests
drafting at once as one pass of the draft's context (`together`, batch.py).

Under sampling each guess is drawn from q = sampling.probabilities(draft logits) with the
request's own SamplingParams, so that q and the target's p come from the same transform, as
exact rejection sampling requires. Under greedy decoding the guess is the draft's argmax and q
is a point mass (Proposal.q is None). A seeded request draws each guess by racing q against the
keys of its context index (sampling.draw): the keys the target's own draw there uses, so the
guess matches the target's token as often as the two distributions allow (verify.seeded_verify).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Generator, Hashable, Sequence
from typing import Any

import numpy as np

from homespec.speculation.proposers.base import IN_STEP_LAG, Preview, Proposal, ProposalInfo, ProposerCost
from homespec.speculation.sampling import SamplingParams, draw, penalize, probabilities, window
from homespec.speculation.target import Pass, Target
from homespec.tokens import common_prefix


class DraftProposer:
    name = "draft"
    free_prefill = False  # reading the prompt delays the second token and the round: only while drafting pays

    def __init__(self, runtime: Target, target_vocab: int,
                 together: Callable[[Sequence[Any]], list[np.ndarray]] | None = None,
                 copy: Callable[[Sequence[int], Sequence[int], int], list[int]] | None = None) -> None:
        self.rt = runtime
        # Tokenizers may differ by padding rows (gguf_info allows <= 128): pad q to the target's.
        self.target_vocab = target_vocab
        # Runs passes of several slots of the draft's context as one (Runtime.eval_many): a batch
        # driver drafts for all requests in one pass per token. None: its passes run alone.
        self.together = together
        # copy(context, drafted, k): what the prompt goes on with where the guesses so far copy it
        # (prompt lookup, NgramProposer.copy), or []. An edit's draft model reads the request
        # and makes the change that prompt lookup cannot guess, then copies the file on, a pass per
        # token (the 0.5B on 2 cores: a 49-token draft 0.49 s): past the change, the rest of a
        # greedy draft is the prompt's, at no cost. None: the model drafts every token.
        self.copy = copy

    def begin(self, prompt: Sequence[int], shaping: Hashable = ()) -> None:
        # Prefill all but the last token without logits; the first proposal evaluates the rest.
        keep = min(len(prompt) - 1, common_prefix(self.rt.tokens, prompt))
        self.rt.truncate(keep)
        self.rt.eval(prompt[keep : len(prompt) - 1], output="none")

    def preview(self, context: Sequence[int], k: int) -> Preview:
        return Preview(max(0, min(k, self.rt.n_ctx - len(context))))

    def lag(self, context: Sequence[int]) -> int:
        """Tokens of `context` this draft has not read yet (the cost of using it now)."""
        return len(context) - common_prefix(self.rt.tokens, context)

    def end(self, context: Sequence[int], gaps: Sequence[float] = ()) -> None:
        pass  # its KV cache already holds what a next turn could reuse

    def propose(
        self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        steps = self.propose_steps(context, k, params, rng)
        try:
            p = next(steps)
            while True:
                p = steps.send(p.run())
        except StopIteration as done:
            return done.value

    def propose_steps(
        self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Generator[Pass, np.ndarray, Proposal]:
        """`propose`, yielding each pass of the draft (for a batch driver to run beside other
        requests' drafts, `together`)."""
        t0 = time.perf_counter()
        k = min(k, self.rt.n_ctx - len(context))  # room in the draft's own cache
        if k <= 0:
            return Proposal([], None, 0.0)
        behind = len(context) - len(self.rt.tokens)  # tokens to catch up on (1-2 after a step)
        keep = min(common_prefix(self.rt.tokens, context), len(context) - 1)  # as Target.sync
        self.rt.truncate(keep)
        passes = [self._pass(context[keep:], k)]
        logits = (yield passes[-1])[0]  # [draft_vocab] after context
        # A long catch-up (the draft sat out some steps) is a switching cost, not a drafting
        # cost per token: report it apart so the controller's cost model stays clean.
        catchup_s = time.perf_counter() - t0 if behind > IN_STEP_LAG else 0.0
        tokens: list[int] = []
        copied: list[int] = []  # the prompt's tokens after the model's guesses (self.copy)
        qs: list[np.ndarray] = []  # each [vocab]
        recent = list(window(context, params))
        for i in range(k):
            z = self._pad(penalize(logits, params, window(recent + tokens, params)))
            if params.greedy:
                tok = int(np.argmax(z))
            else:
                q = probabilities(z, params)
                tok = draw(q, params, rng, len(context) + i)
                qs.append(q)
            tokens.append(tok)
            copied = self.copy(context, tokens, k - len(tokens)) if self.copy and params.greedy and i + 1 < k else []
            if copied:  # (a point mass each, as the model's own guesses under greedy decoding)
                tokens += copied
                break
            if i + 1 < k:
                passes.append(self._pass([tok], k))
                logits = (yield passes[-1])[0]
        q_arr = np.stack(qs) if qs else None  # [k, vocab]
        shared = any(p.rows > len(p.tokens) for p in passes)  # the driver ran it beside others' (Pass.rows)
        info = ProposalInfo(catchup_s=catchup_s, catchup_tokens=max(behind, 0) if catchup_s else 0, shared=shared,
                            copied=len(copied))
        return Proposal(tokens, q_arr, time.perf_counter() - t0, info)

    def _pass(self, tokens: Sequence[int], k: int) -> Pass:
        return Pass(self.rt, list(tokens), "last", draft=True, together=self.together, verify_rows=k + 1)

    def measure_cost(self, context: Sequence[int], probe: Sequence[int], passes: int) -> ProposerCost:
        """Per proposed token: one-token passes (median); per caught-up token: one batch."""
        self.rt.sync(context[:-1], output="none")
        base = len(self.rt.tokens)
        times = []
        for i in range(1 + passes * 2):  # the first pass warms up and is dropped
            t = time.perf_counter()
            self.rt.eval(probe[i : i + 1], output="last")
            times.append(time.perf_counter() - t)
        self.rt.truncate(base)
        t = time.perf_counter()
        self.rt.eval(probe, output="none")  # a catch-up batch: prefill speed
        catchup = (time.perf_counter() - t) / len(probe)
        self.rt.reset()  # the first request should not find warm-up text in the cache
        return ProposerCost(statistics.median(times[1:]), catchup, len(probe))

    def _pad(self, z: np.ndarray) -> np.ndarray:
        if z.shape[0] >= self.target_vocab:
            return z[: self.target_vocab]
        return np.concatenate([z, np.full(self.target_vocab - z.shape[0], -np.inf, dtype=z.dtype)])

    def close(self) -> None:
        self.rt.close()

