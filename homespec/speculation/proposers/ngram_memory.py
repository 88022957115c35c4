"""Prompt lookup across requests: what earlier answers said, for drafting a later one.

Home apps ask the same things again: an automation's scheduled question, a greedy regenerate,
an editor asking for the same completion after an undo; and a voice command often ends as an
earlier one did, whatever the states and time its prompt carries before. At temperature 0 the
answer to the same prompt is the same text, so the earlier answer is a near-perfect draft; llama-server's
`ngram-mod` keeps such a pool across its slots for the same reason. Verification is unchanged,
so what the memory proposes never changes what the target says (a greedy answer stays its
argmax; a sampled one keeps its distribution); it only changes how many passes it takes.

Each finished greedy generation leaves its answer here with the last TAIL tokens of its prompt
(what leads into the answer: the end of the question and the chat template's turn marker) and a
hash of its whole prompt and of what else shaped the answer (a tool call's grammar, a logit bias:
Home Assistant asks the same tool-calling question with the same tools again, and is told the
same call). A sampled answer is not kept: the next draw says something else. A lookup first asks
whether this very prompt was answered before and this answer has so far said what that one did
(the same question again: `Recall.same_question`, found by the hash and confirmed by comparing
back); else it takes the context's last n tokens for n in KEY_NS, longest first, finds where they
were last followed by something, and measures the match back as far as MATCH_CAP tokens, as the
per-request index does. A long match of that kind is not the same question: an editor's
completion at the same cursor in a changed file, or a long system prompt shared by different
questions, end alike and are answered differently. Entries never run into each other (a
separator no token equals lies between).

Bounded: at most `capacity` tokens; past it the oldest half of the entries is dropped and the
rest re-indexed (~5 ms per 10k tokens measured on a 2-core EPYC, once per capacity/2 tokens remembered). Memory: ~80
bytes a token per key length (dict entries keyed by the n-gram's hash), ~8 MB at 32k tokens.

A greedy answer asked again is the same text up to a near-tie: where its top two logits were
closer than llama.cpp's batch noise, the answer verified in passes of other sizes can take the
other token. So each answer token keeps its argmax gap (sampling.argmax_gaps), and the same
question's draft comes with the gaps of its tokens (`Recall.gaps`), for the controller to price
where the draft is likely to break (costs.NearTieModel). 4 bytes a token more.

It is one object per daemon, shared by every slot's prompt lookup; requests of one slot end
while another's decide, so it takes a lock.
"""

from __future__ import annotations

import hashlib
import math
import threading
from array import array
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from homespec.speculation.proposers.base import NO_GAPS

# Tokens of the prompt kept before each answer: enough to measure a repeated question's match to
# MATCH_CAP and to key its first answer token on the question rather than the template alone.
TAIL = 48
# Key lengths, longest first: 12 places a repeated answer even among many that share phrases;
# 4 finds the thread again after the answer left it for a few tokens.
KEY_NS = (12, 4)
_SEP = -1  # between entries: no token id equals it, so matches and drafts stop there


def matched_back(tokens: Sequence[int], at: int, context: Sequence[int], cap: int, start: int = 0) -> int:
    """How many tokens (<= cap) before position `at` of `tokens` equal the context's last ones,
    counting on from `start` already known equal. Prompt lookup measures every match so, in the
    request's own text (tokens is the context) and in the memory."""
    length = start
    while length < cap and length < len(context) and at - length > 0 and tokens[at - length - 1] == context[-length - 1]:
        length += 1
    return length


def question_key(prompt: Sequence[int], shaping: Hashable = ()) -> int:
    """What identifies a question for `NgramMemory.lookup`'s same-question test: the prompt and
    what else decides its greedy answer (engine.shaping: a tool call's grammar, a bias; () for
    none). A collision only offers a wrong draft, which verification rejects. A digest, not
    Python's hash: that of a string (a grammar) changes with every process, and the memory is
    kept across restarts (dump/load)."""
    h = hashlib.blake2b(np.asarray(prompt, dtype=np.int64).tobytes(), digest_size=8)
    if shaping != ():
        h.update(repr(shaping).encode())  # ints, floats and the grammar's text: the same in every process
    return int.from_bytes(h.digest(), "little", signed=True)


