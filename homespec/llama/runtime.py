"""A thin wrapper over llama-cpp-python's low-level API: the only module that touches llama_cpp.

One `Runtime` is one model and one context. Its KV cache holds `n_seq` sequences (slots, for
requests decoded together); the Runtime itself speaks for sequence 0, `slot(i)` for any. Each
remembers which tokens its KV cache holds (`tokens`), so callers speak in token lists:

    rt.eval(tokens, output="all")  -> logits [n, vocab] for the appended tokens
    rt.truncate(n)                 -> drop cache entries from position n on
    rt.sync(context)               -> make the cache hold `context` reusing the longest common
                                      prefix, return the logits after it [vocab]
    rt.hidden_rows(a, b)           -> the target's final hidden states of positions a..b-1,
                                      kept for the last `hidden_window` positions (MTP head)

It asks llama.cpp for logits only at the positions it uses (the batch's per-token output flags):
the high-level `Llama(logits_all=True)` keeps an n_ctx x vocab array and runs the output layer
over the whole prompt (DESIGN.md: +1.1 GB RSS, +8 % prefill).

Several sequences: `eval_many` packs tokens of several slots into one llama_decode. By default
each sequence has a KV stream of its own (`kv_unified` off, as llama-server's `-np N`): its rows
attend over its own cells only. In the unified cache (one buffer for all sequences) every token
attends, masked, over the cells of all of them, so the passes grow with the other slots'
histories: on a 2-core Xeon, four one-row steps beside four 2,000-token histories took 310 ms
unified and 240 ms in streams, a lone step beside them 168 and 113 ms, and four requests with
~1,000-token prompts finished in 0.81x the time in streams. With ~100-token prompts the two
were even there (0.998x), and on the AVX2 EPYC four clients with such prompts got more tokens/s
from the daemon unified in 7 of 7 interleaved rounds: short contexts are where unified can win,
long ones (a voice assistant's system prompt, a chat's history) where streams do. What streams
give up: a pass whose sequences bring different numbers of rows runs as several graphs
(eval_many; a slot missing between two others is bridged by a throwaway row until the highest
moves into its stream, Runtime._compact), and a prefix borrowed from another slot is copied
rather than shared (Slot.share_prefix). Exact mode needs streams: in a shared buffer a sequence
that grows into cells another freed leaves position order (kernels.py). Each slot may hold
n_ctx tokens; the cache holds n_ctx x n_seq.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import re
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from homespec.errors import ModelError
from homespec.llama.cpu_build import installed_package_dir, read_stamp, require_matching_build
from homespec.llama.fim import FimTokens
from homespec.llama.gguf_info import KvType
from homespec.llama.kernels import fix_tiled_matmul, pass_kernels, reference_kernels_available, tiled_matmul_in_effect
from homespec.tokens import common_prefix

require_matching_build()  # before llama.cpp loads: a build for another CPU dies with SIGILL

import llama_cpp  # noqa: E402

log = logging.getLogger("homespec.llama.runtime")
_llama_log = logging.getLogger("homespec.llama_cpp")

Output = Literal["all", "last", "none"]
_C_SPACE = " \t\n\v\f\r"  # C isspace(), what llama.cpp strips around lstrip/rstrip tokens

_backend_lock = threading.Lock()
_backend_ready = False


@dataclass(eq=False)
class KvState:
    """One sequence's KV cells as llama.cpp serialises them: the first `size` bytes of `buf`, which
    may be longer (a buffer used again; see PrefixCache's spare buffers)."""

    buf: StateBuffer
    size: int  # bytes

    @property
    def nbytes(self) -> int:
        return len(self.buf)  # bytes held in RAM


# A writable buffer a KV state is written into: a block of the prefix cache's arena
# (state_arena.py), or else a new one (state_buffer, below).
StateBuffer = bytearray | mmap.mmap | memoryview

# Above this a state buffer is an anonymous mapping that asks for transparent huge pages: on a
# 2-core Xeon VM (THP "madvise"), a fresh 34 MiB buffer filled took 5.9 ms so, 15.5 ms in 4 KiB
# pages and 38.5 ms as a bytearray, which is zeroed first (medians of 8, one thread). Fresh
# pages stay dear there all the same: some runs of allocations faulted in at ~2.7 ms a MiB
# (85-93 ms for 34 MiB, in the daemon too), whence the prefix cache's arena.
_MAPPED_BUFFER = 2 << 20  # bytes: one huge page


def state_buffer(size: int) -> StateBuffer:
    """A new buffer for a state of `size` bytes (rounded up to 64 KiB)."""
    step = 64 << 10  # bytes
    n = -(-size // step) * step  # bytes
    if n < _MAPPED_BUFFER:
        return bytearray(n)
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # (no THP: 4 KiB pages, still not zeroed twice)
        buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


# Warnings llama.cpp gives about a model file it then handles itself: every Qwen2.5 GGUF loads
# with "control-looking token: 128247 '</s>' was not control-type; this is probably a bug in the
# model", at each start of the daemon and each `homespec run`, for target and draft alike.
_HANDLED_WARNINGS = ("control-looking token",)


def llama_log_level(level: int, msg: str) -> int:
    """The logging level of a llama.cpp log line: its warnings and errors stay visible (but for
    _HANDLED_WARNINGS), the rest of its chatter at load goes to debug. ggml levels: 1 debug,
    2 info, 3 warn, 4 error, 5 continuation of the previous line."""
    if level == 3 and any(w in msg for w in _HANDLED_WARNINGS):
        return logging.DEBUG
    return {3: logging.WARNING, 4: logging.ERROR}.get(level, logging.DEBUG)


_load_lock = threading.Lock()  # one model load at a time, so that _load_log holds its messages only
_load_log: list[str] | None = None  # llama.cpp's messages while a model loads (Runtime.__init__)
_WEIGHT_BUFFER = re.compile(r"(\S+) model buffer size = +([\d.]+) MiB")


@llama_cpp.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    msg = text.decode("utf-8", "replace").rstrip()
    if msg:
        if _load_log is not None:
            _load_log.append(msg)
        _llama_log.log(llama_log_level(level, msg), msg)


def _load_model(path: Path, mp: llama_cpp.llama_model_params) -> tuple[Any, dict[str, float]]:
    """llama_model_load_from_file, and where llama.cpp put the weights: MiB by buffer type, as
    its load reports them ("AMX model buffer size = 613.2 MiB"); llama.cpp has no call for it."""
    global _load_log
    with _load_lock:
        _load_log = []
        try:
            model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
            lines = _load_log
        finally:
            _load_log = None
    buffers: dict[str, float] = {}
    for m in filter(None, map(_WEIGHT_BUFFER.search, lines)):
        buffers[m.group(1)] = buffers.get(m.group(1), 0.0) + float(m.group(2))
    return model, buffers


def _init_backend() -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _backend_ready = True


def physical_cores() -> int:
    """Physical cores: llama.cpp's matmuls gain nothing from hyper-threads."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except Exception:  # psutil may not know on exotic platforms
        n = None
    return max(1, n or os.cpu_count() or 1)


_FLASH_ATTN = {
    None: llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
    True: llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    False: llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}

_KV_TYPE = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}


@dataclass(frozen=True)
class RuntimeOptions:
    n_ctx: int = 4096  # tokens
    n_batch: int = 512  # tokens per llama_decode call
    n_threads: int | None = None  # None = physical cores
    n_gpu_layers: int = 0  # -1 = all
    use_mmap: bool = True
    use_mlock: bool = False
    embeddings: bool = False  # also return final hidden states (the MTP head reads them)
    flash_attn: bool | None = None  # None: llama.cpp decides (it enables it on a CPU as well)
    # Keep the final hidden states of the last `hidden_window` cached positions (the MTP head's
    # attention span); 0 = off. llama.cpp computes the output layer for every position of a
    # batch while embeddings are on, so only the last hidden_window positions of a prefill are
    # evaluated with them on; speculative steps output every position anyway (cost ~0).
    hidden_window: int = 0
    # KV-cache sequences (slots): requests decoded together, each holding up to n_ctx tokens.
    # Hidden states are kept for slot 0 only (the MTP head serves the slot a lone request gets).
    n_seq: int = 1
    # llama.cpp's repacked weight layouts (use_extra_bufts); off for batch-invariant rows (kernels.py)
    repack: bool = True
    kv_type: KvType = "f16"  # KV cache element type (q8_0: kernels.py, exact mode)
    # False: a stream per sequence (the default, config runtime.kv_unified; module docstring),
    # whose cells also stay in position order whatever the others do (exact mode, kernels.py).
    # True: one buffer for all sequences.
    kv_unified: bool = False
    # ggml's tiled matmul for passes of 8+ rows: True/False, None = llama.cpp's default. One
    # setting per process: the first Runtime's wins (kernels.fix_tiled_matmul).
    tiled_matmul: bool | None = None
    # Decode passes (a part asks for every row's logits: output "all") on llama.cpp's reference
    # CPU kernels, prompt passes on its usual ones: rows of any count that do not depend on their
    # pass (exact mode, kernels.py). Needs a build with the switch (kernels.reference_kernels_available).
    reference_decode: bool = False
    # Streams: a slot missing between those of a pass gets a throwaway row, and short steps
    # throwaway rows up to the longest where that is cheap (stream_layout), so the pass runs as
    # one graph and not one per run of neighbouring slots of equal steps. Off in exact mode,
    # whose narrow passes count their rows (kernels.py).
    fill_stream_gaps: bool = True


class Runtime:
    """One GGUF model; its own Target methods act on KV-cache sequence 0, `slot(i)` reaches the
    others. Not thread-safe: one caller at a time."""

    def __init__(self, path: str | Path, opts: RuntimeOptions = RuntimeOptions()) -> None:
        _init_backend()
        self.path = Path(path)
        self.opts = opts
        if not self.path.is_file():
            raise ModelError(f"model file not found: {self.path}")
        self.tiled_matmul: bool = fix_tiled_matmul(opts.tiled_matmul)  # before any matrix product
        if opts.reference_decode and not reference_kernels_available():
            raise ModelError("reference_decode: this llama.cpp build cannot switch to its reference kernels "
                             "(rebuild it with `make install`)")
        mp = llama_cpp.llama_model_default_params()
        mp.use_extra_bufts = opts.repack
        mp.n_gpu_layers = opts.n_gpu_layers if opts.n_gpu_layers >= 0 else 10_000
        mp.load_mode = {
            (True, True): llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK,
            (True, False): llama_cpp.LLAMA_LOAD_MODE_MMAP,
            (False, True): llama_cpp.LLAMA_LOAD_MODE_MLOCK,
            (False, False): llama_cpp.LLAMA_LOAD_MODE_NONE,
        }[(opts.use_mmap, opts.use_mlock)]
        self._model, self.weight_buffers = _load_model(self.path, mp)  # MiB by llama.cpp buffer type
        if not self._model:
            raise ModelError(f"llama.cpp could not load {self.path} (not a GGUF it supports?)")
        # Speculation rolls rejected tokens back out of the cache (truncate); a recurrent state
        # (Mamba, RWKV) or a hybrid one cannot drop a suffix, so such a model cannot be served.
        kind = ("recurrent" if llama_cpp.llama_model_is_recurrent(self._model)
                else "hybrid (attention + recurrent)" if llama_cpp.llama_model_is_hybrid(self._model) else None)
        if kind:
            llama_cpp.llama_model_free(self._model)
            self._model = None
            raise ModelError(f"{self.path}: {kind} models are not supported: homespec needs a KV cache "
                             "that can drop rejected draft tokens")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab: int = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.n_embd: int = llama_cpp.llama_model_n_embd(self._model)

        threads = opts.n_threads or physical_cores()
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = opts.n_ctx * opts.n_seq
        cp.n_batch = opts.n_batch
        cp.n_ubatch = opts.n_batch
        cp.n_seq_max = opts.n_seq
        cp.kv_unified = opts.kv_unified
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.embeddings = opts.embeddings
        cp.flash_attn_type = _FLASH_ATTN[opts.flash_attn]
        cp.type_k = cp.type_v = _KV_TYPE[opts.kv_type]
        if opts.embeddings or opts.hidden_window:
            cp.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE  # per-token hidden states
        self._ctx = llama_cpp.llama_init_from_model(self._model, cp)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            self._model = None
            raise ModelError(f"llama.cpp could not create a context of {opts.n_ctx} tokens for {self.path}")
        self.n_ctx: int = llama_cpp.llama_n_ctx(self._ctx) // opts.n_seq  # tokens per sequence
        self.n_threads = threads
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(opts.n_batch, 0, 1)
        self._slots = [Slot(self, i) for i in range(opts.n_seq)]  # by slot number: slot(i) is always the same Slot
        self._by_seq = list(self._slots)  # by KV sequence id: compaction moves slots between streams (_compact)
        self._gap_passes = 0  # passes in a row whose sequences left the same gap (_compact)
        self._gaps: list[int] = []
        self.tokens: list[int] = self._slots[0].tokens  # what sequence 0 holds, position i = tokens[i]
        self.eog_ids: frozenset[int] = frozenset(
            t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t)
        )
        self.bos_id: int = llama_cpp.llama_vocab_bos(self._vocab)
        eot = llama_cpp.llama_vocab_eot(self._vocab)  # end of text (turn), else end of sentence, as llama.cpp's infill sampler
        self.eot_id: int = eot if eot >= 0 else llama_cpp.llama_vocab_eos(self._vocab)
        self.add_bos: bool = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self.last_hidden: np.ndarray | None = None  # [n_out, n_embd] from the last eval, if enabled
        self._embeddings_on = opts.embeddings  # llama.cpp's current setting (toggled per batch)
        # Hidden states of positions [_hid_start, _hid_start + _hid_n), rows of _hid; kept only
        # as a suffix of self.tokens. Capacity 2 W so that appending moves rows rarely.
        self._hid = np.empty((2 * opts.hidden_window, self.n_embd), np.float32) if opts.hidden_window else None
        self._hid_start = 0
        self._hid_n = 0

    # -- evaluation ---------------------------------------------------------------------------

    def eval(self, tokens: Sequence[int], output: Output = "all") -> np.ndarray:
        """Append `tokens` to the cache; return logits [n_out, vocab] float32 (a copy).

        n_out is len(tokens) for "all", 1 for "last", 0 for "none". Long inputs are split into
        n_batch chunks; only the chunk holding requested outputs produces logits.
        """
        n = len(tokens)
        if n == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        if len(self.tokens) + n > self.n_ctx:
            raise ContextFull(len(self.tokens) + n, self.n_ctx)
        outs: list[np.ndarray] = []
        hidden: list[np.ndarray] = []
        step = self.opts.n_batch
        w = self.opts.hidden_window
        # Positions [split, n) of this batch end up among the last W cached: they need hidden states.
        split = max(0, n - w) if w else n
        if w and split > 0:
            self._hid_n, self._hid_start = 0, len(self.tokens) + split  # older states are dropped
        for a, b, emb in ((0, split, self.opts.embeddings), (split, n, True)):
            if a == b:
                continue
            self._set_embeddings(emb)
            for start in range(a, b, step):
                chunk = tokens[start : min(start + step, b)]
                is_last_chunk = start + step >= b and b == n
                want = [output == "all" or (output == "last" and is_last_chunk and i == len(chunk) - 1) for i in range(len(chunk))]
                pos0 = len(self.tokens)
                # With embeddings on llama.cpp outputs every position anyway (and warns when the
                # flags say otherwise): ask for all, keep the wanted logits rows.
                self._decode(chunk, [True] * len(chunk) if emb else want, decode_rows=output == "all")
                if emb:
                    self._read_all_outputs(pos0, want, outs, hidden)
                elif any(want):
                    outs.append(self._read(llama_cpp.llama_get_logits(self._ctx), sum(want), self.n_vocab))
        if self.opts.embeddings:
            self.last_hidden = np.concatenate(hidden) if hidden else None
        if not outs:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def _set_embeddings(self, on: bool) -> None:
        if on != self._embeddings_on:
            llama_cpp.llama_set_embeddings(self._ctx, on)
            self._embeddings_on = on

    def _read_all_outputs(self, pos0: int, want: list[bool], outs: list[np.ndarray], hidden: list[np.ndarray]) -> None:
        """After a batch decoded with embeddings on, where llama.cpp outputs every position
        whatever the flags: pick the wanted logits rows, keep the hidden states."""
        n = len(want)
        emb = np.ctypeslib.as_array(llama_cpp.llama_get_embeddings(self._ctx), shape=(n * self.n_embd,)).reshape(n, self.n_embd)
        n_out = sum(want)
        if n_out == n:
            outs.append(self._read(llama_cpp.llama_get_logits(self._ctx), n, self.n_vocab))
        elif n_out:
            outs.append(np.stack([self._read(llama_cpp.llama_get_logits_ith(self._ctx, i), 1, self.n_vocab)[0]
                                  for i in range(n) if want[i]]))
        if self.opts.embeddings and n_out:
            hidden.append(emb[np.asarray(want)].copy())
        if self._hid is not None:
            self._push_hidden(pos0, emb)

    def _push_hidden(self, pos0: int, rows: np.ndarray) -> None:
        """Append the hidden states of positions pos0.. ; at least the last hidden_window stay."""
        w, n = self.opts.hidden_window, rows.shape[0]
        if self._hid_start + self._hid_n != pos0:  # not contiguous with what is kept: start over
            self._hid_start, self._hid_n = pos0, 0
        if n >= w:
            self._hid[:w] = rows[n - w :]
            self._hid_start, self._hid_n = pos0 + n - w, w
            return
        if self._hid_n + n > self._hid.shape[0]:  # full: move the w - n newest rows to the front
            keep = w - n
            self._hid[:keep] = self._hid[self._hid_n - keep : self._hid_n]
            self._hid_start += self._hid_n - keep
            self._hid_n = keep
        self._hid[self._hid_n : self._hid_n + n] = rows
        self._hid_n += n

    @property
    def hidden_start(self) -> int:
        """First position whose hidden state is kept (len(tokens) when none is)."""
        if self._hid_n and self._hid_start + self._hid_n == len(self.tokens):
            return self._hid_start
        return len(self.tokens)

    def hidden_rows(self, start: int, stop: int) -> np.ndarray:
        """Final hidden states of positions [start, stop) as float32 [stop - start, n_embd] (a copy).

        Needs RuntimeOptions.hidden_window; the positions must lie in [hidden_start, len(tokens)).
        """
        if start == stop:
            return np.empty((0, self.n_embd), np.float32)
        if not (self.hidden_start <= start <= stop <= len(self.tokens)):
            raise IndexError(f"hidden states of positions [{start}, {stop}) not kept "
                             f"(kept: [{self.hidden_start}, {len(self.tokens)}))")
        a = start - self._hid_start
        return self._hid[a : a + stop - start].copy()

    def _decode(self, chunk: Sequence[int], want: list[bool], decode_rows: bool) -> None:
        b = self._batch
        pos0 = len(self.tokens)
        b.n_tokens = len(chunk)
        for i, (tok, w) in enumerate(zip(chunk, want)):
            b.token[i] = tok
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = w
        rc = self._llama_decode(b, decode_rows)
        if rc != 0:
            # On a fatal error llama.cpp may keep part of the batch: drop it so the cache again
            # holds exactly self.tokens.
            llama_cpp.llama_memory_seq_rm(self._mem, 0, pos0, -1)
            raise RuntimeError(f"llama_decode failed with code {rc} at position {pos0} ({len(chunk)} tokens)")
        self.tokens.extend(int(t) for t in chunk)

    def slot(self, i: int) -> Slot:
        """KV-cache sequence i as a Target of its own (slot(0) shares this Runtime's cache)."""
        return self._slots[i]

    @property
    def n_seq(self) -> int:
        return len(self._slots)

    @property
    def shares_cells(self) -> bool:
        """One unified buffer: a pass attends over every slot's cells, and a slot borrows another's
        prefix without a copy (Slot.share_prefix)."""
        return self.opts.kv_unified

    @property
    def n_batch(self) -> int:
        """Tokens one llama_decode takes at most."""
        return self.opts.n_batch

    def eval_many(self, parts: Sequence[tuple[Slot, Sequence[int], Output]]) -> list[np.ndarray]:
        """One llama_decode over tokens of several slots: appends each part's tokens to its
        slot; returns each part's logits ([n_out, vocab], as `eval`). The parts name distinct
        slots and hold at most n_batch tokens together (the caller chunks a long prefill).

        With a stream per sequence (kv_unified off) llama.cpp splits the pass into one graph per
        run of consecutive sequence ids, taking the same number of tokens from each
        (llama_batch_allocr::split_equal): the parts go in by slot number, so neighbours share; a
        slot missing between them, and steps shorter than the longest where that makes the pass
        one graph cheaply, get throwaway rows (stream_layout, RuntimeOptions.fill_stream_gaps),
        removed after the pass."""
        if self.shares_cells:
            return self._eval_many(parts)
        self._compact([slot.seq for slot, toks, _ in parts if toks])
        real = {slot.seq: len(toks) for slot, toks, _ in parts}
        run = stream_layout(real) if self.opts.fill_stream_gaps else real
        pads = {seq: n - real.get(seq, 0) for seq, n in run.items() if n > real.get(seq, 0)}
        if sum(run.values()) > self.opts.n_batch or any(len(self._by_seq[seq].tokens) + n > self.n_ctx for seq, n in run.items()):
            pads = {}  # no room for them: the pass as the parts make it
        idle = [(self._by_seq[seq], [], "none") for seq in pads if seq not in real]
        every = sorted([*parts, *idle], key=lambda part: part[0].seq)
        outs = self._eval_many(every, pads)
        by_seq = {slot.seq: out for (slot, _, _), out in zip(every, outs)}
        return [by_seq[slot.seq] for slot, _, _ in parts]  # in the caller's order

    def _compact(self, seqs: Sequence[int]) -> None:
        """With a stream per sequence, a slot left idle between running ones costs each pass a
        throwaway row, or a second graph (stream_layout): an edit that finished early beside three
        long answers left them a pass of four rows' cost for three (2-core EPYC, 300 tokens of
        history: rows in slots 0, 2 and 3 92 ms, in 0, 1 and 2 79). Once the same gap has
        stayed COMPACT_AFTER passes, the highest sequence of the pass moves into it, trading
        streams with the idle slot (each keeps its tokens and cells, and its Slot object: only
        the stream under it changes). Slot 0's stream never moves: a gap lies above the lowest."""
        gaps = stream_gaps(seqs)
        self._gap_passes = self._gap_passes + 1 if gaps and gaps == self._gaps else int(bool(gaps))
        self._gaps = gaps
        if self._gap_passes < COMPACT_AFTER:
            return
        running = sorted(seqs)
        while gaps:
            self._swap_streams(gaps[0], running.pop())  # the highest into the lowest gap
            running = sorted([*running, gaps[0]])
            gaps = stream_gaps(running)
        self._gap_passes, self._gaps = 0, []

    def _swap_streams(self, a: int, b: int) -> None:
        """Trade the KV streams of sequences a and b: the slots' sequence ids trade places and each
        slot's cells follow as a saved state (Slot.save_state / load_state, as share_prefix copies
        across streams). Neither may be 0 (its hidden states and Runtime.tokens stay there)."""
        x, y = self._by_seq[a], self._by_seq[b]
        assert a != b and 0 not in (a, b), "slot 0 keeps its stream"
        states = [(slot, slot.save_state() if slot.tokens else None, list(slot.tokens)) for slot in (x, y)]
        x.seq, y.seq = b, a
        self._by_seq[a], self._by_seq[b] = y, x
        for slot, state, tokens in states:  # each load first empties the stream it lands in
            if state is None:
                slot.reset()
            else:
                slot.load_state(state, tokens)
        log.debug("%s: sequence %d (%d tokens) moved to stream %d beside an idle slot (%d tokens)",
                  self.path.name, b, len(y.tokens), a, len(x.tokens))

    def graphs(self, rows: Sequence[tuple[Slot, int]]) -> list[tuple[int, int]]:
        """The graphs llama.cpp runs a pass of `rows` (tokens per slot) as, in order: (sequences,
        rows) each, as `eval_many` lays the pass out (pass_graphs)."""
        return pass_graphs({slot.seq: n for slot, n in rows}, self.shares_cells, self.opts.fill_stream_gaps)

    def _eval_many(self, parts: Sequence[tuple[Slot, Sequence[int], Output]], pads: Mapping[int, int] = {}) -> list[np.ndarray]:
        """eval_many's pass; pads: throwaway rows after a slot's tokens (its last token again, no
        logits), their cells removed after the pass."""
        n = sum(len(toks) + pads.get(slot.seq, 0) for slot, toks, _ in parts)
        if n > self.opts.n_batch:
            raise ValueError(f"{n} tokens in one pass; n_batch is {self.opts.n_batch}")
        if len({slot.seq for slot, _, _ in parts}) != len(parts):
            raise ValueError("eval_many: two parts name the same slot")
        for slot, toks, _ in parts:
            if len(slot.tokens) + len(toks) + pads.get(slot.seq, 0) > self.n_ctx:
                raise ContextFull(len(slot.tokens) + len(toks), self.n_ctx)
        if n == 0:
            return [np.empty((0, self.n_vocab), np.float32) for _ in parts]
        self._set_embeddings(False)
        if any(slot.seq == 0 for slot, _, _ in parts):
            self._hid_n = 0  # slot 0's kept hidden states stop being contiguous here
        b = self._batch
        i = 0
        n_out: list[int] = []  # [parts] rows of logits each part gets
        for slot, toks, output in parts:
            pos0 = len(slot.tokens)
            for j, tok in enumerate(toks):
                b.token[i] = tok
                b.pos[i] = pos0 + j
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = slot.seq
                b.logits[i] = output == "all" or (output == "last" and j == len(toks) - 1)
                i += 1
            last = ([*slot.tokens[-1:], *toks] or [0])[-1]
            for j in range(pads.get(slot.seq, 0)):
                b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = last, pos0 + len(toks) + j, 1, slot.seq, False
                i += 1
            n_out.append({"all": len(toks), "last": 1 if toks else 0, "none": 0}[output])
        b.n_tokens = n
        rc = self._llama_decode(b, any(output == "all" for _, _, output in parts))
        if rc != 0:
            for slot, _, _ in parts:  # as in _decode: the caches again hold exactly .tokens
                llama_cpp.llama_memory_seq_rm(self._mem, slot.seq, len(slot.tokens), -1)
            raise RuntimeError(f"llama_decode failed with code {rc} ({n} tokens of {len(parts)} sequences)")
        rows = self._read(llama_cpp.llama_get_logits(self._ctx), sum(n_out), self.n_vocab) if sum(n_out) else None
        out, r = [], 0
        for (slot, toks, _), m in zip(parts, n_out):
            slot.tokens.extend(int(t) for t in toks)
            if pads.get(slot.seq):
                llama_cpp.llama_memory_seq_rm(self._mem, slot.seq, len(slot.tokens), -1)
            out.append(rows[r : r + m] if rows is not None and m else np.empty((0, self.n_vocab), np.float32))
            r += m
        return out

    def _llama_decode(self, batch: llama_cpp.llama_batch, decode_rows: bool) -> int:
        """llama_decode; with reference_decode, on the kernels its kind of pass takes."""
        if not self.opts.reference_decode:
            return llama_cpp.llama_decode(self._ctx, batch)
        with pass_kernels(reference=decode_rows):
            return llama_cpp.llama_decode(self._ctx, batch)

    @staticmethod
    def _read(ptr: ctypes._Pointer, rows: int, cols: int) -> np.ndarray:
        # The buffer is overwritten by the next decode: copy.
        return np.ctypeslib.as_array(ptr, shape=(rows * cols,)).reshape(rows, cols).copy()

    def truncate(self, n: int) -> None:
        """Keep the first n positions of the cache; RuntimeError when llama.cpp cannot."""
        self._truncate(0, self.tokens, n)
        self._hid_n = max(0, min(self._hid_n, n - self._hid_start))

    def _truncate(self, seq: int, tokens: list[int], n: int) -> None:
        if n < len(tokens):
            if not llama_cpp.llama_memory_seq_rm(self._mem, seq, n, -1):
                # Only a recurrent or hybrid memory refuses (refused at load). Clearing instead
                # would let decoding go on from position 0 as if the context were still there.
                raise RuntimeError(
                    f"llama.cpp could not truncate the KV cache of {self.path.name} to {n} of {len(tokens)} positions"
                )
            del tokens[n:]

    def sync(self, context: Sequence[int], output: Output = "last") -> np.ndarray:
        """Make the cache hold `context`, reusing the longest common prefix already cached.

        Returns the logits after the last token ([1, vocab] for "last"). At least the final token
        is always evaluated, since its logits are needed.
        """
        return self._slots[0].sync(context, output)

    def reset(self) -> None:
        """Empty sequence 0 (the other slots keep theirs)."""
        self._slots[0].reset()

    # -- saved states (prefix cache) ----------------------------------------------------------

    def save_state(self, into: StateBuffer | None = None) -> KvState:
        """The KV cache of seq 0 (restore with load_state); written into `into` if it is large enough."""
        return self._slots[0].save_state(into)

    def load_state(self, state: KvState, tokens: Sequence[int]) -> None:
        self._slots[0].load_state(state, tokens)  # (a restored cache comes without hidden states)

    def state_size(self) -> int:
        """Bytes save_state would write now (seq 0)."""
        return self._slots[0].state_size()

    def _save_seq(self, seq: int, into: StateBuffer | None) -> KvState:
        # llama.cpp writes straight into the buffer the caller keeps. A copy is no memcpy here
        # but fresh pages: a 1,228-token state of the 1.5B target (34 MiB) took 49 ms (first
        # time 279) through a ctypes buffer and string_at, 24 ms into a new bytearray (now a
        # mapping: state_buffer), 4-7 ms into one written before (2-core Xeon VM).
        size = llama_cpp.llama_state_seq_get_size(self._ctx, seq)  # bytes
        buf = into if into is not None and len(into) >= size else state_buffer(size)
        n = llama_cpp.llama_state_seq_get_data(self._ctx, (ctypes.c_uint8 * size).from_buffer(buf), size, seq)
        return KvState(buf, n)

    def _load_seq(self, seq: int, state: KvState) -> bool:
        # Read in place: a copy of 34 MiB took 29 ms.
        buf = (ctypes.c_uint8 * state.size).from_buffer(state.buf)
        return llama_cpp.llama_state_seq_set_data(self._ctx, buf, state.size, seq) != 0

    # -- vocabulary ---------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return _tokenize(self._vocab, text, add_special, parse_special)

    def tokenize_parts(self, parts: Sequence[tuple[str, bool]], *, add_special: bool = True) -> list[int]:
        """Tokenize (text, trusted) parts: special-token markers count only in trusted parts.

        This is llama.cpp's own partition (llama-vocab.cpp tokenizer_st_partition: control and
        unknown tokens, longest first, with their lstrip/rstrip attributes) applied to the trusted
        parts alone; the text between two markers, trusted and untrusted together, is tokenized
        in one call with parse_special=False, as llama.cpp tokenizes each fragment. So the ids
        equal tokenize("".join(texts), parse_special=True) whenever the untrusted parts hold no
        marker text.
        """
        # items: a str is raw text still to partition (trusted) or to keep (untrusted: tagged
        # by wrapping it in a 1-tuple); an int is a special token found in trusted text.
        items: list[str | tuple[str] | int] = [t if trusted else (t,) for t, trusted in parts if t]
        for text, tid, _attr in self._special_tokens():
            out: list[str | tuple[str] | int] = []
            for it in items:
                if not isinstance(it, str) or text not in it:
                    out.append(it)
                    continue
                chunks = it.split(text)
                for i, chunk in enumerate(chunks):
                    if i:
                        out.append(tid)
                    out.append(chunk)
            items = out
        ids: list[int] = [self.bos_id] if add_special and self.add_bos else []
        run: list[str] = []
        rstrip_next = False
        for it in [*items, -1]:  # -1: a sentinel that flushes the last run
            if isinstance(it, int):
                text = "".join(run)
                attr = self._special_attrs.get(it, 0)
                if rstrip_next:
                    text = text.lstrip(_C_SPACE)
                if attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP:
                    text = text.rstrip(_C_SPACE)
                if text:
                    ids += self.tokenize(text, add_special=False, parse_special=False)
                if it >= 0:
                    ids.append(it)
                rstrip_next = bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP)
                run = []
            else:
                run.append(it if isinstance(it, str) else it[0])
        if add_special and llama_cpp.llama_vocab_get_add_eos(self._vocab):
            ids.append(llama_cpp.llama_vocab_eos(self._vocab))
        return ids

    def special_texts(self) -> list[str]:
        """The texts that parse_special=True reads as control (or unknown) tokens."""
        return [text for text, _, _ in self._special_tokens()]

    def _special_tokens(self) -> list[tuple[str, int, int]]:
        """(text, id, attributes) of the control and unknown tokens, longest text first: the
        markers parse_special=True recognises (user-defined tokens are matched either way)."""
        if getattr(self, "_specials", None) is None:
            found = []
            for t in range(self.n_vocab):  # n_vocab ctypes calls, once: ~0.1 s for 152k tokens
                attr = llama_cpp.llama_vocab_get_attr(self._vocab, t)
                if attr & (llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN):
                    text = self.token_text(t)
                    if text:
                        found.append((text, t, attr))
            found.sort(key=lambda x: -len(x[0].encode()))  # llama.cpp sorts by byte length
            self._specials = found
            self._special_attrs = {t: attr for _, t, attr in found}
        return self._specials

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (special tokens render as b"" unless special=True)."""
        return _piece(self._vocab, token, special)

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        return b"".join(self.piece(t, special) for t in tokens).decode("utf-8", "replace")

    def token_text(self, token: int) -> str:
        return llama_cpp.llama_vocab_get_text(self._vocab, token).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return token in self.eog_ids

    def fim_tokens(self) -> FimTokens:
        """The vocabulary's fill-in-the-middle tokens, as llama.cpp detected them when loading
        (from the GGUF's tokenizer.ggml.fim_*_token_id keys, else by their text: <|fim_prefix|>,
        <PRE>, ...); -1 (LLAMA_TOKEN_NULL) for each one the vocabulary lacks."""
        v = self._vocab
        return FimTokens(
            pre=llama_cpp.llama_vocab_fim_pre(v),
            suf=llama_cpp.llama_vocab_fim_suf(v),
            mid=llama_cpp.llama_vocab_fim_mid(v),
            pad=llama_cpp.llama_vocab_fim_pad(v),
            rep=llama_cpp.llama_vocab_fim_rep(v),
            sep=llama_cpp.llama_vocab_fim_sep(v),
        )

    def grammar_tokenizer(self) -> Any:
        """This vocabulary as llguidance's tokenizer, for constrained decoding (built once:
        ~1 s for 152k tokens). Every end-of-generation token counts as EOS, so a grammar that
        is complete lets the model end its turn the way it was trained to."""
        if getattr(self, "_grammar_tokenizer", None) is None:
            from llguidance.llamacpp import lltokenizer_from_vocab

            with warnings.catch_warnings():  # it calls llama_token_get_attr, deprecated: once per token
                warnings.simplefilter("ignore", DeprecationWarning)
                self._grammar_tokenizer = lltokenizer_from_vocab(self._vocab, eos_token=sorted(self.eog_ids))
        return self._grammar_tokenizer

    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    @property
    def chat_template(self) -> str | None:
        t = llama_cpp.llama_model_chat_template(self._model, None)
        return t.decode("utf-8") if t else None

    def model_bytes(self) -> int:
        return int(llama_cpp.llama_model_size(self._model))

    def state_identity(self) -> dict[str, Any]:
        """What a saved KV state of this model means only together with (prefix_store.py):
        llama.cpp checks a state's layout when it loads it, not the weights (the file: path,
        size, time), the build that computed it, or the kernel settings that change its values'
        last bits (exact mode depends on those)."""
        st = self.path.stat()
        pkg = installed_package_dir()
        return {"model": str(self.path.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
                "llama_cpp": llama_cpp.__version__, "build": read_stamp(pkg) if pkg is not None else None,
                "kv_type": self.opts.kv_type, "flash_attn": self.opts.flash_attn, "repack": self.opts.repack,
                "n_gpu_layers": self.opts.n_gpu_layers, "tiled_matmul": tiled_matmul_in_effect(),
                "reference_decode": self.opts.reference_decode,
                "weight_buffers": sorted(self.weight_buffers)}  # AMX's, or the repacked layouts', or neither

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        if getattr(self, "_batch", None) is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tokenize(vocab: ctypes.c_void_p, text: str, add_special: bool, parse_special: bool) -> list[int]:
    data = text.encode("utf-8")
    cap = len(data) + 16
    buf = (llama_cpp.llama_token * cap)()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
    if n < 0:
        cap = -n
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
    return list(buf[:n])


def _piece(vocab: ctypes.c_void_p, token: int, special: bool) -> bytes:
    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, 64, 0, special)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, -n, 0, special)
    return buf.raw[:n]


class Vocabulary:
    """A model's tokenizer alone (llama.cpp's vocab_only load: no weights, no context), for
    /tokenize and /detokenize: it stays when the model is unloaded after keep_alive, and HTTP
    handlers use it without the worker thread (llama.cpp's tokenizer only reads the vocabulary,
    as llama-server's handler threads use it)."""

    def __init__(self, path: str | Path) -> None:
        _init_backend()
        mp = llama_cpp.llama_model_default_params()
        mp.vocab_only = True
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
        if not self._model:
            raise ModelError(f"llama.cpp could not read the vocabulary of {path}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab: int = llama_cpp.llama_vocab_n_tokens(self._vocab)

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return _tokenize(self._vocab, text, add_special, parse_special)

    def piece(self, token: int) -> bytes:
        """What a token writes, as llama-server's /tokenize and /detokenize show it (special
        tokens by their text)."""
        return _piece(self._vocab, token, True)

    def close(self) -> None:
        """Free the vocabulary (a daemon keeps it for its lifetime)."""
        if self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None


def stream_gaps(seqs: Sequence[int]) -> list[int]:
    """The sequence ids missing between the lowest and the highest of `seqs`. With a KV stream
    per sequence llama.cpp runs a pass as one graph per run of consecutive ids
    (llama_batch_allocr::split_equal), so {0, 2, 3} is two graphs unless 1 joins them."""
    have = set(seqs)
    return [s for s in range(min(have), max(have)) if s not in have] if have else []


# A pass in streams is padded to one graph when its rows, every step made as long as the longest,
# are at most this many times the rows it has: on the 2-core Xeon (300 tokens of history each)
# 3, 1, 1, 1 rows took 209 ms as two graphs and 3, 3, 3, 3 rows 160-181 as one; 5, 1, 1, 1 217 ms
# and 5, 5, 5, 5 218 (2.5x the rows); 9, 1, 1, 1 257 and 9, 9, 9, 9 375 (3x).
STREAM_PAD_RATIO = 2.5
# Passes in a row that leave the same slot idle between running ones before it is compacted
# away (Runtime._compact): a request that sits out a pass or two (a prompt chunk deferred for a
# higher priority) is not worth the copy; an answer that ended is. A move copies both slots'
# cells (~28 KiB a token for the 1.5B target): on the 2-core EPYC 7 ms for two 400-token
# histories (47 the first time, on fresh pages), 27 ms for two of 1,500 (178), against the
# ~13 ms each pass of three rows then saves.
COMPACT_AFTER = 4


def stream_layout(rows: Mapping[int, int]) -> dict[int, int]:
    """The rows per sequence id a pass in streams runs, throwaway rows included: a row for each
    slot missing between the others (stream_gaps), and, when it costs at most STREAM_PAD_RATIO
    times the rows, every step made as long as the longest, so that the pass is one graph."""
    run = {s: n for s, n in rows.items() if n > 0}
    run.update({s: 1 for s in stream_gaps(list(run))})
    if run:
        longest = max(run.values())
        if longest * len(run) <= STREAM_PAD_RATIO * sum(run.values()):
            run = dict.fromkeys(run, longest)
    return run


def pass_graphs(rows: Mapping[int, int], unified: bool, fill_gaps: bool = True) -> list[tuple[int, int]]:
    """The graphs of a pass over `rows` tokens per sequence id: (sequences, rows) each, in order.
    One KV buffer (unified): one graph. A stream per sequence: stream_graphs."""
    if unified:
        return [(len(rows), sum(rows.values()))] if rows else []
    return stream_graphs(rows, fill_gaps)


def stream_graphs(rows: Mapping[int, int], fill_gaps: bool = True) -> list[tuple[int, int]]:
    """The graphs of a pass over `rows` tokens per sequence id, with a KV stream per sequence:
    (sequences, rows) each, in order. llama.cpp's split_equal (llama_batch_allocr, sequential)
    takes the run of consecutive ids from the lowest with tokens left and the same number of
    tokens from each, as many as the shortest has left; then again. So 9, 1, 1 and 1 rows are a
    graph of 4 rows (one per sequence) and one of 8 (the first sequence's), and {0: 3, 2: 3} two
    graphs unless throwaway rows (stream_layout, fill_gaps) join them."""
    left = stream_layout(rows) if fill_gaps else {s: n for s, n in rows.items() if n > 0}
    out: list[tuple[int, int]] = []
    while left:
        run = [min(left)]
        while run[-1] + 1 in left:
            run.append(run[-1] + 1)
        each = min(left[s] for s in run)
        out.append((len(run), each * len(run)))
        for s in run:
            left[s] -= each
            if not left[s]:
                del left[s]
    return out


class Slot:
    """One KV-cache sequence of a Runtime, as a Target of its own (a request's view of the shared
    context). Slot 0 is the Runtime's own sequence: its evaluation goes through Runtime.eval,
    which keeps the hidden states."""

    def __init__(self, rt: Runtime, seq: int) -> None:
        self.rt, self.seq = rt, seq
        self.tokens: list[int] = []  # what this sequence holds, position i = tokens[i]

    @property
    def n_ctx(self) -> int:
        return self.rt.n_ctx

    @property
    def shares_cells(self) -> bool:
        return self.rt.shares_cells  # share_prefix borrows cells without a copy

    @property
    def n_vocab(self) -> int:
        return self.rt.n_vocab

    def eval(self, tokens: Sequence[int], output: Output = "all") -> np.ndarray:
        if self.seq == 0:
            return self.rt.eval(tokens, output)
        if len(self.tokens) + len(tokens) > self.n_ctx:
            raise ContextFull(len(self.tokens) + len(tokens), self.n_ctx)
        step = self.rt.opts.n_batch
        outs = []
        for a in range(0, len(tokens), step):
            last = a + step >= len(tokens)
            chunk_out: Output = output if output == "all" or last else "none"
            outs.append(self.rt.eval_many([(self, tokens[a : a + step], chunk_out)])[0])
        return np.concatenate(outs) if len(outs) > 1 else outs[0] if outs else np.empty((0, self.n_vocab), np.float32)

    def sync(self, context: Sequence[int], output: Output = "last") -> np.ndarray:
        keep = common_prefix(self.tokens, context)
        if output != "none":
            keep = min(keep, len(context) - 1)
        self.truncate(keep)
        return self.eval(context[keep:], output)

    def truncate(self, n: int) -> None:
        if self.seq == 0:
            self.rt.truncate(n)
        else:
            self.rt._truncate(self.seq, self.tokens, n)

    def reset(self) -> None:
        llama_cpp.llama_memory_seq_rm(self.rt._mem, self.seq, -1, -1)
        self.tokens.clear()
        if self.seq == 0:
            self.rt._hid_start = self.rt._hid_n = 0

    def share_prefix(self, src: Slot, n: int, scratch: StateBuffer | None = None) -> None:
        """Hold src's first n positions instead of what this slot held; truncating either
        sequence later leaves the other's intact. In the unified cache the cells are only tagged
        with this sequence as well (llama_memory_seq_cp): no copy, no compute, no extra memory.
        Across streams llama.cpp copies only whole streams, and not before the next decode (a
        state saved or loaded in between would be overwritten), so src's sequence travels as a
        saved state instead and is cut at n: a copy of its cells (~28 KiB a token for the 1.5B
        target), still far cheaper than reading n tokens again (~60 a second on 2 cores).

        The copy goes through `scratch` when it is large enough."""
        if src.rt is not self.rt or src is self or not 0 <= n <= len(src.tokens):
            raise ValueError(f"share_prefix: {n} positions of a slot holding {len(src.tokens)}")
        if not self.rt.shares_cells:
            self.load_state(src.save_state(into=scratch), src.tokens)
            self.truncate(n)
            return
        self.reset()
        llama_cpp.llama_memory_seq_cp(self.rt._mem, src.seq, self.seq, 0, n)
        self.tokens[:] = src.tokens[:n]  # in place: Runtime.tokens is slot 0's list

    def save_state(self, into: StateBuffer | None = None) -> KvState:
        """This sequence's KV cache (restore with load_state); written into `into` if it is large enough."""
        return self.rt._save_seq(self.seq, into)

    def state_size(self) -> int:
        """Bytes save_state would write now (llama.cpp counts them without copying)."""
        return llama_cpp.llama_state_seq_get_size(self.rt._ctx, self.seq)

    def load_state(self, state: KvState, tokens: Sequence[int]) -> None:
        self.reset()
        if not self.rt._load_seq(self.seq, state):
            self.reset()
            raise RuntimeError("llama.cpp refused a saved KV state")
        self.tokens[:] = tokens  # in place: Runtime.tokens is slot 0's list

    def piece(self, token: int, special: bool = False) -> bytes:
        return self.rt.piece(token, special)

    def is_eog(self, token: int) -> bool:
        return self.rt.is_eog(token)

    def close(self) -> None:
        """The Runtime owns the context: closing a view frees nothing."""


class ContextFull(Exception):
    """The KV cache has no room for the tokens asked to be evaluated."""

    def __init__(self, needed: int, n_ctx: int) -> None:
        super().__init__(f"context full: {needed} tokens needed, n_ctx is {n_ctx}")
        self.needed, self.n_ctx = needed, n_ctx


class ReferenceDecoder:
    """llama-cpp-python's own high-level greedy decoding, for `homespec bench` to compare against.

    A second context over the same GGUF (weights are shared through the page cache when mmapped).
    """

    def __init__(self, path: str | Path, opts: RuntimeOptions = RuntimeOptions()) -> None:
        _init_backend()
        self._llm = llama_cpp.Llama(
            str(path),
            n_ctx=opts.n_ctx,
            n_batch=opts.n_batch,
            n_threads=opts.n_threads or physical_cores(),
            n_threads_batch=opts.n_threads or physical_cores(),
            n_gpu_layers=opts.n_gpu_layers,
            use_mmap=opts.use_mmap,
            use_mlock=opts.use_mlock,
            flash_attn=bool(opts.flash_attn),  # Llama() has no "auto": compare like with like
            verbose=False,
        )
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))  # Llama() installs its own

    def complete(self, prompt: Sequence[int], max_tokens: int) -> tuple[str, int, float]:
        """Greedy `create_completion` of prompt tokens -> (text, completion tokens, seconds)."""
        import time

        t0 = time.perf_counter()
        r = self._llm.create_completion(
            list(prompt), max_tokens=max_tokens, temperature=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0
        )
        dt = time.perf_counter() - t0
        return r["choices"][0]["text"], int(r["usage"]["completion_tokens"]), dt

    def close(self) -> None:
        self._llm.close()
