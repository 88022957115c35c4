"""Prompt lookup across requests: what earlier answers said, for drafting a later one.

Home apps ask the same things again: a voice assistant's daily "turn on the kitchen lights", a
chat UI's regenerate, an editor asking for the same completion after an undo. At temperature 0
the answer is the same text, so the earlier answer is a near-perfect draft; llama-server's
`ngram-mod` keeps such a pool across its slots for the same reason. Verification is unchanged,
so what the memory proposes never changes what the target says (a greedy answer stays its
argmax; a sampled one keeps its distribution); it only changes how many passes it takes.

Each finished generation leaves its answer here with the last TAIL tokens of its prompt (what
leads into the answer: the end of the question and the chat template's turn marker). A lookup
takes the context's last n tokens for n in KEY_NS, longest first, finds where they were last
followed by something, and measures the match back as far as MATCH_CAP tokens, as the
per-request index does: a repeated question matches 32 tokens back; a phrase that happens to
recur, a few. Entries never run into each other (a separator no token equals lies between).

Bounded: at most `capacity` tokens; past it the oldest half of the entries is dropped and the
rest re-indexed (~2 ms per 10k tokens, once per capacity/2 tokens remembered). Memory: ~80
bytes a token per key length (dict entries keyed by the n-gram's hash), ~8 MB at 32k tokens.

It is one object per daemon, shared by every slot's prompt lookup; requests of one slot end
while another's decide, so it takes a lock.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

# Tokens of the prompt kept before each answer: enough to measure a repeated question's match to
# MATCH_CAP and to key its first answer token on the question rather than the template alone.
TAIL = 48
# Key lengths, longest first: 12 places a repeated answer even among many that share phrases;
# 4 finds the thread again after the answer left it for a few tokens.
KEY_NS = (12, 4)
_SEP = -1  # between entries: no token id equals it, so matches and drafts stop there


class NgramMemory:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # tokens, separators included; 0: remembers nothing
        self._entries: deque[list[int]] = deque()  # [tail + answer] per generation, oldest first
        self._tokens: list[int] = []  # the entries, each followed by _SEP
        self._tables: dict[int, dict[int, int]] = {n: {} for n in KEY_NS}  # n -> hash(n-gram) -> position after it
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._tokens)

    def add(self, context: Sequence[int], prompt_len: int) -> None:
        """Remember a finished generation: `context` is its prompt (the first prompt_len tokens)
        and its answer. A generation that answered nothing leaves nothing."""
        if self.capacity <= 0 or len(context) <= prompt_len:
            return
        entry = [int(t) for t in context[max(0, prompt_len - TAIL) :]][-(self.capacity - 1) :]
        with self._lock:
            if len(self._tokens) + len(entry) + 1 > self.capacity:
                self._drop_oldest(len(entry) + 1)
            self._entries.append(entry)
            self._index(entry)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._tokens.clear()
            for t in self._tables.values():
                t.clear()

    def lookup(self, context: Sequence[int], k: int, cap: int) -> tuple[list[int], int]:
        """The continuation [<= k] of the context's suffix where it last occurred here, and the
        match's length (<= cap tokens compared back); ([], 0) when no key length matches."""
        if not self._tokens or k <= 0:
            return [], 0
        with self._lock:
            toks = self._tokens
            for n in KEY_NS:
                if len(context) < n:
                    continue
                at = self._tables[n].get(hash(tuple(context[-n:])))
                if at is None:
                    continue
                length = 0  # compared back from the continuation: confirms the key and measures the match
                while length < cap and at - length > 0 and toks[at - length - 1] == context[-length - 1]:
                    length += 1
                    if length == len(context):
                        break
                if length < n:  # a hash collision, not the n-gram
                    continue
                end = at
                while end < len(toks) and end - at < k and toks[end] != _SEP:
                    end += 1
                return toks[at:end], length
        return [], 0

    def _index(self, entry: list[int]) -> None:
        base = len(self._tokens)
        self._tokens.extend(entry)
        self._tokens.append(_SEP)
        for n, table in self._tables.items():
            # every n-gram inside the entry that something in the entry follows
            for end in range(base + n, base + len(entry)):
                table[hash(tuple(self._tokens[end - n : end]))] = end

    def _drop_oldest(self, room: int) -> None:
        """Keep the newest entries that leave `room` tokens and at most half the capacity."""
        keep, size = [], 0
        for e in reversed(self._entries):
            if size + len(e) + 1 + room > max(self.capacity // 2, room):
                break
            keep.append(e)
            size += len(e) + 1
        self._entries = deque(reversed(keep))
        self._tokens = []
        for t in self._tables.values():
            t.clear()
        for e in self._entries:
            self._index(e)
