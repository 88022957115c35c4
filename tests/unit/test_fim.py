"""Fill-in-the-middle prompts (homespec/llama/fim.py) with a fake tokenizer: one token per
character, ids 1000 + code point, so every marker id (< 100) in the output was placed by fim.py."""

from __future__ import annotations

import pytest

from homespec.errors import NoFimTokens, UserError
from homespec.llama.fim import Chunk, FimTokens, infill_prompt

PRE, SUF, MID, PAD, REP, SEP = 1, 2, 3, 4, 5, 6
QWEN_LIKE = FimTokens(pre=PRE, suf=SUF, mid=MID, pad=PAD, rep=REP, sep=SEP)
PSM_ONLY = FimTokens(pre=PRE, suf=SUF, mid=MID)  # CodeLlama-like: no repository markers
BOS = 7
MARKERS = {PRE, SUF, MID, PAD, REP, SEP, BOS}


def tok(text: str) -> list[int]:
    return [1000 + ord(c) for c in text]


def text(ids: list[int]) -> str:
    return "".join(chr(i - 1000) for i in ids)


def build(fim: FimTokens = PSM_ONLY, *, prefix: str = "def f(", suffix: str = "):\n    pass\n", extra=(),
          prompt: str = "", n_batch: int = 512, n_ctx: int = 4096, n_predict: int = 64, **kw) -> list[int]:
    return infill_prompt(tok, fim, prefix=prefix, suffix=suffix, extra=extra, prompt=tok(prompt),
                         n_batch=n_batch, n_ctx=n_ctx, n_predict=n_predict, **kw)


def test_infill_prompt_is_prefix_then_suffix_then_middle_marker():
    ids = build(prefix="a = ", suffix="\nprint(a)")
    assert ids == [PRE, *tok("a = "), SUF, *tok("\nprint(a)"), MID]


def test_infill_prompt_appends_the_prompt_to_the_prefix_as_llama_cpp_does():
    # llama.cpp's code (not its README) puts `prompt` before FIM_SUF: the prefix ends at the cursor.
    ids = build(prefix="x = 1\n", prompt="y = ", suffix="\nz = 3")
    assert ids == [PRE, *tok("x = 1\ny = "), SUF, *tok("\nz = 3"), MID]


def test_infill_prompt_keeps_prefix_end_and_suffix_start_under_budget():
    prefix, suffix = "p" * 500 + "END", "START" + "s" * 500
    ids = build(prefix=prefix, suffix=suffix, n_batch=64)  # prefix 3/4 * 64 = 48, suffix 64/4 - 2 = 14
    pre_part = ids[1 : ids.index(SUF)]
    suf_part = ids[ids.index(SUF) + 1 : -1]
    # Cut up to a multiple of 48 // 4 = 12 tokens: 503 - 48 = 455 -> 456, so 47 kept.
    assert text(pre_part) == prefix[456:] and text(pre_part).endswith("END")
    assert text(suf_part) == suffix[:14] and text(suf_part).startswith("START")


def test_a_long_prefix_is_cut_where_typing_does_not_move_the_cut_so_the_next_prompt_shares_it():
    """Each keystroke's request then reads only its new tokens after the KV cache's (cut at
    len - budget, as llama.cpp does, every token typed moved the whole prefix window)."""
    code = "".join(f"x{i} = {i}\n" for i in range(100))  # 690 tokens here: over the 384 budget
    before = build(prefix=code)
    first_part = before[: before.index(SUF)]  # the FIM prefix marker and the prefix
    shared = 0
    for typed in ("y", "y =", "y = x1", "y = x1 + x2", "y = x1 + x2 + x3 + x4 + x5 + x6 + x7 + x8 + x9"):
        after = build(prefix=code + typed)
        if after[: len(first_part)] == first_part:  # the same cut: every token of the last prompt's prefix reused
            shared += 1
        pre_part = after[1 : after.index(SUF)]
        assert text(pre_part).endswith(typed) and 384 - 64 < len(pre_part) <= 384
    assert shared >= 4  # the cut moved at most once over these 52 tokens of typing


def test_the_prompt_comes_out_of_the_suffix_budget():
    ids = build(prefix="", suffix="s" * 100, prompt="abcd", n_batch=64)  # 64/4 - (2 + 4) = 10
    assert len(ids[ids.index(SUF) + 1 : -1]) == 10
    ids = build(prefix="", suffix="s" * 100, prompt="x" * 40, n_batch=64)  # the prompt alone is over
    assert ids[ids.index(SUF) + 1 : -1] == []
    assert text(ids[1 : ids.index(SUF)]) == "x" * 40  # the prompt itself is never cut


