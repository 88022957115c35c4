"""Training data for the MTP head: the target's hidden states and next-token distributions.

The real target runs over a corpus through `Runtime` with embeddings on; every evaluated
position i yields one record:

    token    t_i                      int32
    hidden   h_i  [n_embd]            float16   final post-norm state (llama.cpp's t_embd)
    top_ids  [K]  / top_logp [K]      the K most likely next tokens under L_i = W_out h_i, with
                                      their log-probabilities over the FULL vocabulary

The corpus is (1) self-distillation: the target's own greedy answers to chat/coding prompts
(generated here, one plain decoding step at a time, which records hidden states for free),
and (2) windows of source code found on any machine: the Python standard library. Each corpus
item becomes one chunk file `<key>.npz`, written atomically, so a run can stop at any time and
`--resume` skips finished items. Items are ordered deterministically (seeded), so a resumed run
collects the same corpus.

This module needs numpy and the runtime only (no torch): collection can run where torch is not
installed.
"""

from __future__ import annotations

import hashlib
import os
import random
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from homespec.llama.template import ChatTemplate

TOP_K = 16  # next-token candidates stored per position: > 0.95 of the mass on code
SEQ_TOKENS = 384  # tokens per source-code window (a short file's worth of context)
MIN_WINDOW_CHARS = 200  # shorter windows are skipped

