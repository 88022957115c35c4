"""The generation loop on a scripted model: exactness, stop conditions, cache invariants."""

from __future__ import annotations

import numpy as np
import pytest

from homespec.speculation.engine import Engine, FixedPolicy, GenerationStats, PromptTooLong
from homespec.speculation.proposers.draft import DraftProposer
from homespec.speculation.proposers.ngram import NgramProposer
from homespec.speculation.sampling import SamplingParams

from .fakes import FakeRuntime

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]


def make_engine(target_seed=0, draft_seed=None, **kw):
    target = FakeRuntime(seed=target_seed, **kw)
    proposers = {"ngram": NgramProposer(1, 3)}
    if draft_seed is not None:
        proposers["draft"] = DraftProposer(FakeRuntime(seed=draft_seed, **kw), target.n_vocab)
    engine = Engine(target)
    engine.proposers = proposers  # the rig's proposers by name, for run()'s (name, k) policies
    return engine


def run(engine, prompt=PROMPT, policy=None, **kw):
    """policy: a SpeculationPolicy, or (proposer name, k) for a fixed one over the rig's proposers."""
    if isinstance(policy, tuple):
        name, k = policy
        policy = FixedPolicy(engine.proposers[name], k)
    st = GenerationStats()
    events = list(engine.generate(prompt, policy=policy, stats=st, **kw))
    tokens = [t for e in events for t in e.tokens]
    text = "".join(e.text for e in events)
    return tokens, text, events, st


def plain(prompt=PROMPT, **kw):
    return run(make_engine(), prompt, FixedPolicy(), **kw)


@pytest.mark.parametrize(
    "proposer, draft_seed, k",
    [("draft", 0, 4), ("draft", 0, 1), ("draft", 7, 3), ("ngram", None, 4), ("ngram", None, 8)],
    ids=["perfect-draft-k4", "perfect-draft-k1", "wrong-draft-k3", "ngram-k4", "ngram-k8"],
)
def test_greedy_output_matches_plain_decoding(proposer, draft_seed, k):
    ref, ref_text, _, _ = plain(max_tokens=60)
    eng = make_engine(draft_seed=draft_seed if draft_seed is not None else 1)
    out, text, _, st = run(eng, policy=(proposer, k), max_tokens=60)
    assert out == ref and text == ref_text
    assert st.proposed > 0


def test_self_speculation_accepts_every_proposed_token():
    eng = make_engine(draft_seed=0)  # the draft is the target
    _, _, _, st = run(eng, policy=("draft", 4), max_tokens=41)
    assert st.accepted == st.proposed > 0
    assert st.acceptance_length == pytest.approx(5.0)


def test_wrong_draft_still_emits_one_token_per_step():
    eng = make_engine(draft_seed=99)
    _, _, events, st = run(eng, policy=("draft", 3), max_tokens=30)
    steps = [e for e in events if e.step is not None]
    rejected_at_once = [e for e in steps[:-1] if e.step.accepted == 0]  # the last may be cut by max_tokens
    assert rejected_at_once, "the wrong draft was never refused outright: nothing tested"
    assert all(len(e.tokens) == 1 for e in rejected_at_once)  # the target's own token, still
    assert all(len(e.tokens) == e.step.accepted + 1 for e in steps[:-1])
    assert st.emitted == st.accepted + st.steps and st.completion_tokens == 30


@pytest.mark.parametrize("temperature, top_p", [(0.7, 1.0), (1.0, 0.9)])
def test_sampled_output_is_reproducible_with_seed(temperature, top_p):
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=11)
    a, _, _, _ = run(make_engine(draft_seed=3), policy=("draft", 3), params=params, max_tokens=40)
    b, _, _, _ = run(make_engine(draft_seed=3), policy=("draft", 3), params=params, max_tokens=40)
    c, _, _, _ = run(make_engine(draft_seed=3), policy=("draft", 3), params=SamplingParams(temperature=temperature, top_p=top_p, seed=12), max_tokens=40)
    assert a == b and a != c


