"""Greedy speculative output on the real models obeys DESIGN.md's exactness rules.

llama.cpp's CPU kernels are not batch-invariant: a position's logits evaluated inside a batch
differ in the last bits from the same position evaluated alone. So "lossless" is tested as:
(a) every emitted token is the argmax of the target logits that verified it;
(b) the output equals plain greedy decoding up to the first position where plain decoding's
    top-2 logit margin is below 2 epsilon, epsilon being that measured batch noise (over several
    prompts): noise moves each of the two top logits by up to epsilon.
"""

from __future__ import annotations

import numpy as np
import pytest

from homespec.speculation.engine import Engine, FixedPolicy, GenerationStats
from homespec.speculation.proposers.draft import DraftProposer
from homespec.speculation.proposers.ngram import NgramProposer
from tests.integration.exactness import Recording, encode, first_divergence, margin

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain what a hash map is in two sentences.",
    "Rename the variable `x` to `count` in this code and output the whole code:\n\n```python\nx = 0\nfor item in items:\n    if item.ok:\n        x += 1\nprint(x)\n```",
    "List three uses of the Python `itertools` module, with a one-line example each.",
]
MAX_TOKENS = 40


def generate(engine, prompt, policy):
    engine.target.reset()
    st = GenerationStats()
    out = [t for ev in engine.generate(prompt, max_tokens=MAX_TOKENS, policy=policy, stats=st) for t in ev.tokens]
    return out, st


@pytest.mark.integration
@pytest.mark.parametrize("proposer, k", [("draft", 4), ("ngram", 4), ("draft", 2)])
def test_greedy_speculation_matches_plain_decoding_except_at_near_ties(target_rt, draft_rt, epsilon, proposer, k):
    rec = Recording(target_rt)
    proposers = {"ngram": NgramProposer(2, 5), "draft": DraftProposer(draft_rt, target_rt.n_vocab)}
    engine = Engine(rec)
    near_ties, diverged, proposed = 0, 0, 0
    for text in PROMPTS:
        prompt = encode(target_rt, text)
        rec.rows.clear()
        plain, _ = generate(engine, prompt, FixedPolicy())
        plain_margins = {pos: margin(row) for pos, row in rec.rows}
        rec.rows.clear()
        spec, st = generate(engine, prompt, FixedPolicy(proposers[proposer], k))
        proposed += st.proposed
        # (a) every emitted token after the first is the argmax of the logits that verified it.
        verified = dict(rec.rows)
        for i, tok in enumerate(spec[1:], start=1):
            pos = len(prompt) + i - 1  # the row that scored output token i
            assert int(np.argmax(verified[pos])) == tok, f"token {i} is not the target's argmax"
        # (b) equal to plain decoding, or diverging only where plain had a near-tie.
        j = first_divergence(plain, spec)
        if j is None:
            assert len(spec) == len(plain)
            continue
        diverged += 1
        m = plain_margins.get(len(prompt) + j - 1)
        assert m is not None and m < 2 * epsilon, (
            f"diverged at output token {j} where plain's top-2 margin was {m} >= 2 epsilon ({2 * epsilon})"
        )
        near_ties += 1
    print(f"\n{proposer} k={k}: {diverged}/{len(PROMPTS)} prompts diverged, all at near-ties ({near_ties}); {proposed} tokens proposed")
    assert proposed > 0


@pytest.mark.integration
def test_an_edit_draft_goes_on_as_the_prompt_and_says_what_plain_decoding_says(target_rt, draft_rt, epsilon):
    """The draft model makes the rename it was asked for; past it, its guesses copy the prompt,
    and the prompt's next tokens are proposed without its passes (DraftProposer.copy). They are
    verified as any draft is: the rules above hold."""
    rec = Recording(target_rt)
    engine = Engine(rec)
    prompt = encode(target_rt, PROMPTS[2])
    plain, _ = generate(engine, prompt, FixedPolicy())
    plain_margins = {pos: margin(row) for pos, row in rec.rows}
    rec.rows.clear()
    lookup = NgramProposer(2, 12)
    lookup.begin(prompt)
    policy = FixedPolicy(DraftProposer(draft_rt, target_rt.n_vocab, copy=lookup.copy), 16)
    engine.target.reset()
    events = list(engine.generate(prompt, max_tokens=MAX_TOKENS, policy=policy))
    spec = [t for ev in events for t in ev.tokens]
    copied = sum(ev.step.info.copied for ev in events if ev.step)
    verified = dict(rec.rows)
    for i, tok in enumerate(spec[1:], start=1):
        assert int(np.argmax(verified[len(prompt) + i - 1])) == tok, f"token {i} is not the target's argmax"
    j = first_divergence(plain, spec)
    print(f"\nan edit's draft: {copied} tokens copied from the prompt; {'same text' if j is None else f'diverged at token {j}'}")
    assert copied > 0
    if j is not None:
        m = plain_margins.get(len(prompt) + j - 1)
        assert m is not None and m < 2 * epsilon, f"diverged at token {j} where the top-2 margin was {m}"