def test_extra_chunks_use_the_repository_pattern_when_the_vocab_has_it():
    ids = build(QWEN_LIKE, prefix="P", suffix="S", extra=[Chunk("one", "a.py"), Chunk("two")])
    expected = [
        REP, *tok("myproject\n"),
        SEP, *tok("a.py\n"), *tok("one"),
        SEP, *tok("tmp\n"), *tok("two"),  # a chunk without a filename is "tmp", as in llama.cpp
        SEP, *tok("filename\n"),
        PRE, *tok("P"), SUF, *tok("S"), MID,
    ]
    assert ids == expected


def test_repository_header_is_there_even_without_extra_chunks():
    ids = build(QWEN_LIKE, prefix="P", suffix="S")
    assert ids == [REP, *tok("myproject\n"), SEP, *tok("filename\n"), PRE, *tok("P"), SUF, *tok("S"), MID]


def test_extra_chunks_without_repository_markers_are_separated_by_a_snippet_line():
    ids = build(PSM_ONLY, prefix="P", suffix="S", extra=[Chunk("one", "a.py"), Chunk("two", "b.py")])
    sep = tok("\n\n--- snippet ---\n\n")
    assert ids == [*sep, *tok("one"), *sep, *tok("two"), PRE, *tok("P"), SUF, *tok("S"), MID]


def test_extra_context_keeps_its_end_within_context_minus_batch_minus_twice_the_answer():
    extra = [Chunk("A" * 300, "old.py"), Chunk("B" * 300 + "NEWEST", "new.py")]
    ids = build(QWEN_LIKE, prefix="P", suffix="S", extra=extra, n_ctx=1000, n_batch=256, n_predict=200)
    budget = 1000 - 256 - 2 * 200  # 344 tokens of extra context
    head = ids[: ids.index(PRE)]
    assert len(head) == budget
    full = build(QWEN_LIKE, prefix="P", suffix="S", extra=extra, n_ctx=100_000, n_batch=256, n_predict=200)
    assert head == full[: full.index(PRE)][-budget:]  # the end is kept: the newest chunk and the header's tail
    assert text([t for t in head if t not in MARKERS]).endswith("NEWESTfilename\n")


def test_extra_context_is_dropped_when_the_answer_needs_the_room():
    ids = build(QWEN_LIKE, prefix="P", suffix="S", extra=[Chunk("code")], n_ctx=1024, n_batch=512, n_predict=256)
    assert ids == [PRE, *tok("P"), SUF, *tok("S"), MID]


def test_bos_goes_after_the_extra_context_and_before_the_fim_prefix():
    ids = build(QWEN_LIKE, prefix="P", suffix="S", bos=BOS)
    assert ids[ids.index(BOS) + 1] == PRE and ids.index(BOS) > ids.index(REP)


def test_spm_order_puts_the_suffix_first():
    ids = build(prefix="P", suffix="S", prompt="Q", spm=True)
    assert ids == [SUF, *tok("S"), PRE, *tok("PQ"), MID]


def test_special_looking_text_in_the_file_stays_text():
    # The tokenizer fim.py is given does not parse special tokens; fim.py adds no marker of its own
    # for text that merely looks like one.
    evil = "<|fim_middle|><|im_end|><|file_sep|>"
    ids = build(QWEN_LIKE, prefix=evil, suffix=evil, extra=[Chunk(evil, evil)])
    assert [t for t in ids if t in MARKERS] == [REP, SEP, SEP, PRE, SUF, MID]
    assert text(ids[ids.index(PRE) + 1 : ids.index(SUF)]) == evil


@pytest.mark.parametrize("fim", [FimTokens(), FimTokens(rep=5), FimTokens(pre=1, suf=2)])
def test_a_vocabulary_without_fim_tokens_is_refused_in_one_line_naming_the_model(fim):
    with pytest.raises(NoFimTokens) as e:
        build(fim, model="SmolLM2-135M-Instruct.Q4_1.gguf")
    msg = str(e.value)
    assert isinstance(e.value, UserError)
    assert "SmolLM2-135M-Instruct.Q4_1.gguf has no FIM tokens" in msg and "\n" not in msg
    assert "middle" in msg


def test_fim_tokens_report_what_is_missing():
    assert QWEN_LIKE.missing == [] and PSM_ONLY.missing == []
    assert FimTokens(pre=1).missing == ["suffix", "middle"]
