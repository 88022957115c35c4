"""Constrained decoding: a grammar decides which tokens may come next, and speculation stays exact.

A `Grammar` is a compiled llguidance matcher over the target's vocabulary (JSON schema, Lark or
GBNF, tool-call formats). The engine asks it three things each step:

- `forced()`: tokens the grammar allows nothing but ("jump-forward": JSON punctuation, the keys
  of a schema, a tool's name). They go to the target as free drafts: no proposer time, and the
  masked target can only accept them.
- `cut(draft)`: the proposer's draft ends where it leaves the grammar. A deterministic draft
  (greedy, seeded, or a point-mass proposer like ngram) drops the first invalid token, which the
  masked target would refuse anyway. A draft sampled from q (Leviathan's rule) keeps it, so the
  verdict is the one rejection_verify gives on the whole draft: that token has p = 0 and is
  rejected with certainty, the recovered token comes from norm(max(0, p - q)) as the proof
  requires, and the rows after it are never read. Dropping it instead would sample the bonus
  from p, which biases the output (the rejected mass of q would be redistributed twice).
- `masks(draft)`: which tokens each verified row allows, the grammar advanced along the draft
  and rolled back after. The engine sets the logits of the others to -inf before the one
  sampling transform, so greedy, seeded and sampled verification all see the constrained target.

After a verdict the engine `commit`s the emitted tokens; the grammar never holds rejected ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from homespec.errors import UserError

# llguidance's JSON compiler, configured for what models were trained to write: json.dumps
# separators (the Qwen and Hermes templates render tool calls with `tojson`, which uses them), no
# free whitespace. A fixed layout also makes the punctuation and schema keys forced tokens.
JSON_STYLE: dict[str, Any] = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def json_style(lenient: bool = False) -> dict[str, Any]:
    """llguidance's JSON options: JSON_STYLE, and whether unsupported keywords are ignored."""
    return {**JSON_STYLE, "lenient": True} if lenient else JSON_STYLE


class GrammarError(UserError):
    """A grammar or schema that does not compile (the message says why): the client's fault."""


def json_schema_grammar(schema: dict[str, Any] | bool, lenient: bool = False) -> str:
    """An llguidance grammar for JSON matching `schema` ({} or True: any JSON value).
    lenient: keywords llguidance cannot enforce (uniqueItems, not, if/then, an unknown format)
    are ignored rather than refused, as llama.cpp's converter ignores them."""
    import llguidance

    if schema is True:
        schema = {}
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=json_style(lenient))  # type: ignore[arg-type]
    except ValueError as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None
    check_grammar(grammar)  # the schema's meaning is checked when it compiles
    return grammar


def lark_grammar(source: str) -> str:
    """An llguidance grammar from Lark or llama.cpp's GBNF (llguidance converts GBNF itself)."""
    import llguidance

    try:
        grammar = llguidance.grammar_from("grammar", source)
    except Exception as e:  # the converter raises bare exceptions on bad GBNF
        raise GrammarError(f"invalid grammar: {e}") from None
    check_grammar(grammar)
    return grammar


def check_grammar(grammar: str) -> None:
    """Raise GrammarError if `grammar` cannot compile (checked without a vocabulary, so a bad
    request is refused before it waits for the worker)."""
    import llguidance

    message = llguidance.LLMatcher.validate_grammar(grammar)
    if message and not message.startswith("WARNING"):
        raise GrammarError(f"invalid grammar: {message}")


class Grammar:
    """One request's grammar state over a vocabulary of n_vocab tokens."""

    def __init__(self, grammar: str, tokenizer: Any, n_vocab: int, max_forced: int = 16) -> None:
        """tokenizer: llguidance's LLTokenizer for the target (Runtime.grammar_tokenizer).
        max_forced: jump-forward tokens per step at most (a step's pass grows with them)."""
        import llguidance

        self._m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if not self._m.is_error():
            self._m.compute_bitmask()  # a grammar whose language is empty fails only here
        if self._m.is_error():
            raise GrammarError(f"invalid grammar: {_matcher_error(self._m)}")
        self.source = grammar  # what the grammar lets an answer say (engine.shaping)
        self.n_vocab = n_vocab
        self.max_forced = max_forced

    @property
    def finished(self) -> bool:
        """Only end-of-generation can follow (the grammar is complete and closed)."""
        return self._m.is_stopped()

    @property
    def dead_end(self) -> bool:
        """Nothing can follow the answer so far, though the grammar is not complete (a required
        property whose schema refers only to itself: `{"a": ` and no value can come). The mask
        then allows only end-of-generation, so the answer stops unfinished."""
        return self._m.is_error()

    def allowed(self) -> np.ndarray:
        """[vocab] bool: the tokens the grammar allows next."""
        packed = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)  # [ceil(vocab / 32) * 4]
        bits = np.unpackbits(packed, bitorder="little")  # [>= vocab]
        return bits[: self.n_vocab].astype(bool)

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens that are the grammar's only continuation from here."""
        # Where the grammar could end, nothing is forced: llguidance's forced bytes do not
        # count end-of-generation as a way on (after a tool call: "\n" for another, or the end).
        if limit <= 0 or self._m.is_stopped() or self._m.is_accepting():
            return []
        return list(self._m.compute_ff_tokens()[: min(limit, self.max_forced)])

    def cut(self, draft: Sequence[int], keep_first_invalid: bool) -> list[int]:
        """The part of `draft` worth verifying (module docstring)."""
        valid = self._m.validate_tokens(list(draft))
        end = valid + 1 if keep_first_invalid and valid < len(draft) else valid
        return list(draft[:end])

    def masks(self, draft: Sequence[int]) -> np.ndarray:
        """[len(draft) + 1, vocab] bool: row i allows what may follow draft[:i]. Rows after an
        invalid draft token are never read by the verifier (its p is 0): they allow everything."""
        rows = np.ones((len(draft) + 1, self.n_vocab), dtype=bool)
        consumed = 0
        for i in range(len(draft) + 1):
            rows[i] = self.allowed()
            # An allowed token after the grammar stopped is end-of-generation: nothing follows.
            if i == len(draft) or not rows[i][draft[i]] or self._m.is_stopped():
                break
            self._m.consume_token(int(draft[i]))
            consumed += 1
        if consumed:
            self._m.rollback(consumed)
        return rows

    def commit(self, tokens: Sequence[int]) -> None:
        """The emitted tokens: verified against the masks, so the grammar accepts them. Once it
        has stopped, the one token it allowed was end-of-generation, which it does not consume."""
        for t in tokens:
            if self._m.is_stopped():
                return
            if not self._m.consume_token(int(t)):
                raise RuntimeError(f"grammar refused emitted token {t}: {self._m.get_error()}")


def _matcher_error(m: Any) -> str:
    """llguidance's error, its first line (the rest is parser state). NoExtensionBias, nothing
    can follow, is said plainly: a rule defined only by itself (root ::= root) or a schema that
    refers only to itself passes the compile check, and its first token has nothing to allow."""
    first = m.get_error().splitlines()[0] if m.get_error() else "unknown error"
    return "it matches no text (a rule or schema defined only by itself?)" if first == "NoExtensionBias" else first


def apply_masks(logits: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """logits [n, vocab] with disallowed tokens at -inf (masks [n, vocab] bool); a new array."""
    return np.where(masks, logits, np.float32(-np.inf)).astype(logits.dtype, copy=False)