@pytest.mark.integration
def test_self_speculation_accepts_nearly_everything(draft_rt):
    """The 0.5B drafting for itself: any rejection can only come from batch noise."""
    from homespec.llama.runtime import Runtime
    from tests.integration.conftest import OPTS

    twin = Runtime(draft_rt.path, OPTS)
    try:
        engine = Engine(draft_rt)
        policy = FixedPolicy(DraftProposer(twin, draft_rt.n_vocab), 4)
        total_p = total_a = 0
        for text in PROMPTS[:2]:
            _, st = generate(engine, encode(draft_rt, text), policy)
            total_p += st.proposed
            total_a += st.accepted
        print(f"\nself-speculation: {total_a}/{total_p} accepted")
        assert total_p > 0 and total_a / total_p >= 0.95
    finally:
        twin.close()
        draft_rt.reset()


@pytest.mark.integration
def test_the_same_question_again_drafts_its_remembered_answer_and_says_the_same(target_rt, epsilon):
    """Prompt lookup across requests (ngram_memory.py) on the real target: the second time, the
    first answer is the draft. It is verified as any draft is, so the text is the target's argmax
    and equals the first answer up to a near-tie (batch noise, as above); what was the same is
    drafted nearly whole."""
    from homespec.speculation.proposers.ngram_memory import NgramMemory, question_key

    rec = Recording(target_rt)
    engine = Engine(rec)
    prompt = encode(target_rt, PROMPTS[0])
    first, _ = generate(engine, prompt, FixedPolicy())
    margins = {pos: margin(row) for pos, row in rec.rows}
    memory = NgramMemory(8192)
    memory.add(prompt + first, len(prompt), question_key(prompt))  # as the engine's end of a greedy generation does
    rec.rows.clear()
    again, st = generate(engine, prompt, FixedPolicy(NgramProposer(2, 12, memory), 8))
    verified = dict(rec.rows)
    for i, tok in enumerate(again[1:], start=1):
        assert int(np.argmax(verified[len(prompt) + i - 1])) == tok, f"token {i} is not the target's argmax"
    j = first_divergence(first, again)
    print(f"\nthe same question again: {st.accepted}/{st.proposed} drafted tokens kept in {st.steps} steps; "
          f"{'same text' if j is None else f'diverged at token {j}'}")
    if j is not None:
        m = margins.get(len(prompt) + j - 1)
        assert m is not None and m < 2 * epsilon, f"diverged at token {j} where the top-2 margin was {m}"
    same = len(first) if j is None else j  # tokens the memory held right
    assert st.accepted >= 0.8 * (same - 1) - 8  # all but the first token and the step that met the divergence


@pytest.mark.integration
def test_on_the_wheels_q4k_kernels_every_pass_of_up_to_65_rows_gives_a_row_its_one_token_logits() -> None:
    """Batch noise 0 in the default mode where the wheel's Q4_K kernels run (AVX-512 VNNI, or AVX2
    without it; no AMX): repacked Q4_K products round each row as its one-row gemv does, Q6_K's
    take the columns kernel and attention the grouped kernel up to 65 rows (a verify pass of a
    64-token draft), so greedy speculation says what plain decoding says, near-ties included.
    Measured 0.46-0.56 at 4-17 rows before the gemm rounded so (2026-12-07); ggml's tiled kernels
    from 66 rows differ."""
    if not _build_is_batch_invariant():
        pytest.skip("needs a `make install` build with the wheel's Q4_K kernels (AVX2) and without AMX")
    deltas = _default_mode_batch_noise()
    assert all(d == 0.0 for ds in deltas.values() for d in ds), f"max |Δlogit| alone vs in passes of 2/4/9/17/33/65 rows: {deltas}"


@pytest.mark.integration
def test_with_the_q4k_kernels_switched_off_rows_in_a_pass_differ_from_the_row_alone() -> None:
    """The other half of `homespec doctor`'s "greedy:" line, and what makes the zero above the
    kernels' doing: ggml's own repacked Q4_K gemm (the kernels' switch off, which is what a build
    without them runs) rounds a row in a pass of 4+ otherwise than its one-row gemv."""
    from homespec.llama import cpu_build, kernels

    if not _build_is_batch_invariant():
        pytest.skip("needs a `make install` build with the wheel's Q4_K kernels (AVX2) and without AMX")
    switch = kernels._find_switch(cpu_build.Q4K_VNNI_SWITCH_SYMBOL)
    assert switch is not None, "a build with cpu-q4k-vnni exports its switch"
    switch(False)
    try:
        deltas = _default_mode_batch_noise()
    finally:
        switch(True)
    assert max(d for ds in deltas.values() for d in ds) > 0.0, deltas


def _build_is_batch_invariant() -> bool:
    from homespec.llama import cpu_build

    folder = cpu_build.installed_package_dir()
    options = cpu_build.read_stamp(folder) if folder is not None else None
    return options is not None and cpu_build.rows_batch_invariant(options, cpu_build.read_fixes(folder))


def _default_mode_batch_noise() -> dict[str, list[float]]:
    """{prompt: [max |Δlogit| at each pass size]}: the target's rows in passes of 2-65 against one."""
    from homespec.llama.runtime import Runtime, RuntimeOptions
    from tests.conftest import TARGET, require
    from tests.integration.exactness import PROBE_PROMPTS, batch_noise

    rt = Runtime(require(TARGET), RuntimeOptions(n_ctx=1024, n_batch=256, flash_attn=True))  # the daemon's default on a CPU
    try:
        return batch_noise(rt, PROBE_PROMPTS[:1], positions=65, sizes=(2, 4, 9, 17, 33, 65))
    finally:
        rt.close()