class Recall(NamedTuple):
    tokens: list[int]  # the continuation [<= k]; empty when nothing matched
    length: int = 0  # tokens of the context's suffix equal to those before it (<= cap)
    same_question: bool = False  # this prompt was answered before, and this answer so far says what that one did
    # [len(tokens)] the same question's tokens' argmax gaps when that answer kept them; else empty
    gaps: np.ndarray = NO_GAPS


class _Entry(NamedTuple):
    tokens: list[int]  # [<= TAIL prompt tokens + answer]
    question: int | None  # question_key of the whole prompt; None: not known, or the entry lost its lead-in
    answer_at: int  # index in tokens of the answer's first token
    gaps: np.ndarray  # [len(tokens)] float32 argmax gaps of the answer's tokens; nan: not known (the prompt's tail, ...)


class NgramMemory:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # tokens, separators included; 0: remembers nothing
        self._entries: deque[_Entry] = deque()  # one per generation, oldest first
        self._tokens: list[int] = []  # the entries' tokens, each followed by _SEP
        self._gaps = array("f")  # [len(_tokens)] their argmax gaps (nan: not known)
        self._tables: dict[int, dict[int, int]] = {n: {} for n in KEY_NS}  # n -> hash(n-gram) -> position after it
        # question_key -> positions of its latest answer's first token and of the separator after it
        self._answers: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._tokens)

    @property
    def answers(self) -> int:
        """Answers held (an entry cut to the capacity counts as one)."""
        with self._lock:
            return len(self._entries)

    def add(self, context: Sequence[int], prompt_len: int, question: int | None = None, gaps: Sequence[float] = ()) -> None:
        """Remember a finished generation: `context` is its prompt (the first prompt_len tokens)
        and its answer; question: the prompt's question_key; gaps: [len(answer)] the answer's
        argmax gaps, or () when not known. A generation that answered nothing leaves nothing; an
        entry longer than the capacity keeps its end (and loses its question)."""
        if self.capacity <= 1 or len(context) <= prompt_len:
            return
        start = max(0, prompt_len - TAIL)
        cut = max(0, len(context) - start - (self.capacity - 1))  # tokens over the capacity (the separator's included)
        all_gaps = np.full(len(context) - start, np.nan, np.float32)  # [prompt tail + answer]
        if len(gaps) == len(context) - prompt_len:
            all_gaps[prompt_len - start :] = gaps
        self._append(_Entry([int(t) for t in context[start + cut :]], question if cut == 0 else None, prompt_len - start - cut,
                            all_gaps[cut:]))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._reindex()

    def dump(self) -> dict[str, np.ndarray]:
        """The entries as arrays, oldest first, to keep across a restart (load)."""
        with self._lock:
            entries = list(self._entries)
        return {
            "tokens": np.asarray([t for e in entries for t in e.tokens], dtype=np.int32),  # [all entries' tokens]
            "lengths": np.asarray([len(e.tokens) for e in entries], dtype=np.int64),  # [entries]
            "questions": np.asarray([e.question or 0 for e in entries], dtype=np.int64),  # [entries]
            "known": np.asarray([e.question is not None for e in entries], dtype=bool),  # [entries]
            "answer_at": np.asarray([e.answer_at for e in entries], dtype=np.int64),  # [entries]
            "gaps": np.concatenate([e.gaps for e in entries]) if entries else np.zeros(0, np.float32),  # [all tokens]
        }

    def load(self, arrays: Mapping[str, np.ndarray]) -> int:
        """Take the entries of a dump (after those held, the newest kept within the capacity);
        returns how many it held. KeyError or ValueError for arrays that are not a dump."""
        lengths = arrays["lengths"]
        ends = np.cumsum(lengths)
        if len(arrays["tokens"]) != (ends[-1] if len(ends) else 0) or len(arrays["gaps"]) != len(arrays["tokens"]):
            raise ValueError("entries and tokens disagree")
        for i, end in enumerate(ends.tolist()):
            start = end - int(lengths[i])
            entry = _Entry(arrays["tokens"][start:end].tolist(), int(arrays["questions"][i]) if arrays["known"][i] else None,
                           int(arrays["answer_at"][i]), arrays["gaps"][start:end].astype(np.float32))
            if len(entry.tokens) + 1 <= self.capacity:  # (a memory made smaller since: too long to keep)
                self._append(entry)
        return self.answers

    def _append(self, entry: _Entry) -> None:
        """Keep `entry` (it fits the capacity with its separator), the oldest dropped for room."""
        with self._lock:
            if len(self._tokens) + len(entry.tokens) + 1 > self.capacity:
                self._drop_oldest(len(entry.tokens) + 1)
            self._entries.append(entry)
            self._index(entry)

    def lookup(self, context: Sequence[int], k: int, cap: int, question: int | None = None, answered: int = 0) -> Recall:
        """The continuation [<= k] of the context where the memory holds what follows it, and the
        match's length (<= cap tokens compared back). question: the request's question_key, and
        answered: the tokens of the context that are its answer so far; when this prompt was
        answered before and the context's last min(cap, all) tokens are what that answer had at
        this point, its continuation (`same_question`). Else the latest place the context's
        suffix (KEY_NS tokens) was followed; Recall([]) when no key length matches."""
        if k <= 0:
            return Recall([])
        with self._lock:
            if not self._tokens:
                return Recall([])
            first, stop = self._answers.get(question, (0, 0)) if question is not None else (0, 0)
            if first + answered < stop:  # that answer went on from here
                length = matched_back(self._tokens, first + answered, context, cap)
                if length >= min(cap, len(context)):
                    tokens = self._follow(first + answered, k)
                    gaps = np.frombuffer(self._gaps[first + answered : first + answered + len(tokens)], np.float32)
                    return Recall(tokens, length, True, gaps if not np.isnan(gaps).any() else NO_GAPS)
            for n in KEY_NS:
                if len(context) < n:
                    continue
                at = self._tables[n].get(hash(tuple(context[-n:])))
                if at is None:
                    continue
                length = matched_back(self._tokens, at, context, cap)  # confirms the key and measures the match
                if length < n:  # a hash collision, not the n-gram
                    continue
                return Recall(self._follow(at, k), length)
        return Recall([])

    def _follow(self, at: int, k: int) -> list[int]:
        """Up to k tokens from `at`, to the end of their entry."""
        toks, end = self._tokens, at
        while end < len(toks) and end - at < k and toks[end] != _SEP:
            end += 1
        return toks[at:end]

    def _index(self, entry: _Entry) -> None:
        base = len(self._tokens)
        self._tokens.extend(entry.tokens)
        self._tokens.append(_SEP)
        self._gaps.extend(entry.gaps.tolist())
        self._gaps.append(math.nan)
        if entry.question is not None:
            self._answers[entry.question] = (base + entry.answer_at, base + len(entry.tokens))
        for n, table in self._tables.items():
            # every n-gram inside the entry that something in the entry follows
            for end in range(base + n, base + len(entry.tokens)):
                table[hash(tuple(self._tokens[end - n : end]))] = end

    def _drop_oldest(self, room: int) -> None:
        """Keep the newest entries that leave `room` tokens and at most half the capacity."""
        keep, size = [], 0
        for e in reversed(self._entries):
            if size + len(e.tokens) + 1 + room > max(self.capacity // 2, room):
                break
            keep.append(e)
            size += len(e.tokens) + 1
        self._entries = deque(reversed(keep))
        self._reindex()

    def _reindex(self) -> None:
        """Index the entries kept afresh (their positions moved)."""
        self._tokens = []
        self._gaps = array("f")
        for t in self._tables.values():
            t.clear()
        self._answers.clear()
        for e in self._entries:
            self._index(e)