def test_sampled_speculative_tokens_always_have_target_support():
    """Every emitted token must be possible under the target's truncated distribution."""
    params = SamplingParams(temperature=0.8, top_k=3, seed=5)
    eng = make_engine(draft_seed=4)
    out, _, _, _ = run(eng, policy=("draft", 4), params=params, max_tokens=50)
    ref = FakeRuntime(seed=0)
    ctx = list(PROMPT)
    for tok in out:
        z = ref.logits_after(ctx)
        assert tok in set(np.argsort(-z)[:3]), "token outside the target's top-k"
        ctx.append(tok)


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 13])
def test_max_tokens_respected_even_mid_step(max_tokens):
    out, _, events, st = run(make_engine(draft_seed=0), policy=("draft", 5), max_tokens=max_tokens)
    assert len(out) == max_tokens == st.completion_tokens
    assert events[-1].finish_reason == "length"


def test_stop_string_spanning_steps_is_never_emitted():
    ref_tokens, ref_text, _, _ = plain(max_tokens=60)
    stop = ref_text[20:23]  # three characters from the middle of the plain output
    first = ref_text.index(stop)
    for policy in (FixedPolicy(), ("draft", 4)):
        _, text, events, st = run(make_engine(draft_seed=0), policy=policy, max_tokens=60, stop=["never", stop])
        assert text == ref_text[:first]
        assert events[-1].finish_reason == "stop" and st.stop_word == stop  # which one (llama.cpp's stopping_word)


class VisibleEos(FakeRuntime):
    """EOS with a printable piece, so that emitting its text would show in the output."""

    def piece(self, token: int, special: bool = False) -> bytes:
        return b"<eos>" if token == self.eos else super().piece(token, special)


EOS = 27  # greedy decoding of PROMPT reaches it as the 41st token (found by search)


@pytest.mark.parametrize("k", [0, 4])
def test_eos_ends_generation_without_emitting_its_text(k):
    target = VisibleEos(eos=EOS)
    eng = Engine(target)
    policy = FixedPolicy(DraftProposer(VisibleEos(eos=EOS), target.n_vocab), k)  # k = 4: EOS mid-step
    st = GenerationStats()
    events = list(eng.generate(PROMPT, policy=policy, stats=st, max_tokens=200))
    out = [t for e in events for t in e.tokens]
    text = "".join(e.text for e in events)
    assert events[-1].finish_reason == st.finish_reason == "stop" and st.stop_word is None
    assert out[-1] == EOS and EOS not in out[:-1] and len(out) == 41 == st.completion_tokens
    assert text == "".join(target.piece(t).decode() for t in out[:-1])  # no "<eos>", nothing after
    assert target.tokens == PROMPT + out[:-1]  # the cache holds neither EOS nor drafted tokens past it


def test_full_context_stops_with_a_reason_not_an_exception():
    eng = make_engine(draft_seed=0, n_ctx=40)
    out, _, events, st = run(eng, policy=("draft", 8), max_tokens=1000)
    assert events[-1].finish_reason == "context"
    assert len(PROMPT) + len(out) == 40


def test_prompt_longer_than_context_is_refused_before_any_work():
    eng = make_engine(n_ctx=10)
    with pytest.raises(PromptTooLong):
        eng.generate(PROMPT, max_tokens=5)


def test_target_cache_holds_all_committed_tokens_but_the_last_after_every_step():
    eng = make_engine(draft_seed=2)
    ctx = list(PROMPT)
    for ev in eng.generate(PROMPT, policy=FixedPolicy(eng.proposers["draft"], 3), max_tokens=30):
        ctx += ev.tokens
        assert eng.target.tokens == ctx[:-1]


def test_draft_catches_up_in_one_batch_and_never_reevaluates_the_prompt():
    eng = make_engine(draft_seed=0)
    draft_rt = eng.proposers["draft"].rt
    run(eng, policy=("draft", 3), max_tokens=20)
    # begin() evaluates the prompt once; afterwards every call is a catch-up batch of 1-2 tokens
    # (bonus, plus the last accepted when all were accepted) or a single drafting pass.
    assert draft_rt.evals[0] == len(PROMPT) - 1
    assert max(draft_rt.evals[1:]) <= 2


