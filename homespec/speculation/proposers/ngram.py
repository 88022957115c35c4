"""Prompt lookup: propose what followed the last time the context's suffix occurred.

No model. For each n from n_max down to n_min, look up the context's last n tokens in an index
of earlier n-grams; on a hit propose the (up to k) tokens that followed that earlier occurrence.
Longer matches are more specific, so they win. This pays off when the output copies from the
prompt (editing code, quoting, summarising with names) and costs ~nothing when it misses.

The index maps each n-gram to the latest position where it started *and had a follower*, and is
extended incrementally as the context grows; a context that is not an extension of the indexed
one (a new request) rebuilds it. Memory: n_max dict entries per context token.

A match also says how much it can be trusted, for the controller: its full length (the suffix is
compared further back than n_max, up to MATCH_CAP tokens) and whether it copies from the prompt,
repeats the answer, or comes from an earlier request's answer (ngram_memory.py: looked up too,
and taken where it matches further back than the request's own text does, or where it is the
answer to this very prompt, so far as this answer has said it: the same question again), and
whether a short match into the prompt resumes the answer's copy of it where that broke off
(where nothing matches n_min tokens back, the answer's last token, read as text, resumes it too:
an edit going on after words it inserted, mid-token of the prompt). A copy of the prompt stops
before a token where the answer's copies broke off more often than they went on (_cut).
Measured on greedy outputs of the bench's workloads (the 1.5B target, a 16-token continuation):
edits copying the prompt kept 10-14 tokens whatever the match length, while prose repeating
itself kept 2-8 even on matches of 16-31 tokens.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from homespec.speculation.proposers.base import NO_GAPS, Evidence, Preview, Proposal, ProposalInfo, ProposerCost
from homespec.speculation.proposers.ngram_memory import NgramMemory, matched_back, question_key
from homespec.speculation.sampling import SamplingParams

# Matches are measured back to this many tokens: beyond it (a long copy) more length says nothing new.
MATCH_CAP = 32
# A match into the prompt this long is a copy under way (an edit reproducing its input): a draft
# model's guesses that end so go on as the prompt does (NgramProposer.copy: an edit's draft, past
# the change it was asked for, is a copy again), and where the answer's own copy breaks off, its
# short matches are checked for going on with it (_follow_copy).
COPY_MATCH = 8
# A short match into the prompt at most this many tokens past where that copy broke off resumes it
# (Evidence.resumes): an edit going on after the lines it changed. Replayed on the 46 recorded
# outputs (scripts/controller_replay.py), 32 and 64 did best; 16 lost the resumptions after a
# changed block of several lines, and 128 took in coincidences.
RESUME_WINDOW = 64


@dataclass(frozen=True)
class Match:
    tokens: list[int]  # the continuation [<= k]; empty when no suffix occurred before
    length: int = 0  # tokens of the context's suffix that equal those before the continuation (<= MATCH_CAP)
    at: int = 0  # context position the continuation was copied from
    from_prompt: bool = False  # it copies the prompt (an edit), rather than repeating the answer
    from_memory: bool = False  # it copies an earlier request's answer
    repeat: bool = False  # ... the answer to this same prompt, so far as this one (the same question again)
    resumes: bool = False  # a short match into the prompt just past where the answer's copy of it broke off
    gaps: np.ndarray = field(default_factory=lambda: NO_GAPS, compare=False)  # [len(tokens)] a repeat's argmax gaps (Recall.gaps)


NO_MATCH = Match([])


class NgramIndex:
    def __init__(self, n_min: int = 2, n_max: int = 5) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        # tables[n]: n-gram -> start index of its latest occurrence that has a following token
        self._tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}

    def sync(self, context: Sequence[int]) -> bool:
        """Make the index cover `context` (extend if it grew, rebuild if it changed); True if rebuilt."""
        m = len(self.tokens)
        rebuilt = len(context) < m or list(context[:m]) != self.tokens
        if rebuilt:
            self.tokens = []
            for t in self._tables.values():
                t.clear()
            m = 0
        for tok in context[m:]:
            self._append(int(tok))
        return rebuilt

    def _append(self, tok: int) -> None:
        toks = self.tokens
        toks.append(tok)
        end = len(toks) - 1  # the new token follows every n-gram ending just before it
        for n, table in self._tables.items():
            if end - n >= 0:
                table[tuple(toks[end - n : end])] = end - n

    def lookup(self, k: int, after: Sequence[int] = ()) -> Match:
        """The continuation [<= k] of the longest suffix (n_min..n_max tokens) seen before; with
        `after`, of the indexed tokens followed by those, which are not indexed (a draft's guesses)."""
        toks = self.tokens
        tail = toks[-MATCH_CAP:] + list(after)  # the end of the context: all that a match compares
        end = len(toks) + len(after)
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            start = self._tables[n].get(tuple(tail[-n:]))
            if start is not None:
                at = start + n  # n tokens match; then compare further back, as far as MATCH_CAP
                return Match(toks[at : at + k], matched_back(toks, at, tail, MATCH_CAP, start=n), at)
        return NO_MATCH


def match_bucket(length: int) -> int:
    """Match lengths 2..7 apart, then 8-15, 16-31 and 32+ (MATCH_CAP) by their lower end: past a
    few tokens, doubling the length is what changes the odds."""
    if length < 8:
        return length
    return 8 if length < 16 else 16 if length < MATCH_CAP else MATCH_CAP


class NgramProposer:
    """Deterministic proposer: q is a point mass, so `Proposal.q` is None."""

    name = "ngram"
    free_prefill = True  # indexing the prompt costs microseconds and marks where it ends

    def __init__(self, n_min: int = 2, n_max: int = 5, memory: NgramMemory | None = None,
                 piece: Callable[[int], bytes] | None = None) -> None:
        self.index = NgramIndex(n_min, n_max)
        # A token's text (Runtime.piece): resuming a copy mid-token of the prompt (_resume_one); None: by id only
        self.piece = piece
        self._pieces: dict[int, bytes] = {}
        self.prompt_len = 0  # tokens of the current request's prompt: a match before it copies the prompt
        self.memory = memory  # earlier requests' answers (shared by every slot); None: this request only
        self.question: int | None = None  # question_key of the prompt and shaping, for the memory (None: no memory)
        # The answer's last copy of the prompt under way: (prompt position it went on from, context length then)
        self._copy: tuple[int, int] | None = None
        self._run = 0  # tokens the answer is known to have copied after that match (_broke_off)

    def begin(self, prompt: Sequence[int], shaping: Hashable = ()) -> None:
        self.index.sync(prompt)
        self._prompt(prompt, shaping)

    def _prompt(self, prompt: Sequence[int], shaping: Hashable = ()) -> None:
        self.prompt_len = len(prompt)
        self._copy = None
        # Prompt tokens the answer's copy broke off at, and those it copied, by their token:
        # where it broke more often than it went on, a copy stops before that token (_cut).
        self._copied: set[int] = set()  # prompt positions the answer copied
        self._broke_at: set[int] = set()  # prompt positions where its copy broke off
        self._kept: Counter[int] = Counter()  # token -> positions of it in _copied
        self._broke: Counter[int] = Counter()  # token -> positions of it in _broke_at
        self.question = question_key(prompt, shaping) if self.memory is not None else None

    def match(self, context: Sequence[int], k: int) -> Match:
        """The proposal and how it matched, without timing."""
        if self.index.sync(context):  # a new request that did not call begin(): its context is the prompt
            self._prompt(context)
        m = self.index.lookup(k)
        m = self._follow_copy(replace(m, from_prompt=m.at < self.prompt_len)) if m.tokens else self._resume_one(k)
        if m.from_prompt:
            m = self._cut(m)
        if self.memory is not None:
            recall = self.memory.lookup(context, k, MATCH_CAP, self.question, len(context) - self.prompt_len)
            # the same question's answer beats anything; a longer match beats a phrase of its own that recurs
            if recall.tokens and (recall.same_question or recall.length > m.length):
                return Match(recall.tokens, recall.length, from_memory=True, repeat=recall.same_question, gaps=recall.gaps)
        return m

    def _follow_copy(self, m: Match) -> Match:
        """Keep track of the answer's copy of the prompt, and mark a short match into the prompt
        that goes on with it after it broke off (`resumes`). An edit copies its input in order, so
        after the lines it changed its copy picks up a little further on, where a 2-token match
        then runs for dozens of tokens; the same short match elsewhere in the prompt, or in an
        answer that was not copying, is mostly a coincidence. In the recorded edits, 2-token
        matches that resumed a copy ran 28 tokens on average, against 2 for those in code and
        chat answers; under one acceptance key the two are priced alike."""
        if not m.from_prompt:
            return m
        if m.length >= COPY_MATCH:
            self._broke_off()  # what the answer copied of the last one, and where it broke off
            self._copy, self._run = (m.at, len(self.index.tokens)), 0
            return m
        broke = self._broke_off()
        return m if broke is None else replace(m, resumes=broke <= m.at <= broke + RESUME_WINDOW)

    def _broke_off(self) -> int | None:
        """The prompt position where the answer's last copy of the prompt broke off (its first
        token the answer did not copy); None while no copy is under way."""
        if self._copy is None:
            return None
        src, n = self._copy
        # j: tokens the answer went on copying after that match; the context only grows within a
        # request, so the walk goes on from where the last one stopped
        toks, j = self.index.tokens, self._run
        while n + j < len(toks) and src + j < self.prompt_len and toks[n + j] == toks[src + j]:
            if src + j not in self._copied:
                self._copied.add(src + j)
                self._kept[toks[src + j]] += 1
            j += 1
        self._run = j
        broke = src + j
        # the answer went on otherwise there
        if n + j < len(toks) and broke < self.prompt_len and broke not in self._broke_at:
            self._broke_at.add(broke)
            self._broke[toks[broke]] += 1
        return broke

    def _cut(self, m: Match) -> Match:
        """A copy of the prompt up to (not into) the first of its tokens, past its first, at
        which the answer's copies broke off more often than they went on. An edit that changes
        every function's signature breaks at each `):\n` after `def name(args`, and a long
        draft's rows past it are thrown away; a token the answer mostly copied through (the
        indent after a signature that got a docstring once) does not stop it. Replayed
        (scripts/controller_replay.py --vocab, the Xeon's bench curve), the recorded edits went
        from 4.04x to 4.23x plain decoding, six held-out edits (docstrings, type hints, renames:
        docs/replay/heldout_edits.json) from 2.08x to 2.09x; on the 2-core EPYC's curve, 1.55x
        to 1.52x and 1.00x to 1.04x."""
        for i in range(1, len(m.tokens)):
            t = m.tokens[i]
            if self._broke[t] > self._kept[t] and m.at + i not in self._copied:
                return replace(m, tokens=m.tokens[:i])
        return m

    def _resume_one(self, k: int) -> Match:
        """Where no suffix of n_min tokens occurred before: the first prompt token within
        RESUME_WINDOW past where the answer's copy broke off that ends as the answer's last token
        does, and what follows it there [<= k]. An edit that inserts words goes on with the prompt
        right after them, before it has written n_min tokens of it, and often in the middle of
        one of the prompt's tokens: `def count_words(text: str) -> Counter:\n` where the prompt
        said `def count_words(text):\n`, in which `):\n` is one token. With `piece` (the token's
        text) a prompt token that ends with the answer's last token's text counts; without it,
        only the same token. On the recorded "add type hints" edit, drafting 8 tokens a step,
        it took 46 steps without this, 43 with the same token and 38 with the text."""
        broke = self._broke_off()
        toks = self.index.tokens
        if broke is None or len(toks) <= self.prompt_len:
            return NO_MATCH
        last = toks[-1]
        tail = self._piece(last)
        for q in range(broke, min(broke + RESUME_WINDOW, self.prompt_len - 1)):
            if toks[q] == last or (tail and self._piece(toks[q]).endswith(tail)):
                return Match(toks[q + 1 : q + 1 + k], 1, q + 1, from_prompt=True, resumes=True)
        return NO_MATCH

    def _piece(self, token: int) -> bytes:
        """A token's text (b"": not known), kept: the same few hundred prompt tokens are looked at
        step after step."""
        if self.piece is None:
            return b""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self.piece(token)
        return text

    def copy(self, context: Sequence[int], drafted: Sequence[int], k: int) -> list[int]:
        """What follows `drafted` (a draft model's guesses after `context`) where their end copies
        the prompt at least COPY_MATCH tokens back: the prompt's next [<= k] tokens, at no cost.
        [] where it does not (DraftProposer.copy)."""
        if self.index.sync(context):
            self._prompt(context)
        m = self.index.lookup(k, drafted)
        return m.tokens if m.at < self.prompt_len and m.length >= COPY_MATCH else []

    def evidence(self, m: Match) -> Evidence:
        """Acceptance is learned per match: its length bucket (a match shorter than n_min
        counts as n_min, but for a 1-token resumption, _resume_one, learned apart), what it copies
        (the prompt, the answer, an earlier answer) and whether it resumes the answer's copy of
        the prompt."""
        shortest = 1 if m.resumes else self.index.n_min
        return Evidence(match_bucket(max(m.length, shortest)), m.from_prompt, m.from_memory, m.repeat, m.resumes)

    def preview(self, context: Sequence[int], k: int) -> Preview:
        m = self.match(context, k)
        return Preview(len(m.tokens), self.evidence(m), m.gaps) if m.tokens else Preview(0)

    def lag(self, context: Sequence[int]) -> int:
        return 0  # the index extends itself in microseconds

    def end(self, context: Sequence[int], gaps: Sequence[float] = ()) -> None:
        """The answer is remembered for later requests (its prompt's tail included, and where it
        was a near-tie: gaps)."""
        if self.memory is not None:
            self.memory.add(context, self.prompt_len, self.question, gaps)
        self.question = None  # until the next begin(): a context that only extends this one is not this prompt

    def propose(
        self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        t0 = time.perf_counter()
        m = self.match(context, k)
        return Proposal(m.tokens, None, time.perf_counter() - t0, ProposalInfo(self.evidence(m), gaps=m.gaps))

    def measure_cost(self, context: Sequence[int], probe: Sequence[int], passes: int) -> ProposerCost | None:
        return None  # microseconds: nothing worth a warm-up

    def close(self) -> None:
        self.index = NgramIndex(self.index.n_min, self.index.n_max)
        self.prompt_len, self.question = 0, None
