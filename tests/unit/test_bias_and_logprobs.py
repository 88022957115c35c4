"""logit_bias and logprobs through the generation loop, on scripted logits.

The bias lives in the one sampling transform, so speculation must stay exact with it; logprobs
are read from the rows the target already computed (the prefill's last row, then each step's
verified rows), so they must equal what plain decoding's rows give, with no extra pass.
"""

from __future__ import annotations

import numpy as np
import pytest

from homespec.speculation.engine import Engine, FixedPolicy, GenerationStats
from homespec.speculation.proposers.draft import DraftProposer
from homespec.speculation.sampling import SamplingParams, with_logit_bias

from .fakes import FakeRuntime
from .test_engine import EOS, PROMPT, VisibleEos, make_engine, run

POLICIES = [("off", 0, None), ("draft", 4, 0), ("draft", 3, 7), ("ngram", 4, None)]
POLICY_IDS = ["plain", "perfect-draft-k4", "wrong-draft-k3", "ngram-k4"]


def policy_for(eng: Engine, name: str, k: int) -> FixedPolicy:
    return FixedPolicy() if name == "off" else FixedPolicy(eng.proposers[name], k)


def banning(tokens: list[int], boost: int | None = None) -> SamplingParams:
    """Greedy with the given tokens banned (-100) and one boosted (+2)."""
    bias = {t: -100.0 for t in tokens}
    if boost is not None:
        bias[boost] = 2.0
    return with_logit_bias(SamplingParams(), bias)


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max()
    return z - m - np.log(np.exp(z - m).sum())


def shown(events, target) -> tuple[str, list[int]]:
    text = "".join(e.text for e in events)
    return text, [lp.token for e in events for lp in e.logprobs]


# -- logit_bias ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, k, draft_seed", POLICIES[1:], ids=POLICY_IDS[1:])
def test_greedy_output_with_a_logit_bias_is_plain_decodings_with_the_same_bias(name, k, draft_seed):
    free, _, _, _ = run(make_engine(), policy=FixedPolicy(), max_tokens=40)
    boost = next(t for t in free[6:] if t not in free[:6])
    params = banning(sorted(set(free[:6])), boost=boost)
    ref, ref_text, _, _ = run(make_engine(), policy=FixedPolicy(), params=params, max_tokens=40)
    assert ref != free and not set(free[:6]) & set(ref)  # the bias bit: banned tokens never come
    eng = make_engine(draft_seed=draft_seed if draft_seed is not None else 1)
    out, text, _, st = run(eng, policy=(name, k), params=params, max_tokens=40)
    assert out == ref and text == ref_text
    assert st.proposed > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_draft_that_is_the_target_accepts_every_token_under_a_logit_bias(temperature):
    """The draft proposes through the same transform, bias included: were the bias left out of
    its q, its guesses would be the unbiased ones and the banned tokens would be rejected."""
    free, _, _, _ = run(make_engine(), policy=FixedPolicy(), max_tokens=30)
    params = with_logit_bias(SamplingParams(temperature=temperature, seed=2), {t: -100.0 for t in set(free)})
    _, _, _, st = run(make_engine(draft_seed=0), policy=("draft", 4), params=params, max_tokens=30)
    # greedy: the same argmax; seeded sampling: the same q raced against the target's keys
    assert st.accepted == st.proposed > 0


def test_seeded_sampled_output_with_a_logit_bias_is_the_same_for_every_proposer_and_k():
    bias = {3: -100.0, 5: 1.5, 9: -2.0}
    params = with_logit_bias(SamplingParams(temperature=0.9, top_p=0.95, seed=4, presence_penalty=0.3), bias)
    outs = [run(make_engine(draft_seed=ds if ds is not None else 1), policy=policy_for_name(n, k), params=params, max_tokens=40)[0]
            for n, k, ds in POLICIES]
    assert all(o == outs[0] for o in outs[1:])
    assert 3 not in outs[0]


def policy_for_name(name: str, k: int):
    return FixedPolicy() if name == "off" else (name, k)


# -- logprobs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, k, draft_seed", POLICIES, ids=POLICY_IDS)
def test_logprobs_come_from_verified_rows_and_match_plain_decoding(name, k, draft_seed):
    bias = {4: 1.0, 11: -3.0}
    params = with_logit_bias(SamplingParams(), bias)
    eng = make_engine(draft_seed=draft_seed if draft_seed is not None else 1)
    out, text, events, _ = run(eng, policy=policy_for_name(name, k), params=params, max_tokens=30, logprobs=3)
    lps = [lp for e in events for lp in e.logprobs]
    assert [lp.token for lp in lps] == out  # no stop string, no EOS: every token is shown
    ref = FakeRuntime(seed=0)
    shift = np.zeros(ref.n_vocab)
    for t, b in bias.items():
        shift[t] = b
    for i, lp in enumerate(lps):
        want = log_softmax(ref.logits_after(PROMPT + out[:i]) + shift)  # plain decoding's row i
        assert lp.logprob == pytest.approx(want[lp.token], abs=1e-6)
        assert [t for t, _ in lp.top] == list(np.argsort(-want, kind="stable")[:3])
        assert lp.top[0][0] == lp.token  # greedy: the emitted token is the row's argmax


