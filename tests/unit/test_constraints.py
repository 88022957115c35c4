"""Constrained decoding on the scripted model: every output obeys the grammar, speculation under
a grammar is exactly constrained plain decoding (greedy, seeded and sampled), and the grammar's
forced tokens are free drafts the target always accepts."""

from __future__ import annotations

import re

import llguidance
import numpy as np
import pytest

from homespec.speculation.constraints import Grammar, GrammarError, check_grammar, json_schema_grammar, lark_grammar
from homespec.speculation.engine import FORCED, GRAMMAR_DEAD_END, Engine, FixedPolicy, GenerationStats
from homespec.speculation.proposers.draft import DraftProposer
from homespec.speculation.proposers.ngram import NgramProposer
from homespec.speculation.sampling import SamplingParams, penalize, probabilities, window

from .fakes import FakeRuntime, grammar_tokenizer
from .test_engine_distribution import DRAWS, N_TOKENS, PARAMS, PROMPT, fit_pvalue, fixed_rng  # noqa: F401

# Letters a-f only, in runs that a scripted model over 64 tokens (a-z, then "[26]"...) would
# leave on its own almost every step.
RUN = r"[a-f]+(x[a-f]+)*"


def grammar_for(rt: FakeRuntime, grammar: str) -> Grammar:
    return Grammar(grammar, grammar_tokenizer(rt), rt.n_vocab)


def generate(target: FakeRuntime, grammar_src: str, policy=None, params=SamplingParams(), max_tokens=40, prompt=PROMPT):
    st = GenerationStats()
    events = list(Engine(target).generate(prompt, params, max_tokens, policy=policy, stats=st,
                                          grammar=grammar_for(target, grammar_src)))
    return [t for e in events for t in e.tokens], "".join(e.text for e in events), st


@pytest.mark.parametrize("proposer, k", [("draft-close", 4), ("draft-wrong", 3), ("ngram", 4)])
def test_greedy_constrained_output_matches_constrained_plain_decoding(proposer, k):
    grammar = llguidance.LLMatcher.grammar_from_regex(RUN)
    ref, ref_text, _ = generate(FakeRuntime(seed=0), grammar)
    assert re.fullmatch(RUN, ref_text), ref_text  # the control obeys the grammar
    prop = {"draft-close": lambda: DraftProposer(FakeRuntime(seed=0, sharpness=2.5), 64),
            "draft-wrong": lambda: DraftProposer(FakeRuntime(seed=5), 64),
            "ngram": lambda: NgramProposer(1, 3)}[proposer]()
    out, text, st = generate(FakeRuntime(seed=0), grammar, FixedPolicy(prop, k))
    assert out == ref and text == ref_text
    assert st.proposed > 0


def test_unconstrained_model_leaves_the_grammar_so_the_mask_is_doing_the_work():
    st = GenerationStats()
    events = list(Engine(FakeRuntime(seed=0)).generate(PROMPT, SamplingParams(), 40, stats=st))
    assert not re.fullmatch(RUN, "".join(e.text for e in events))


def test_jump_forward_tokens_are_free_drafts_the_target_always_accepts():
    target = FakeRuntime(seed=0, vocab=64, eos=63)
    out, text, st = generate(target, lark_grammar('root ::= "abcdef" [g-h]+ "zz"'), FixedPolicy(), max_tokens=12)
    assert text.startswith("abcdef")
    forced = {c: n for c, n in st.by_choice.items() if c.startswith(FORCED)}
    assert forced, st.by_choice  # "bcdef" came as one forced step after the prefill's "a"
    assert st.accepted == st.proposed == 5  # plain steps propose nothing; forced ones all land
    assert target.evals[1] == 6  # one pass verified the five forced tokens (+ the last token)


def test_generation_ends_when_the_grammar_is_complete():
    target = FakeRuntime(seed=0, vocab=64, eos=63)
    out, text, st = generate(target, lark_grammar('root ::= "ab" [c-d] "e"'), FixedPolicy(), max_tokens=30)
    assert re.fullmatch("ab[cd]e", text)
    assert st.finish_reason == "stop" and out[-1] == 63  # the only token the mask then allows


@pytest.mark.parametrize("policy", [FixedPolicy(), FixedPolicy(NgramProposer(1, 3), 4)])
def test_a_grammar_left_with_no_way_on_ends_as_a_dead_end_not_as_a_complete_answer(policy):
    # "ab", then a rule defined only by itself: llguidance finds at the third mask that nothing
    # can follow, allows only end-of-generation, and the answer stopped as if complete.
    target = FakeRuntime(seed=0, vocab=64, eos=63)
    out, text, st = generate(target, lark_grammar('root ::= "ab" x\nx ::= x'), policy, max_tokens=30)
    assert text == "ab" and out[-1] == 63
    assert st.finish_reason == GRAMMAR_DEAD_END != "stop"