CODE_SYSTEM = "You are a careful senior Python engineer. Answer with code only."
# Self-distillation prompts: the target answers them and its answers become training data.
# Disjoint from HELDOUT_PROMPTS and from the bench prompts (homespec/bench_prompts/), on which
# the head is validated.
_TASKS = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Write a Python function `chunked(iterable, n)` that yields lists of n items.",
    "Write a Python function that flattens an arbitrarily nested list.",
    "Write a Python function that returns the prime numbers below n with the sieve of Eratosthenes.",
    "Write a Python function that parses a query string like 'a=1&b=2' into a dict.",
    "Write a Python class `Stack` with push, pop, peek and is_empty methods.",
    "Write a Python function that counts word frequencies in a text file and returns the 10 most common.",
    "Write a Python dataclass `Point` with a method that returns the distance to another point.",
    "Write a Python function that converts a Roman numeral to an integer.",
    "Write a Python function that performs binary search on a sorted list and returns the index or -1.",
    "Write a Python context manager that times the block it wraps and prints the elapsed time.",
    "Write a Python decorator `retry(times)` that retries a function when it raises an exception.",
    "Write a Python function that validates an email address with a regular expression.",
    "Write a Python function that reads a JSON file and returns the keys of the top-level object, sorted.",
    "Write a Python function that computes the Levenshtein distance between two strings.",
    "Write a Python generator that yields the lines of a file that contain a given substring.",
    "Write a Python function that transposes a matrix given as a list of lists.",
    "Write a Python class `Queue` implemented with two stacks.",
    "Write a Python function that groups a list of words by their anagram signature.",
    "Write a Python function that returns the n-th row of Pascal's triangle.",
    "Write a Python script that lists the 5 largest files in a directory tree using pathlib.",
    "Write a Python function that converts a temperature between Celsius, Fahrenheit and Kelvin.",
    "Write a Python function that checks whether a Sudoku board (9x9 list of lists) is valid.",
    "Write a Python async function that fetches several URLs concurrently with asyncio and aiohttp.",
    "Write a Python function that serialises a binary tree to a list in level order.",
    "Write a Python unittest test case for a function `add(a, b)`.",
    "Write a pytest test module for a function `slugify(text)` with several parametrized cases.",
    "Write a Python function that returns all permutations of a string without itertools.",
    "Write a Python function that computes a moving average over a list with a given window.",
    "Write a Python class `BankAccount` with deposit, withdraw and a balance that cannot go negative.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that finds the longest common prefix of a list of strings.",
    "Write a Python argparse command-line tool that renames files by adding a prefix.",
    "Write a Python function that computes the SHA-256 of a file, reading it in blocks.",
    "Write a Python function that returns the k most frequent elements of a list using heapq.",
    "Write a Python function that detects a cycle in a directed graph given as an adjacency dict.",
    "Write a Python function that performs a topological sort of a dependency graph.",
    "Write a Python function that implements Dijkstra's shortest path algorithm with heapq.",
    "Write a Python function that converts a snake_case string to camelCase.",
    "Write a Python class that implements a simple trie with insert and starts_with.",
    "Write a Python function that rotates a list by k positions to the right.",
    "Write a SQL query that returns the three customers with the highest total order amount, and explain it.",
    "Write a JavaScript function that debounces another function.",
    "Write a bash script that backs up a directory into a dated tar.gz archive.",
    "Write a Python function that parses a log line like '2024-01-02 12:00:00 ERROR message' into a dict.",
    "Write a Python function that returns the intersection of two lists, keeping order and duplicates once.",
    "Write a Python class `Matrix` with addition and multiplication operators.",
    "Write a Python function that formats a number of bytes as a human-readable string (KiB, MiB, ...).",
    "Write a Python function that checks whether parentheses, brackets and braces in a string are balanced.",
    "Write a Python function that downloads a web page with urllib and returns its title.",
    "Write a Python function that splits a list into n nearly equal parts.",
    "Write a Python class `Vector2` with addition, scalar multiplication, length and normalisation.",
    "Write a Python function that converts a list of dicts into a CSV string with csv.DictWriter.",
    "Write a Python function that finds duplicate files in a directory by comparing their hashes.",
    "Write a Python function that evaluates a Reverse Polish Notation expression.",
    "Write a Python function that returns the longest increasing subsequence of a list.",
    "Write a Python function that deep-merges two nested dictionaries.",
    "Write a Python class `EventEmitter` with on, off and emit methods.",
    "Write a Python function that generates a random password with letters, digits and symbols using secrets.",
    "Write a Python function that computes the median of a list without using statistics.",
    "Write a Python function that parses a simple INI file with configparser and returns a dict of dicts.",
    "Write a Python function that returns the first non-repeating character in a string.",
    "Write a Python function that implements quicksort and a test that compares it with sorted().",
    "Write a Python function that checks whether two strings are anagrams.",
    "Write a Python function that converts a datetime to a 'time ago' string like '3 hours ago'.",
    "Write a Python class `Graph` with add_edge and a breadth-first search method.",
    "Write a Python function that returns the number of islands in a grid of '1' and '0' characters.",
    "Write a Python function that zips two lists into a dict and raises ValueError if their lengths differ.",
    "Write a Python function that tails the last n lines of a large file efficiently.",
    "Write a Python function that memoises a recursive function with functools.lru_cache and explain it.",
    "Write a Python generator that yields Fibonacci-like sequences given any two starting numbers.",
    "Write a Python function that validates an IPv4 address without regular expressions.",
    "Write a Python script that watches a directory and prints new files every second.",
    "Write a Python function that computes the greatest common divisor and least common multiple of a list.",
    "Write a Python dataclass `Invoice` with line items and a method that returns the total with tax.",
    "Write a Python function that wraps text to a given width without using textwrap.",
    "Write a Python function that returns all subsets of a set.",
    "Write a Python function that counts the vowels and consonants in a string.",
    "Write a Python function that encodes and decodes a string with the Caesar cipher.",
    "Write a Python function that reads environment variables into a typed settings object with defaults.",
    "Write a Python class `Timer` usable as a decorator and as a context manager.",
    "Write a Python function that removes duplicates from a list while keeping the first occurrence order.",
    "Write a Python function that finds the k-th largest element of a list.",
    "Write a Python function that converts an integer to binary, octal and hexadecimal strings.",
    "Write a Python function that sends a JSON POST request with urllib and returns the decoded response.",
    "Write a Python function that simulates rolling two dice 10000 times and returns the frequency of each sum.",
    "Write a Python function that checks whether a number is an Armstrong number.",
    "Write a Python function that computes the dot product and the cosine similarity of two vectors.",
    "Write a Python function that parses command-line style 'key=value' arguments into a dict.",
]
_QUESTIONS = [
    "Explain the difference between a list and a tuple in Python, with a short example.",
    "What does the `yield` keyword do in Python? Show a small example.",
    "Explain Python's GIL in a few sentences.",
    "How do I read a file line by line in Python without loading it all into memory?",
    "What is the difference between `==` and `is` in Python?",
    "Explain what a Python decorator is and write a simple one.",
    "How do virtual environments work in Python, and why should I use them?",
    "Explain list comprehensions with three examples of increasing complexity.",
    "What are Python's dunder methods? Give examples of `__repr__` and `__eq__`.",
    "Explain the difference between processes and threads, and when to use multiprocessing in Python.",
    "Explain big-O notation with examples from common Python operations.",
    "How does exception handling work in Python? Show try, except, else and finally.",
]
TRAIN_PROMPTS: list[tuple[str | None, str]] = [(CODE_SYSTEM, t) for t in _TASKS] + [(None, q) for q in _QUESTIONS]

