"""Fill-in-the-middle prompts, token for token as llama.cpp's server builds them for `/infill`.

The model sees the code around a gap and writes the gap ("the middle"). Code models learn this
with marker tokens; the PSM (prefix-suffix-middle) order is

    [extra context] [BOS] FIM_PRE prefix prompt FIM_SUF suffix FIM_MID  -> the model writes the middle

and, when the vocabulary has the repository-level markers (Qwen2.5-Coder: `<|repo_name|>`,
`<|file_sep|>`; https://arxiv.org/pdf/2409.12186), the extra context is a small repository:

    FIM_REP myproject\\n  FIM_SEP {filename}\\n {text}  ...  FIM_SEP filename\\n  FIM_PRE ...

This mirrors `format_prompt_infill` (llama.cpp tools/server/server-common.cpp, formerly utils.hpp),
including what its comments and README do not say:
- `prompt` is appended to the prefix, before FIM_SUF (the README says "after FIM_MID"; the code
  puts it at the end of the prefix, llama.cpp issue #22678). Editor plugins send the current line
  up to the cursor there, so the prefix ends exactly at the cursor.
- The budget is one batch: the prefix keeps its last 3/4 * n_batch tokens, the suffix its first
  n_batch/4 - 2 - len(prompt); the extra context keeps its last n_ctx - n_batch - 2 * n_predict
  tokens (the repository header and the first chunks are dropped first).
- Without FIM_SEP, each chunk is preceded by "\\n\\n--- snippet ---\\n\\n" instead.

Where homespec differs: n_predict is the server's default token limit (`sampling.max_tokens`),
the same for every request, so the extra context leaves room for an answer (llama.cpp passes the
server-wide `-n`, usually -1, and leaves none). It must not be each request's own limit: editors
warm the cache with n_predict 0 and then ask with 128, and a cut that moved with it would make
the two prompts differ from their first token, so the completion would read all of it again.

User text (prefix, suffix, chunks, filenames) is tokenized by `tokenize`, which must NOT parse
special tokens: a file that contains "<|fim_middle|>" or "<|im_end|>" is text, never a marker.
Only the markers placed here are special. No llama_cpp import: the tokenizer and the ids are
arguments, so this is tested with a fake tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from homespec.errors import NoFimTokens

Tokenize = Callable[[str], list[int]]  # text -> ids: no BOS, special-token text stays text

NULL = -1  # llama.cpp's LLAMA_TOKEN_NULL: the vocabulary has no such token
_REPO_NAME = "myproject\n"  # llama.cpp's fixed project name ("TODO: make project name an input")
_CURRENT_FILE = "filename\n"  # llama.cpp's fixed name for the file being edited
_SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"  # between chunks when there is no FIM_SEP
# Where a prefix longer than its budget is cut: at a multiple of this many tokens (infill_prompt).
# 64 of the default 384-token budget (n_batch 512): the cut moves once every 64 tokens typed,
# and a request keeps at least 321 tokens of the code before the cursor.
PREFIX_CUT_STEP = 64


@dataclass(frozen=True)
class FimTokens:
    """A vocabulary's fill-in-the-middle token ids; NULL (-1) where the vocabulary has none."""

    pre: int = NULL  # before the prefix: <|fim_prefix|>, <PRE>, <fim_prefix>
    suf: int = NULL  # before the suffix
    mid: int = NULL  # after the suffix: the model writes the middle from here
    pad: int = NULL  # padding (an end-of-generation token in llama.cpp)
    rep: int = NULL  # repository name: <|repo_name|>
    sep: int = NULL  # file separator: <|file_sep|>

    @property
    def missing(self) -> list[str]:
        """The markers infill needs that this vocabulary lacks (empty: infill works)."""
        return [name for name, tid in (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid)) if tid == NULL]


@dataclass(frozen=True)
class Chunk:
    """Extra context before the FIM prefix: another file, or a snippet of one."""

    text: str
    filename: str = "tmp"  # llama.cpp's default when a chunk has no filename


def require_fim(fim: FimTokens, model: str) -> None:
    """Raise NoFimTokens (a one-line UserError) unless the vocabulary can do infill."""
    if fim.missing:
        raise NoFimTokens(
            f"{model} has no FIM tokens ({', '.join(fim.missing)} missing): fill-in-the-middle needs a code "
            "model trained for it, such as Qwen2.5-Coder"
        )


def infill_prompt(
    tokenize: Tokenize,
    fim: FimTokens,
    *,
    prefix: str,
    suffix: str,
    extra: Sequence[Chunk] = (),
    prompt: Sequence[int] = (),
    n_batch: int,
    n_ctx: int,
    n_predict: int,
    bos: int | None = None,
    spm: bool = False,
    model: str = "this model",
) -> list[int]:
    """The infill prompt's token ids.

    prompt: already tokenized (llama.cpp parses special tokens in it; it is the client's, not a
    file's). bos: prepended before the FIM prefix when the model adds one (add_bos). spm: the
    suffix-prefix-middle order some models were trained on (llama.cpp's --spm-infill).
    """
    require_fim(fim, model)
    extra_ids = _extra_context(tokenize, fim, extra)
    prefix_ids = tokenize(prefix) if prefix else []
    suffix_ids = tokenize(suffix) if suffix else []

    # One batch for prefix + suffix, 3:1; the prompt comes out of the suffix's quarter.
    n_prefix = min(len(prefix_ids), 3 * (n_batch // 4))
    n_suffix = min(len(suffix_ids), max(0, n_batch // 4 - (2 + len(prompt))))
    # The rest of the context, less twice the answer, for the extra chunks (their end is kept).
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_ids))

    # The prefix keeps its end. llama.cpp cuts it at len - n_prefix, which moves with every token
    # typed, so in a file longer than the budget no two requests share the prefix's tokens and
    # each reads all of them again: ~4 s a keystroke on 2 cores, where a request that shares them
    # reads only its new tokens (0.25 s). The cut goes up to a multiple of `step` tokens instead
    # and stays put while up to `step` tokens are typed, at the cost of at most step - 1 tokens
    # of the oldest context.
    step = max(1, min(PREFIX_CUT_STEP, n_prefix // 4))  # tokens
    cut = -(-(len(prefix_ids) - n_prefix) // step) * step  # up to a multiple of step
    head = [fim.pre, *prefix_ids[cut:], *prompt]
    tail = [fim.suf, *suffix_ids[:n_suffix]]  # the suffix keeps its start
    first, second = (tail, head) if spm else (head, tail)
    out = extra_ids[len(extra_ids) - n_extra :]
    if bos is not None:
        out.append(bos)
    return [*out, *first, *second, fim.mid]


def _extra_context(tokenize: Tokenize, fim: FimTokens, extra: Sequence[Chunk]) -> list[int]:
    """The repository-level header and the chunks, before any trimming."""
    ids: list[int] = []
    if fim.rep != NULL:
        ids += [fim.rep, *tokenize(_REPO_NAME)]
    for chunk in extra:
        if fim.sep != NULL:
            ids += [fim.sep, *tokenize(chunk.filename + "\n")]
        else:
            ids += tokenize(_SNIPPET_SEPARATOR)
        if chunk.text:
            ids += tokenize(chunk.text)
    if fim.sep != NULL:
        ids += [fim.sep, *tokenize(_CURRENT_FILE)]
    return ids