def _copying_rig(copy: bool):
    """A prompt that holds 40 tokens of its own greedy answer: the scripted target's logits see
    two tokens back, so after PROMPT's end again it answers as it did after PROMPT."""
    ref, _, _, _ = plain(max_tokens=60)
    prompt = [*PROMPT, *ref[:40], *PROMPT]
    eng = make_engine(draft_seed=0)  # a draft that guesses as the target
    ngram = NgramProposer(2, 5)
    ngram.begin(prompt)
    eng.proposers["draft"].copy = ngram.copy if copy else None
    return eng, prompt, ref


def test_draft_guesses_that_copy_the_prompt_go_on_as_it_without_draft_passes():
    runs = {}
    for copy in (False, True):
        eng, prompt, ref = _copying_rig(copy)
        out, _, events, st = run(eng, prompt, policy=("draft", 16), max_tokens=60)
        assert out == ref  # exact: the copy past the prompt's 40 answer tokens is refused where it is wrong
        runs[copy] = (len(eng.proposers["draft"].rt.evals), sum(e.step.info.copied for e in events if e.step))
    (passes_alone, copied_alone), (passes, copied) = runs[False], runs[True]
    assert copied_alone == 0 and copied > 0
    assert passes <= passes_alone - copied // 2  # each copied token saved its draft pass, or nearly


def test_a_draft_copies_the_prompt_only_for_greedy_requests():
    prompt = [*PROMPT, 1, 2, 3, 4]
    draft = DraftProposer(FakeRuntime(seed=0), 64, copy=lambda context, drafted, k: [5] * k if len(drafted) >= 2 else [])
    draft.begin(prompt)
    greedy = draft.propose(prompt, 6, SamplingParams(), np.random.default_rng(0))
    assert greedy.tokens[2:] == [5] * 4 and greedy.info.copied == 4 and greedy.q is None
    sampled = draft.propose(prompt, 6, SamplingParams(temperature=0.8, seed=1), np.random.default_rng(0))
    assert len(sampled.tokens) == 6 and sampled.info.copied == 0 and sampled.q.shape == (6, 64)


def test_the_first_token_is_out_before_the_draft_reads_the_prompt():
    """A draft's prefill of the prompt is not in the time to first token: the first event is
    handed out before the proposers begin (a voice command's wait is the product)."""
    eng = make_engine(draft_seed=0)
    draft_rt = eng.proposers["draft"].rt
    seen = []
    for ev in eng.generate(PROMPT, policy=FixedPolicy(eng.proposers["draft"], 3), max_tokens=8):
        seen.append((len(ev.tokens), list(draft_rt.evals)))
    assert seen[0] == (1, [])  # the first token, and the draft has read nothing yet
    assert draft_rt.evals[0] == len(PROMPT) - 1  # then it read the prompt once, as before


def test_a_generation_that_ends_at_its_first_token_never_prefills_the_draft():
    eng = make_engine(draft_seed=0)
    run(eng, policy=("draft", 3), max_tokens=1)
    assert eng.proposers["draft"].rt.evals == []


def test_second_request_with_shared_prefix_reuses_the_cache():
    eng = make_engine()
    first, _, _, _ = run(eng, policy=FixedPolicy(), max_tokens=5)
    follow_up = PROMPT + first + [7, 7]
    _, _, _, st = run(eng, prompt=follow_up, policy=FixedPolicy(), max_tokens=5)
    assert st.cached_tokens == len(PROMPT) + len(first) - 1  # all but the last emitted token
    fresh, _, _, _ = run(make_engine(), prompt=follow_up, policy=FixedPolicy(), max_tokens=5)
    again, _, _, _ = run(eng, prompt=follow_up, policy=FixedPolicy(), max_tokens=5)
    assert again == fresh


def test_closing_the_stream_mid_generation_leaves_a_consistent_cache():
    eng = make_engine(draft_seed=0)
    gen = eng.generate(PROMPT, policy=FixedPolicy(eng.proposers["draft"], 4), max_tokens=50)
    ctx = list(PROMPT)
    for _, ev in zip(range(3), gen):
        ctx += ev.tokens
    gen.close()
    assert eng.target.tokens == ctx[:-1]
    out, _, _, _ = run(eng, policy=("draft", 4), max_tokens=20)
    ref, _, _, _ = plain(max_tokens=20)
    assert out == ref