# Held-out code prompts for validating acceptance through the engine (never collected).
HELDOUT_PROMPTS: list[str] = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function `run_length_encode(s)` that compresses 'aaabcc' to 'a3b1c2', and its inverse.",
    "Write a Python class `MinHeap` with push, pop and peek, implemented on a list without heapq.",
    "Write a Python function that reads a text file and returns the number of lines, words and characters.",
    "Write a Python function that returns the maximum subarray sum (Kadane's algorithm) with a docstring.",
    "Write a Python function that converts an integer to its English words, e.g. 123 -> 'one hundred twenty-three'.",
    "Write a Python function that finds all files with a given extension under a directory, using os.walk.",
    "Write a Python class `RateLimiter` that allows at most n calls per second, using time.monotonic.",
]


@dataclass(frozen=True)
class CorpusItem:
    key: str  # chunk file stem, unique and stable: "chat-0007", "code-0123"
    kind: str  # "chat" (self-distilled answer) | "code" (source window)
    text: str  # code window text, or the user message for "chat"
    system: str | None = None  # chat only


@dataclass
class Record:
    """One corpus item's positions, as stored in its chunk."""

    tokens: np.ndarray  # [n] int32
    hidden: np.ndarray  # [n, d] float16
    top_ids: np.ndarray  # [n, K] int32
    top_logp: np.ndarray  # [n, K] float32
    prompt_len: int  # chat: positions before the answer; code: 0


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's .py files (tests excluded: they are long and repetitive)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__")
    return sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))


def code_window(path: Path, rng: random.Random, chars: int = SEQ_TOKENS * 4) -> str:
    """A window of ~chars characters starting at a random line (files begin with boilerplate)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines(keepends=True)
    start = rng.randrange(max(1, len(lines) - 20)) if len(lines) > 40 else 0
    return "".join(lines[start:])[:chars]


def corpus_items(seed: int = 0, code_files: Sequence[Path] | None = None) -> Iterator[CorpusItem]:
    """Chat prompts first (the serving distribution, most valuable), then code windows."""
    for i, (system, user) in enumerate(TRAIN_PROMPTS):
        yield CorpusItem(f"chat-{i:04d}", "chat", user, system)
    files = list(code_files if code_files is not None else stdlib_files())
    rng = random.Random(seed)
    rng.shuffle(files)
    for i, path in enumerate(files):
        text = code_window(path, rng)
        if len(text) >= MIN_WINDOW_CHARS:  # empty __init__.py files and the like teach nothing
            yield CorpusItem(f"code-{i:04d}", "code", text)


def top_k(logits: np.ndarray, k: int = TOP_K) -> tuple[np.ndarray, np.ndarray]:
    """logits [n, V] -> (ids [n, k] best first, log-probabilities [n, k] over all V)."""
    idx = np.argpartition(-logits, k, axis=1)[:, :k]  # [n, k] unordered
    vals = np.take_along_axis(logits, idx, axis=1)  # [n, k]
    order = np.argsort(-vals, axis=1)
    idx, vals = np.take_along_axis(idx, order, 1), np.take_along_axis(vals, order, 1)
    m = logits.max(axis=1, keepdims=True)  # [n, 1]
    lse = m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True))  # [n, 1]
    return idx.astype(np.int32), (vals - lse).astype(np.float32)


class _Recorder:
    """Evaluates tokens on an embeddings-enabled runtime and keeps each position's record."""

    def __init__(self, rt) -> None:  # rt: homespec.llama.runtime.Runtime with embeddings on
        self.rt = rt
        self.tokens: list[int] = []
        self.hidden: list[np.ndarray] = []
        self.ids: list[np.ndarray] = []
        self.logp: list[np.ndarray] = []

    def eval(self, tokens: Sequence[int]) -> np.ndarray:
        logits = self.rt.eval(tokens, output="all")  # [n, V]
        assert self.rt.last_hidden is not None, "runtime must be opened with embeddings=True"
        ids, logp = top_k(logits)
        self.tokens += [int(t) for t in tokens]
        self.hidden.append(self.rt.last_hidden.astype(np.float16))
        self.ids.append(ids)
        self.logp.append(logp)
        return logits[-1]

    def record(self, prompt_len: int) -> Record:
        return Record(
            np.asarray(self.tokens, dtype=np.int32),
            np.concatenate(self.hidden),
            np.concatenate(self.ids),
            np.concatenate(self.logp),
            prompt_len,
        )


