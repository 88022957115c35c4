"""A scripted stand-in for Runtime: logits are a deterministic function of the context.

It keeps the same contract as homespec.llama.runtime.Runtime (tokens held in the cache, eval appends,
truncate, sync with prefix reuse), so the engine and proposers run unchanged on it, without
weights and without llama.cpp's batch noise.
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable, Sequence

import numpy as np

from homespec.llama.fim import FimTokens
from homespec.llama.runtime import ContextFull, KvState, RuntimeOptions, pass_graphs
from homespec.speculation.proposers.base import Preview
from homespec.speculation.proposers.ngram import Match, NgramProposer
from homespec.tokens import common_prefix


class FakeRuntime:
    def __init__(self, vocab: int = 64, n_ctx: int = 512, eos: int | None = None, order: int = 2, seed: int = 0,
                 sharpness: float = 3.0, n_seq: int = 1, n_batch: int = 512) -> None:
        self.n_vocab = vocab
        self.n_ctx = n_ctx
        self.eos = eos
        self.order = order  # logits depend on the last `order` tokens
        self.seed = seed
        self.sharpness = sharpness  # scale of the logits: higher = more peaked distributions
        self.tokens: list[int] = []
        self.evals: list[int] = []  # batch sizes of every eval call (for cost accounting in tests)
        self.n_batch = n_batch
        self.n_seq = n_seq
        self.seq = 0
        self._slots: list[FakeRuntime] = [self] + [FakeSlot(self, i) for i in range(1, n_seq)]
        self.passes: list[list[tuple[int, int]]] = []  # eval_many calls: [(seq, tokens)] per pass
        self.rt = self  # the runtime whose cache this sequence is in (FakeSlot: its owner)
        self.shares_cells = True  # Runtime.shares_cells: one unified KV buffer
        self.opts = RuntimeOptions(n_ctx=n_ctx, n_batch=n_batch, n_seq=n_seq, kv_unified=True)  # as Runtime.opts

    def slot(self, i: int) -> FakeRuntime:
        """KV sequence i: slot 0 is this runtime itself, as in Runtime."""
        return self._slots[i]

    def eval_many(self, parts: Sequence[tuple[FakeRuntime, Sequence[int], str]]) -> list[np.ndarray]:
        """Runtime.eval_many: one pass over several sequences (here: each evaluated alone —
        scripted logits have no batch noise, so a batched request must match itself alone exactly)."""
        assert len({t.seq for t, _, _ in parts}) == len(parts), "two parts name the same slot"
        assert sum(len(toks) for _, toks, _ in parts) <= self.n_batch
        self.passes.append([(t.seq, len(toks)) for t, toks, _ in parts])
        return [FakeRuntime.eval(t, toks, out) for t, toks, out in parts]

    def graphs(self, rows: Sequence[tuple[FakeRuntime, int]]) -> list[tuple[int, int]]:
        """Runtime.graphs: how llama.cpp would run a pass of `rows` per sequence."""
        return pass_graphs({t.seq: n for t, n in rows}, self.shares_cells)

    def logits_after(self, context: Sequence[int]) -> np.ndarray:  # [vocab]
        key = zlib.crc32(np.asarray([self.seed, *context[-self.order:]], dtype=np.int64).tobytes())
        z = np.random.default_rng(key).normal(size=self.n_vocab).astype(np.float32) * self.sharpness
        if self.eos is not None:
            z[self.eos] -= 4.0  # rare, but reachable
        return z

    def eval(self, tokens: Sequence[int], output: str = "all") -> np.ndarray:
        if len(self.tokens) + len(tokens) > self.n_ctx:
            raise ContextFull(len(self.tokens) + len(tokens), self.n_ctx)
        rows = []
        for t in tokens:
            self.tokens.append(int(t))
            rows.append(self.logits_after(self.tokens))
        self.evals.append(len(tokens))
        if output == "none" or not rows:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        return np.stack(rows[-1:] if output == "last" else rows)

    def truncate(self, n: int) -> None:
        del self.tokens[n:]

    def fim_tokens(self) -> FimTokens:
        return FimTokens()  # no fill-in-the-middle markers: infill is refused, as for such a model

    def sync(self, context: Sequence[int], output: str = "last") -> np.ndarray:
        keep = common_prefix(self.tokens, context)
        if output != "none":
            keep = min(keep, len(context) - 1)
        self.truncate(keep)
        return self.eval(context[keep:], output)

    def save_state(self, into: bytearray | None = None) -> KvState:
        data = np.asarray(self.tokens, dtype=np.int32).tobytes()
        buf = into if into is not None and len(into) >= len(data) else bytearray(len(data))
        buf[: len(data)] = data
        return KvState(buf, len(data))

    def state_size(self) -> int:
        return 4 * len(self.tokens)

    def load_state(self, state: KvState, tokens: Sequence[int]) -> None:
        data = bytes(state.buf[: state.size])
        assert np.frombuffer(data, dtype=np.int32).tolist() == list(tokens), "state/tokens mismatch"
        self.tokens = list(tokens)

    def reset(self) -> None:
        self.tokens = []

    def state_identity(self) -> dict[str, object]:
        """Runtime.state_identity: what a saved state is only good for together with."""
        return {"model": "scripted", "vocab": self.n_vocab, "order": self.order, "seed": self.seed, "sharpness": self.sharpness}

    def share_prefix(self, src: FakeRuntime, n: int, scratch: bytearray | None = None) -> None:
        assert src.rt is self.rt and 0 <= n <= len(src.tokens), "share_prefix: another runtime, or too long"
        self.tokens = list(src.tokens[:n])  # as in llama.cpp's unified cache: no copy

    def is_eog(self, token: int) -> bool:
        return token == self.eos

    def piece(self, token: int, special: bool = False) -> bytes:
        if token == self.eos:
            return b""
        return chr(ord("a") + token % 26).encode() if token < 26 else f"[{token}]".encode()

    def grammar_tokenizer(self):
        return grammar_tokenizer(self)

    def close(self) -> None:
        pass


class FakeSlot(FakeRuntime):
    """Sequence i > 0 of a FakeRuntime: the same scripted model, its own cache."""

    def __init__(self, rt: FakeRuntime, seq: int) -> None:
        self.__dict__.update({k: v for k, v in rt.__dict__.items() if k not in ("_slots", "passes")})
        self.tokens, self.evals, self.seq, self.rt = [], [], seq, rt

    def slot(self, i: int) -> FakeRuntime:
        return self.rt.slot(i)

    @property
    def shares_cells(self) -> bool:  # type: ignore[override]
        return self.rt.shares_cells  # the owner's setting, as Slot reads its Runtime's


class ScriptedNgram(NgramProposer):
    """Prompt lookup whose match is scripted (`peek(context, k) -> Match`): the controller sees
    it through the Proposer protocol exactly as it sees the real one."""

    def __init__(self, peek) -> None:
        super().__init__(2, 12)
        self.peek = peek

    def match(self, context: Sequence[int], k: int) -> Match:
        return self.peek(context, k)


class ScriptedModel:
    """A model proposer for the controller: always has k tokens, `behind` tokens behind the
    context (0 unless a test sets it); its proposals are played by the test (the controller
    never calls propose)."""

    free_prefill = False

    def __init__(self, name: str = "draft") -> None:
        self.name = name
        self.behind = 0

    def begin(self, prompt: Sequence[int], shaping: Hashable = ()) -> None:
        pass

    def preview(self, context: Sequence[int], k: int) -> Preview:
        return Preview(k)

    def lag(self, context: Sequence[int]) -> int:
        return self.behind

    def end(self, context: Sequence[int], gaps: Sequence[float] = ()) -> None:
        pass

    def propose(self, context, k, params, rng):
        raise AssertionError("scripted: the test plays the proposals")

    def measure_cost(self, context, probe, passes) -> None:
        return None

    def close(self) -> None:
        pass


class FakeGrammarTokenizer:
    """FakeRuntime's vocabulary as llguidance wants a tokenizer (TokenizerWrapper's duck type):
    each token's bytes, greedy longest-match tokenization, and an end-of-generation token. A
    runtime without one gets an extra EOS id past its vocabulary, which its logits never reach."""

    def __init__(self, rt: FakeRuntime) -> None:
        self.tokens = [rt.piece(t) for t in range(rt.n_vocab)]
        if rt.eos is None:
            self.tokens.append(b"<eos>")
            self.eos_token_id = rt.n_vocab
        else:
            self.tokens[rt.eos] = b"<eos>"
            self.eos_token_id = rt.eos
        self.special_token_ids = [self.eos_token_id]
        self.bos_token_id = None

    def __call__(self, text: bytes) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            best = max((t for t, b in enumerate(self.tokens) if b and text.startswith(b, i)), key=lambda t: len(self.tokens[t]))
            ids.append(best)
            i += len(self.tokens[best])
        return ids


def grammar_tokenizer(rt: FakeRuntime):
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(FakeGrammarTokenizer(rt)))
