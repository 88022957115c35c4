"""The MTP head as a proposer: drafts from the target's own last hidden state.

Indexing (the one-position shift). Head entry j pairs h_j, the target's hidden state at
position j, with t_{j+1}, the token sampled from L_j; its output ĥ_{j+1} predicts the target's
next hidden state and, through W_out, the token after t_{j+1}. Between steps the target's cache
holds ctx[:-1] (engine.py), so with m = len(ctx) its hidden states reach position m - 2, and

    entry m - 2  = (h_{m-2}, t_{m-1})  -> d_1       real: the last one the target evaluated
    entry m - 1  = (ĥ_{m-1}, d_1)      -> d_2       speculative: the head's own prediction
    entry m - 2 + i = (ĥ, d_i)         -> d_{i+1}

After verification accepts a tokens the target has evaluated positions up to m + a - 1 = m' - 2,
so the next proposal drops the speculative entries and rebuilds entries m - 1 .. m' - 2 from the
target's real hidden states (a + 1 rows in one batch: fc and K/V only, the rest of the layer runs
for the last row). Entries older than the head's window are not needed.

The head proposes only tokens of its output vocabulary V'. Under sampling, q is its
distribution over the FULL target vocabulary (zero outside V') through sampling.probabilities
with the request's params, so rejection sampling stays exact; under greedy decoding q is None.

Requires the target runtime to keep hidden states (RuntimeOptions.hidden_window >= the head's
window) and torch (`homespec[mtp]`), which is imported only when a head is opened.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Hashable, Sequence
from typing import Protocol

import numpy as np

from homespec.speculation.proposers.base import Preview, Proposal, ProposalInfo, ProposerCost
from homespec.speculation.sampling import SamplingParams, draw, penalize, probabilities, window
from homespec.speculation.target import HiddenStates
from homespec.tokens import common_prefix

_GREEDY = SamplingParams()
CALIBRATION_K = 4  # draft length timed at warm-up: the head's cost per token barely depends on it


class HeadRunner(Protocol):
    """The served head (mtp/model.py's HeadRunner, torch): a KV cache of head entries."""

    vocab_ids: np.ndarray  # [V'] head index -> target token id
    window: int  # entries it attends over
    end: int  # entries in its cache

    def extend(self, hidden: np.ndarray, next_tokens: np.ndarray, pos0: int) -> tuple[np.ndarray, np.ndarray]:
        """Append entries (hidden [n, d], t_{j+1} [n]) at pos0..: (ĥ of the last [d], logits [V'])."""
        ...

    def truncate(self, n: int) -> None: ...

    def reset(self, start: int) -> None: ...


class MTPProposer:
    name = "mtp"
    free_prefill = False  # building the head's entries for the prompt delays the second token

    def __init__(self, target: HiddenStates, runner: HeadRunner) -> None:
        """target: keeps at least the head's window of hidden states."""
        self.target = target
        self.runner = runner
        self.n_vocab = target.n_vocab
        self.vocab_ids = runner.vocab_ids  # [V'] head index -> target token id
        self.window = runner.window
        self._seen: list[int] = []  # the context the real entries were built from
        self._real_end = 0  # entries < this were built from the target's real hidden states
        self._step_entries = 1  # entries a normal step adds (k + 1); more is a catch-up

    # -- the head's cache follows the target ---------------------------------------------------

    def _keep(self, context: Sequence[int]) -> int:
        """Real entries still valid for `context`: entry j needs context[:j + 2] unchanged."""
        return max(0, min(self._real_end, common_prefix(self._seen, context) - 1, self.runner.end))

    def preview(self, context: Sequence[int], k: int) -> Preview:
        # The head drafts from the target's hidden state of the last verified position: after a
        # pass shared with other requests (batch.py) there is none until the next pass alone.
        return Preview(k if self.target.hidden_start <= len(context) - 2 else 0)

    def lag(self, context: Sequence[int]) -> int:
        """Head entries to (re)build before proposing for `context` (at most the window)."""
        last = len(context) - 2
        return max(0, min(self.window, last + 1 - self._keep(context)))

    def end(self, context: Sequence[int], gaps: Sequence[float] = ()) -> None:
        pass  # the head's entries follow the target's cache, nothing to keep

    def _sync(self, context: Sequence[int], last: int) -> tuple[np.ndarray, np.ndarray, int] | None:
        """Make real entries ..last valid; return (ĥ, logits [V'], entries built) of entry
        `last`, or None when the target kept no hidden state for it."""
        keep = min(self._keep(context), last)  # entry `last` runs again: its output is the draft
        lo = max(keep, last + 1 - self.window, self.target.hidden_start)
        if lo > last:
            return None
        self.runner.truncate(keep)
        if lo > keep:  # a gap the target has no hidden states for: start the cache at lo
            self.runner.reset(lo)
        hidden = self.target.hidden_rows(lo, last + 1)  # [n, d]
        nxt = np.asarray(context[lo + 1 : last + 2], dtype=np.int64)  # [n] t_{j+1}
        h_pred, logits = self.runner.extend(hidden, nxt, lo)
        self._seen = list(context[: last + 2])
        self._real_end = last + 1
        return h_pred, logits, last + 1 - lo

    def begin(self, prompt: Sequence[int], shaping: Hashable = ()) -> None:
        # The target has just read the prompt (and holds nothing more until the first verify
        # pass): build the entries it allows now.
        # Entry len(prompt) - 1 needs the first generated token; the first proposal adds it.
        if len(prompt) >= 2 and list(self.target.tokens[: len(prompt) - 1]) == list(prompt[:-1]):
            self._sync(prompt, len(prompt) - 2)

    # -- drafting ------------------------------------------------------------------------------

    def propose(
        self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        t0 = time.perf_counter()
        m = len(context)
        if k <= 0 or m < 2 or len(self.target.tokens) != m - 1:
            return Proposal([], None, time.perf_counter() - t0)
        synced = self._sync(context, m - 2)
        if synced is None:
            return Proposal([], None, time.perf_counter() - t0)
        h_pred, logits, built = synced
        # Rebuilding more than a step could have added means the head sat out some steps: a
        # switching cost, reported apart so the controller's cost per token stays clean.
        catchup_s = time.perf_counter() - t0 if built > self._step_entries else 0.0
        self._step_entries = k + 1
        tokens: list[int] = []
        qs: list[np.ndarray] = []  # each [n_vocab]
        recent = list(window(context, params))
        for i in range(k):
            tok, q = self._choose(logits, params, window(recent + tokens, params), rng, m + i)
            tokens.append(tok)
            if q is not None:
                qs.append(q)
            if i + 1 < k:  # speculative entry m - 1 + i: the head's own ĥ with the token it drafted
                h_pred, logits = self.runner.extend(h_pred[None, :], np.asarray([tok]), m - 1 + i)
        info = ProposalInfo(catchup_s=catchup_s, catchup_tokens=built if catchup_s else 0)
        return Proposal(tokens, np.stack(qs) if qs else None, time.perf_counter() - t0, info)

    def measure_cost(self, context: Sequence[int], probe: Sequence[int], passes: int) -> ProposerCost:
        """Per proposed token as a step drafts (one real entry rebuilt, then its own predictions
        fed forward), and per entry rebuilt after sitting steps out (the first proposal builds
        the window). The target holds context[:-1], as between steps."""
        base = len(self.target.tokens)
        rng = np.random.default_rng(0)
        first = self.propose(context, 1, _GREEDY, rng)  # builds the window: a catch-up
        built = max(first.info.catchup_tokens, 1)
        times = []
        for _ in range(1 + passes * 2):  # the first is dropped
            # A target pass in between, as in a real step: back to back the head measured ~25%
            # cheaper (4.4 against 5.7 ms a token: warm caches and thread pools).
            self.target.eval(probe[:1], output="last")
            self.target.truncate(base)
            times.append(self.propose(context, CALIBRATION_K, _GREEDY, rng).draft_s)
        return ProposerCost(statistics.median(times[1:]) / CALIBRATION_K, first.draft_s / built, built)

    def _choose(
        self, z: np.ndarray, params: SamplingParams, recent: Sequence[int], rng: np.random.Generator, position: int
    ) -> tuple[int, np.ndarray | None]:
        """Head logits over V' [V'] -> (token id, q over the full vocabulary or None); position:
        the token's context index (a seeded request races q against its keys, sampling.draw)."""
        if params.greedy and not params.shifts_logits:
            i = int(np.argmax(z))  # the common case stays in V' (16k rows, not 152k)
            return int(self.vocab_ids[i]), None
        full = np.full(self.n_vocab, -np.inf, dtype=np.float32)  # [n_vocab]
        full[self.vocab_ids] = z
        full = penalize(full, params, recent)
        if params.greedy:
            return int(np.argmax(full)), None
        q = probabilities(full, params)  # zero outside V': never proposed, exactness kept
        return draw(q, params, rng, position), q

    def close(self) -> None:
        self.runner = None