def collect_item(rt, item: CorpusItem, template: ChatTemplate, max_answer: int) -> Record:
    """Evaluate one item on the target (fresh cache) and return its positions."""
    rt.reset()
    rec = _Recorder(rt)
    if item.kind == "code":
        tokens = rt.tokenize(item.text, add_special=True, parse_special=False)[:SEQ_TOKENS]
        rec.eval(tokens)
        return rec.record(0)
    messages = ([{"role": "system", "content": item.system}] if item.system else []) + [
        {"role": "user", "content": item.text}
    ]
    prompt = rt.tokenize(template.render(messages), add_special=False, parse_special=True)
    last = rec.eval(prompt)
    # Plain greedy decoding, one pass per token: the answer is exactly what the target says.
    for _ in range(max_answer):
        tok = int(np.argmax(last))
        if rt.is_eog(tok):
            break
        last = rec.eval([tok])
    return rec.record(len(prompt))


def save_record(path: Path, rec: Record, kind: str) -> None:
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, tokens=rec.tokens, hidden=rec.hidden, top_ids=rec.top_ids, top_logp=rec.top_logp,
             prompt_len=np.int64(rec.prompt_len), kind=np.asarray(kind))
    os.replace(tmp, path)  # a killed run never leaves a half-written chunk


def load_record(path: Path) -> Record:
    with np.load(path) as z:
        return Record(z["tokens"], z["hidden"], z["top_ids"], z["top_logp"], int(z["prompt_len"]))


def _n_tokens(path: Path) -> int:
    with np.load(path) as z:
        return int(z["tokens"].shape[0])


def chunk_paths(data_dir: Path) -> list[Path]:
    return sorted(p for p in Path(data_dir).glob("*.npz") if not p.name.endswith(".tmp.npz"))


def data_digest(data_dir: Path) -> str:
    """sha256 over the chunks' names and token ids: identifies the training data in the JSON."""
    h = hashlib.sha256()
    for p in chunk_paths(data_dir):
        h.update(p.name.encode())
        with np.load(p) as z:
            h.update(z["tokens"].tobytes())
    return h.hexdigest()


@dataclass
class CollectSummary:
    items: int  # chunks of the selected kinds on disk after this run
    tokens: int  # their positions
    new_tokens: int  # positions collected by this run
    seconds: float


def _kind_of(key: str) -> str:
    return key.split("-", 1)[0]


def collect(
    rt,
    out_dir: Path,
    budget_tokens: int,
    *,
    kinds: Sequence[str] = ("chat", "code"),
    resume: bool = True,
    max_answer: int = 192,
    seed: int = 0,
    progress: Callable[[str, int, int, float], None] | None = None,
) -> CollectSummary:
    """Fill out_dir with chunks of `kinds` until they hold budget_tokens positions (or the
    corpus ends).

    rt: a Runtime opened with embeddings=True (n_ctx >= prompt + max_answer). With resume, chunks
    already on disk count towards the budget and are not collected again. Two runs with disjoint
    `kinds` may share out_dir at the same time (they write different chunk files).
    progress(key, tokens_total, budget, tokens_per_s) is called after each item.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        for p in chunk_paths(out_dir):
            if _kind_of(p.stem) in kinds:
                p.unlink()
    have = {p.stem: p for p in chunk_paths(out_dir) if _kind_of(p.stem) in kinds}
    total = sum(_n_tokens(p) for p in have.values())
    template = ChatTemplate(rt.chat_template)
    t0, new, items = time.perf_counter(), 0, len(have)
    for item in corpus_items(seed):
        if total >= budget_tokens:
            break
        if item.kind not in kinds or item.key in have:
            continue
        rec = collect_item(rt, item, template, max_answer)
        save_record(out_dir / f"{item.key}.npz", rec, item.kind)
        n = int(rec.tokens.shape[0])
        total, new, items = total + n, new + n, items + 1
        if progress:
            progress(item.key, total, budget_tokens, new / max(time.perf_counter() - t0, 1e-9))
    rt.reset()
    return CollectSummary(items, total, new, time.perf_counter() - t0)