@pytest.mark.parametrize("name, k, draft_seed", POLICIES, ids=POLICY_IDS)
def test_logprobs_cost_no_extra_target_pass(name, k, draft_seed):
    evals = []
    for logprobs in (None, 5):
        eng = make_engine(draft_seed=draft_seed if draft_seed is not None else 1)
        run(eng, policy=policy_for_name(name, k), max_tokens=25, logprobs=logprobs)
        evals.append(eng.target.evals)
    assert evals[0] == evals[1]


@pytest.mark.parametrize(
    "params",
    [
        with_logit_bias(SamplingParams(presence_penalty=0.8, repetition_penalty=1.3), {2: 2.0, 7: -100.0}),
        with_logit_bias(SamplingParams(temperature=0.8, top_k=5, seed=3, frequency_penalty=0.5), {2: 2.0}),
    ],
    ids=["greedy-bias-penalties", "seeded-sampled"],
)
def test_logprobs_are_identical_with_speculation_off_and_on(params):
    runs = []
    for name, k, ds in POLICIES:
        eng = make_engine(draft_seed=ds if ds is not None else 1)
        out, _, events, st = run(eng, policy=policy_for_name(name, k), params=params, max_tokens=30, logprobs=2)
        runs.append((out, [lp for e in events for lp in e.logprobs]))
    assert all(r == runs[0] for r in runs[1:])


def test_logprobs_arrive_with_the_text_they_score_when_a_stop_string_holds_text_back():
    eng = make_engine(draft_seed=0)
    _, ref_text, _, _ = run(make_engine(), policy=FixedPolicy(), max_tokens=60)
    stop = ref_text[20:24]  # starts mid-output; multi-character pieces ("[40]") may straddle it
    _, text, events, _ = run(eng, policy=("draft", 4), max_tokens=60, stop=[stop], logprobs=0)
    assert text == ref_text[: ref_text.index(stop)]
    piece = lambda t: eng.target.piece(t).decode()  # noqa: E731
    so_far, released = "", ""
    for e in events[:-1]:
        so_far += e.text
        released += "".join(piece(lp.token) for lp in e.logprobs)
        assert so_far.startswith(released)  # a token's logprob never comes before its text
    released += "".join(piece(lp.token) for lp in events[-1].logprobs)
    # At the end: exactly the tokens that show text — the last may run past the stop's start.
    last = piece(events[-1].logprobs[-1].token) if events[-1].logprobs else ""
    assert released.startswith(text) and len(released) - len(last) < len(text)


@pytest.mark.parametrize("where", ["at-a-token-boundary", "inside-a-token"])
def test_the_stop_strings_own_tokens_and_everything_after_get_no_logprob(where):
    eng = make_engine()
    ref, ref_text, _, _ = run(make_engine(), policy=FixedPolicy(), max_tokens=60)
    pieces = [eng.target.piece(t).decode() for t in ref]
    starts = np.cumsum([0] + [len(x) for x in pieces])  # [n + 1] where each token's text begins
    shift = 0 if where == "at-a-token-boundary" else 1

    def first_seen(i: int) -> bool:  # token i has several characters; the stop occurs first there
        cut = int(starts[i]) + shift
        return len(pieces[i]) > 1 and ref_text.index(ref_text[cut : cut + 6]) == cut

    i = next(i for i in range(10, len(ref) - 3) if first_seen(i))
    cut = int(starts[i]) + shift
    stop = ref_text[cut : cut + 6]
    out, text, events, _ = run(eng, policy=FixedPolicy(), max_tokens=60, stop=[stop], logprobs=0)
    assert text == ref_text[:cut]
    reported = [lp.token for e in events for lp in e.logprobs]
    # The tokens that show any text: those before the stop, and the one it starts inside of.
    assert reported == ref[: i + (where == "inside-a-token")]
    assert len(reported) < len(out)  # the stop's own tokens were generated, and not reported


@pytest.mark.parametrize("k", [0, 4])
def test_eos_ends_generation_without_a_logprob(k):
    target = VisibleEos(eos=EOS)
    policy = FixedPolicy(DraftProposer(VisibleEos(eos=EOS), target.n_vocab), k)
    st = GenerationStats()
    events = list(Engine(target).generate(PROMPT, policy=policy, stats=st, max_tokens=200, logprobs=1))
    out = [t for e in events for t in e.tokens]
    assert out[-1] == EOS
    assert [lp.token for e in events for lp in e.logprobs] == out[:-1]


@pytest.mark.parametrize("max_tokens", [1, 3, 7])
def test_max_tokens_mid_step_reports_exactly_the_emitted_tokens(max_tokens):
    out, _, events, _ = run(make_engine(draft_seed=0), policy=("draft", 5), max_tokens=max_tokens, logprobs=0)
    assert [lp.token for e in events for lp in e.logprobs] == out and len(out) == max_tokens


def test_without_logprobs_events_carry_none():
    _, _, events, _ = run(make_engine(draft_seed=0), policy=("draft", 4), max_tokens=20)
    assert all(e.logprobs == [] for e in events)