def test_invalid_schemas_and_grammars_are_refused_before_generation():
    check_grammar(json_schema_grammar({"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}))
    with pytest.raises(GrammarError, match="schema|grammar"):
        json_schema_grammar({"type": "object", "properties": "not an object"})  # type: ignore[dict-item]
    with pytest.raises(GrammarError, match="grammar"):
        lark_grammar("root ::= undefined_rule")
    with pytest.raises(GrammarError, match="grammar"):
        check_grammar("start: (")


@pytest.mark.parametrize("source", [lark_grammar("root ::= root"), json_schema_grammar({"$ref": "#"})])
def test_a_grammar_that_matches_no_text_is_refused_when_the_request_starts_not_answered_empty(source):
    # Both compile; the first mask then has no way on, and generation ended at once, "" with
    # finish_reason "stop", a 200 for a request that cannot be answered.
    with pytest.raises(GrammarError, match="matches no text"):
        grammar_for(FakeRuntime(seed=0), source)


def test_masks_roll_the_grammar_back_after_a_draft():
    g = grammar_for(FakeRuntime(vocab=8), llguidance.LLMatcher.grammar_from_regex("[a-f][bcdg][a-h][aceg][a-h]*"))
    before = g.allowed().copy()
    rows = g.masks([0, 1, 7, 2])  # "a b h c": valid, valid, valid, invalid at row 3
    assert rows.shape == (5, 8)
    assert rows[0].tolist() == before.tolist()
    assert rows[1].tolist() == [False, True, True, True, False, False, True, False]
    assert rows[3].tolist() == [True, False, True, False, True, False, True, False]
    assert rows[4].all()  # after the invalid token: never read
    assert g.allowed().tolist() == before.tolist()  # rolled back
    assert g.cut([0, 1, 7, 1], keep_first_invalid=False) == [0, 1, 7]
    assert g.cut([0, 1, 7, 1], keep_first_invalid=True) == [0, 1, 7, 1]


# -- temperature > 0: the constrained target's distribution, exactly -----------------------------

# The grammar bans tokens the draft likes at some positions, so its sampled drafts leave the
# grammar often: the kept-invalid-token path (constraints.Grammar.cut) is exercised.
SAMPLED_RE = "[a-f][bcdg][a-h][aceg][a-h]*"
VOCAB = 8


def exact_constrained_starts(params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first N_TOKENS tokens = s) under plain decoding of the masked target."""
    ref = FakeRuntime(vocab=VOCAB, seed=0, sharpness=1.0)
    grammar = llguidance.LLMatcher.grammar_from_regex(SAMPLED_RE)
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(N_TOKENS):
        nxt: dict[tuple[int, ...], float] = {}
        for s, ps in out.items():
            g = grammar_for(ref, grammar)
            g.commit(s)
            ctx = PROMPT + list(s)
            z = np.where(g.allowed(), penalize(ref.logits_after(ctx), params, window(ctx, params)), -np.inf)
            p = probabilities(z, params)  # [vocab]
            for t in np.flatnonzero(p):
                nxt[(*s, int(t))] = ps * float(p[t])
        out = nxt
    return out


def constrained_starts(k: int, seeded: bool) -> tuple[list[tuple[int, ...]], float]:
    target = FakeRuntime(vocab=VOCAB, seed=0, sharpness=1.0)
    draft = DraftProposer(FakeRuntime(vocab=VOCAB, seed=0, sharpness=1.6), VOCAB)
    grammar = llguidance.LLMatcher.grammar_from_regex(SAMPLED_RE)
    tok = grammar_tokenizer(target)
    eng = Engine(target)
    starts, accepted, proposed = [], 0, 0
    for i in range(DRAWS):
        params = SamplingParams(**PARAMS, seed=i if seeded else None)
        st = GenerationStats()
        events = eng.generate(PROMPT, params, N_TOKENS + 1, policy=FixedPolicy(draft, k) if k else FixedPolicy(),
                              stats=st, grammar=Grammar(grammar, tok, VOCAB))
        starts.append(tuple([t for ev in events for t in ev.tokens][:N_TOKENS]))
        accepted, proposed = accepted + st.accepted, proposed + st.proposed
    return starts, accepted / proposed if proposed else 0.0


@pytest.mark.parametrize("k, seeded", [(0, False), (3, False), (3, True)], ids=["plain", "leviathan", "seeded"])
def test_sampled_constrained_speculation_keeps_the_constrained_targets_distribution(k, seeded, fixed_rng):  # noqa: F811
    starts, acceptance = constrained_starts(k, seeded)
    assert k == 0 or 0.2 < acceptance < 0.98  # accepts and rejections, grammar-invalid drafts among them
    p = fit_pvalue(starts, exact_constrained_starts(SamplingParams(**PARAMS)))
    assert p > 1e-3, f"k={k} seeded={seeded}: not the constrained target's distribution (chi-square p = {p:.2g})"


def test_a_complete_grammar_ends_with_the_models_end_token_under_speculation():
    """The grammar stops after its last character; the end token that follows is allowed by the
    mask but not consumed (llguidance refuses tokens after a stop), also inside a draft."""
    target = FakeRuntime(seed=0, vocab=64, eos=63)
    grammar = lark_grammar('root ::= "ab"')
    plain_out, _, _ = generate(target, grammar, FixedPolicy(), max_tokens=10)
    assert plain_out == [0, 1, 63]
    g = grammar_for(target, grammar)
    g.commit([0, 1])
    assert g.finished
    rows = g.masks([63, 5])  # the end token, then a token past the end: never read
    assert rows[0].tolist() == [t == 63 for t in range(64)]
    g.commit([63])  # no error


def test_nothing_is_forced_where_the_grammar_could_end():
    """After "ab" the grammar may end or take "c": llguidance's forced bytes say "c", but the
    end token is a way on too, so "c" is no free draft."""
    g = grammar_for(FakeRuntime(seed=0, vocab=64, eos=63), lark_grammar('root ::= "ab" "c"?'))
    assert g.forced(5) == [0, 1]
    g.commit([0, 1])
    assert g.forced(5) == []
    assert g.allowed()[2] and g.allowed()[63]
