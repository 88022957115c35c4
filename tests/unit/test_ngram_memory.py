"""Prompt lookup across requests: earlier answers as drafts for the same question again."""

from __future__ import annotations

import os
import subprocess
import sys

import llguidance
import numpy as np

from homespec.config import ControllerConfig
from homespec.speculation.constraints import Grammar
from homespec.speculation.controller import Controller
from homespec.speculation.engine import Engine, FixedPolicy, GenerationStats, shaping
from homespec.speculation.proposers.ngram import MATCH_CAP, NgramProposer
from homespec.speculation.proposers.ngram_memory import TAIL, NgramMemory, Recall, question_key
from homespec.speculation.sampling import SamplingParams

from .fakes import FakeRuntime
from .test_constraints import RUN, grammar_for

QUESTION = list(range(100, 160))  # [60] a prompt
ANSWER = [7, 3, 9, 4, 8, 2, 6, 5, 1, 30, 31, 32]  # [12]


def test_a_repeated_question_gets_the_earlier_answer_as_a_draft_matched_to_the_cap():
    mem = NgramMemory(1000)
    mem.add(QUESTION + ANSWER, len(QUESTION))
    assert mem.lookup(QUESTION, 5, MATCH_CAP) == Recall(ANSWER[:5], MATCH_CAP)
    # halfway through the answer it continues from there
    assert mem.lookup(QUESTION + ANSWER[:6], 16, MATCH_CAP) == Recall(ANSWER[6:], MATCH_CAP)


def test_a_draft_stops_where_the_remembered_answer_ended_and_never_runs_into_the_next():
    mem = NgramMemory(1000)
    mem.add(QUESTION + ANSWER, len(QUESTION))
    mem.add([50, 51, 52, 53, 54] + [60, 61], 5)
    assert mem.answers == 2 and len(mem) == (48 + 12 + 1) + (5 + 2 + 1)  # each with its prompt's tail and a separator
    tokens = mem.lookup(QUESTION + ANSWER[:-2], 16, MATCH_CAP).tokens
    assert tokens == ANSWER[-2:]


def test_only_the_prompts_tail_is_kept_and_an_unanswered_generation_leaves_nothing():
    mem = NgramMemory(1000)
    mem.add(QUESTION, len(QUESTION))
    assert len(mem) == 0
    long_prompt = list(range(1000, 1300))  # [300]
    mem.add(long_prompt + ANSWER, len(long_prompt))
    assert len(mem) == TAIL + len(ANSWER) + 1  # and a separator
    assert mem.lookup(long_prompt, 3, MATCH_CAP) == Recall(ANSWER[:3], MATCH_CAP)


def test_an_unrelated_context_finds_nothing_and_a_short_coincidence_reports_its_short_length():
    mem = NgramMemory(1000)
    mem.add(QUESTION + ANSWER, len(QUESTION))
    assert mem.lookup(list(range(500, 540)), 4, MATCH_CAP) == Recall([])
    other = list(range(900, 940)) + ANSWER[:4]  # another question whose answer opens the same 4 tokens
    assert mem.lookup(other, 3, MATCH_CAP) == Recall(ANSWER[4:7], 4)


def test_past_its_capacity_the_oldest_answers_go_and_the_newest_stay():
    mem = NgramMemory(400)
    prompts = [list(range(1000 * i, 1000 * i + 60)) for i in range(1, 11)]  # [60] each, distinct
    for i, p in enumerate(prompts):
        mem.add(p + [i] * 40, len(p), question_key(p))  # [48 tail + 40 answer] + separator each
        assert len(mem) <= 400
    assert mem.lookup(prompts[-1], 2, MATCH_CAP) == Recall([9, 9], MATCH_CAP)
    assert mem.lookup(prompts[0], 2, MATCH_CAP) == Recall([])
    assert mem.lookup(prompts[-1], 2, MATCH_CAP, question_key(prompts[-1]), 0) == Recall([9, 9], MATCH_CAP, True)


def test_a_forgotten_question_is_not_found_where_its_answer_used_to_lie():
    # Every answer the same words: where the first one lay, a kept one lies after eviction, and
    # only the question's own record can tell the two apart.
    mem = NgramMemory(400)
    prompts = [list(range(1000 * i, 1000 * i + 60)) for i in range(1, 11)]  # [60] each, distinct
    for p in prompts:
        mem.add(p + [7] * 40, len(p), question_key(p))
    said = prompts[0] + [7] * 35
    assert not mem.lookup(said, 2, MATCH_CAP, question_key(prompts[0]), 35).same_question
    assert mem.lookup(prompts[-1] + [7] * 35, 2, MATCH_CAP, question_key(prompts[-1]), 35).same_question


def test_a_memory_of_no_capacity_remembers_nothing():
    mem = NgramMemory(0)
    mem.add(QUESTION + ANSWER, len(QUESTION))
    assert len(mem) == 0 and mem.lookup(QUESTION, 4, MATCH_CAP) == Recall([])


def test_the_proposer_prefers_the_memory_only_where_it_matches_further_back_than_the_request_itself():
    mem = NgramMemory(1000)
    mem.add(QUESTION + ANSWER, len(QUESTION))
    prop = NgramProposer(2, 12, mem)
    prop.begin(QUESTION)
    m = prop.match(QUESTION, 4)
    assert (m.tokens, m.length, m.from_memory, m.from_prompt) == (ANSWER[:4], MATCH_CAP, True, False)
    evidence = prop.propose(QUESTION, 4, SamplingParams(), np.random.default_rng(0)).info.evidence
    assert evidence.from_memory and not evidence.repeat  # remembered without its question: not known to be the same
    # A prompt that quotes a passage twice copies it further back than a phrase an earlier
    # answer shares with it: the request's own text wins.
    mem.add([70, 71, 12, 1, 2, 3, 99], 2)
    quoting = [10, 11, 12, 1, 2, 3, 4, 5, 20, 10, 11, 12, 1, 2, 3]
    prop.begin(quoting)
    assert mem.lookup(quoting, 2, MATCH_CAP) == Recall([99], 4)
    m = prop.match(quoting, 2)
    assert (m.tokens, m.length, m.from_prompt, m.from_memory) == ([4, 5], 6, True, False)


def test_a_finished_generation_is_remembered_and_the_same_request_again_drafts_it_whole_with_the_same_text():
    rt = FakeRuntime(vocab=64, seed=3)
    mem = NgramMemory(4096)
    prompt = [5, 9, 2, 7, 3, 8, 11, 4]
    runs = []
    for _ in range(2):
        st = GenerationStats()
        policy = FixedPolicy(NgramProposer(2, 12, mem), 8)
        text = "".join(ev.text for ev in Engine(rt).generate(prompt, SamplingParams(temperature=0.0), 40, (), policy, st))
        runs.append((text, st))
    plain = "".join(ev.text for ev in Engine(rt).generate(prompt, SamplingParams(temperature=0.0), 40))
    (first, st1), (second, st2) = runs
    assert first == second == plain  # drafts never change what greedy decoding says
    assert st2.proposed == st2.accepted > 0  # every drafted token kept
    assert st2.steps < st1.steps


def test_the_same_prompt_again_is_the_same_question_and_a_prompt_that_only_ends_alike_is_not():
    # An editor's completion at the same cursor in a changed file: the prompt's last TAIL tokens
    # are the same, its start is not, and so (most likely) is its answer.
    changed = [1, 2, 3] + QUESTION[3:]
    mem = NgramMemory(1000)
    mem.add(QUESTION + ANSWER, len(QUESTION), question_key(QUESTION))
    assert mem.lookup(QUESTION, 4, MATCH_CAP, question_key(QUESTION), 0) == Recall(ANSWER[:4], MATCH_CAP, True)
    assert mem.lookup(QUESTION + ANSWER[:5], 4, MATCH_CAP, question_key(QUESTION), 5) == Recall(ANSWER[5:9], MATCH_CAP, True)
    alike = mem.lookup(changed, 4, MATCH_CAP, question_key(changed), 0)
    assert alike == Recall(ANSWER[:4], MATCH_CAP, False)  # the same 32-token lead-in, not the same question


def test_the_same_question_finds_its_own_answer_though_a_later_prompt_ended_alike():
    changed = [1, 2, 3] + QUESTION[3:]
    mem = NgramMemory(1000)
    mem.add(QUESTION + ANSWER, len(QUESTION), question_key(QUESTION))
    mem.add(changed + [40, 41, 42], len(changed), question_key(changed))  # now the latest after that lead-in
    assert mem.lookup(QUESTION, 4, MATCH_CAP) == Recall([40, 41, 42], MATCH_CAP)  # by the lead-in alone
    assert mem.lookup(QUESTION, 4, MATCH_CAP, question_key(QUESTION), 0) == Recall(ANSWER[:4], MATCH_CAP, True)


def test_an_answer_that_left_the_remembered_one_or_outran_it_is_no_longer_the_same_question():
    mem = NgramMemory(1000)
    q = question_key(QUESTION)
    mem.add(QUESTION + ANSWER, len(QUESTION), q)
    mem.add(list(range(300, 360)) + [77] * 20, 60, question_key(list(range(300, 360))))
    left = QUESTION + ANSWER[:3] + [55]  # said something else at its 4th token
    assert not mem.lookup(left, 4, MATCH_CAP, q, 4).same_question
    back = QUESTION + ANSWER[:2] + [55] + ANSWER[3:6]  # ... at its 3rd, then the same again: not yet 32 tokens alike
    assert not mem.lookup(back, 4, MATCH_CAP, q, 6).same_question
    outran = QUESTION + ANSWER + [77] * 12  # longer than the remembered answer: what follows is another entry's
    assert not mem.lookup(outran, 4, MATCH_CAP, q, len(ANSWER) + 12).same_question
    assert mem.lookup(QUESTION + ANSWER, 4, MATCH_CAP, q, len(ANSWER)) == Recall([])  # it ended there


def test_a_memory_smaller_than_an_answer_keeps_its_end_within_its_capacity_and_forgets_its_question():
    long_answer = list(range(2000, 2100))  # [100]
    mem = NgramMemory(64)
    mem.add(QUESTION + long_answer, len(QUESTION), question_key(QUESTION))
    assert len(mem) == 64  # the answer's last 63 tokens and a separator
    # what is left of it is found by its words, not as the same question's answer
    assert mem.lookup(QUESTION + long_answer[:80], 4, MATCH_CAP, question_key(QUESTION), 80) == Recall(long_answer[80:84], MATCH_CAP)
    tiny = NgramMemory(1)  # no room for a token beside the separator
    tiny.add(QUESTION + ANSWER, len(QUESTION), question_key(QUESTION))
    assert len(tiny) == 0


def test_a_context_that_only_extends_a_finished_request_is_not_taken_for_its_prompt_again():
    mem = NgramMemory(1000)
    prop = NgramProposer(2, 12, mem)
    prop.begin(QUESTION)
    prop.end(QUESTION + ANSWER)
    turn = QUESTION + ANSWER + [400, 401, 402]  # the chat's next turn, matched without begin()
    prop.match(turn, 4)
    prop.end(turn + [500, 501])
    q = question_key(QUESTION)
    assert mem.lookup(QUESTION, 4, MATCH_CAP, q, 0) == Recall(ANSWER[:4], MATCH_CAP, True)
    # the question's answer ended after ANSWER: what the next turn said is not part of it
    assert mem.lookup(QUESTION + ANSWER, 4, MATCH_CAP, q, len(ANSWER)) == Recall([400, 401, 402, 500], MATCH_CAP)


def test_the_proposer_marks_only_its_own_prompts_remembered_answer_as_a_repeat():
    mem = NgramMemory(1000)
    first = NgramProposer(2, 12, mem)
    first.begin(QUESTION)
    first.end(QUESTION + ANSWER)  # the answer left with its prompt's key
    again = NgramProposer(2, 12, mem)
    again.begin(QUESTION)
    m = again.match(QUESTION + ANSWER[:2], 4)
    assert (m.tokens, m.from_memory, m.repeat) == (ANSWER[2:6], True, True)
    assert again.evidence(m).repeat
    changed = [1, 2, 3] + QUESTION[3:]
    again.begin(changed)
    m = again.match(changed + ANSWER[:2], 4)
    assert (m.tokens, m.length, m.from_memory, m.repeat) == (ANSWER[2:6], MATCH_CAP, True, False)
    assert not again.evidence(m).repeat


PROMPT = [5, 9, 2, 7, 3, 8, 11, 4]  # [8] the prompt _generate answers


def _generate(mem: NgramMemory, params: SamplingParams, grammar=None, policy=None, st: GenerationStats | None = None) -> str:
    rt = FakeRuntime(vocab=64, seed=3)
    policy = policy or FixedPolicy(NgramProposer(2, 12, mem), 8)
    events = Engine(rt).generate(PROMPT, params, 30, (), policy, st or GenerationStats(), grammar)
    return "".join(ev.text for ev in events)


def _regex_grammar(regex: str = RUN) -> Grammar:
    return grammar_for(FakeRuntime(vocab=64, seed=3), llguidance.LLMatcher.grammar_from_regex(regex))


def test_a_sampled_answer_is_not_remembered_for_the_next_draw_says_something_else():
    mem = NgramMemory(4096)
    _generate(mem, SamplingParams(temperature=0.8, seed=1))
    assert len(mem) == 0
    _generate(mem, SamplingParams())
    assert len(mem) > 0


# Each kind of shaping a greedy answer can have: its sampling parameters and grammar (made afresh:
# a grammar's state follows its request).
SHAPED = {
    "none": (SamplingParams(), lambda: None),
    "grammar": (SamplingParams(), _regex_grammar),
    "another grammar": (SamplingParams(), lambda: _regex_grammar("[a-d]+")),  # another tool set
    "bias": (SamplingParams(logit_bias=((3, 5.0),)), lambda: None),
    "penalty": (SamplingParams(repetition_penalty=1.3), lambda: None),
}


def test_a_greedy_answer_is_the_same_question_again_only_under_the_same_shaping():
    for asked, (params, grammar) in SHAPED.items():
        mem = NgramMemory(4096)
        _generate(mem, params, grammar())
        assert len(mem) > 0, asked  # a grammar, a bias or a penalty shaped it: kept all the same
        for again, (params2, grammar2) in SHAPED.items():
            prop = NgramProposer(2, 12, mem)
            prop.begin(PROMPT, shaping(params2, grammar2()))
            m = prop.match(PROMPT, 4)
            assert m.repeat == (again == asked), (asked, again)  # the same prompt, shaped otherwise: another question


def test_a_tool_call_asked_again_with_its_grammar_drafts_the_remembered_call_and_says_the_same():
    mem = NgramMemory(4096)
    first = _generate(mem, SamplingParams(), _regex_grammar())
    st = GenerationStats()
    again = _generate(mem, SamplingParams(), _regex_grammar(), st=st)
    assert again == first
    # every token but the first and each step's bonus was drafted from the memory, and kept
    assert st.accepted == st.proposed == st.completion_tokens - 1 - st.steps
    assert shaping(SamplingParams(), None) == ()  # the target's own argmax: nothing else shapes it


def test_an_auto_request_leaves_its_answer_to_the_memory_every_slot_shares():
    mem = NgramMemory(4096)
    controller = Controller([NgramProposer(2, 12, mem)], ControllerConfig(), k_max=8)
    slot = {"ngram": NgramProposer(2, 12, mem)}  # another slot's instance, on the same memory
    _generate(mem, SamplingParams(), policy=controller.policy(slot))
    assert len(mem) > 0
    prop = NgramProposer(2, 12, mem)
    prop.begin(PROMPT)
    assert prop.match(PROMPT, 4).repeat


def test_every_slot_drafts_from_the_daemons_one_memory_and_the_bench_can_give_each_arm_its_own():
    from types import SimpleNamespace

    from homespec.config import Config
    from homespec.serving.host import Host

    models = SimpleNamespace(target=FakeRuntime(vocab=64, seed=3), draft=None, mtp_head=None)
    host = Host(Config(), models)  # type: ignore[arg-type]
    slot0, slot1 = host.controller.proposers["ngram"], host._proposers_of(1)["ngram"]
    assert host.ngram_memory is not None and slot0.memory is slot1.memory is host.ngram_memory
    arm = NgramMemory(2048)
    host.use_ngram_memory(arm)
    assert slot0.memory is slot1.memory is arm and host._proposers_of(2)["ngram"].memory is arm
    off = Host(Config(speculation={"ngram": {"memory_tokens": 0}}), models)  # type: ignore[arg-type]
    assert off.ngram_memory is None and off.controller.proposers["ngram"].memory is None


def test_the_same_question_draft_carries_each_remembered_tokens_argmax_gap():
    rt = FakeRuntime(vocab=64, seed=3)
    mem = NgramMemory(4096)
    prompt = [5, 9, 2, 7, 3, 8, 11, 4]
    list(Engine(rt).generate(prompt, SamplingParams(), 20, (), FixedPolicy(NgramProposer(2, 12, mem), 8)))
    recall = mem.lookup(prompt, 64, MATCH_CAP, question_key(prompt), 0)
    expected, ctx = [], list(prompt)
    for tok in recall.tokens:  # the row that chose each answer token: its lead over the runner-up
        top2 = np.sort(rt.logits_after(ctx))[-2:]
        expected.append(top2[1] - top2[0])
        ctx.append(tok)
    assert len(recall.tokens) == 20 and recall.same_question
    np.testing.assert_allclose(recall.gaps, expected, rtol=1e-6)
    # halfway through, the rest of the answer with the rest of its gaps
    assert np.array_equal(mem.lookup(ctx[:-12], 64, MATCH_CAP, question_key(prompt), 8).gaps, recall.gaps[8:])


def test_an_answer_read_off_shifted_rows_is_remembered_without_gaps():
    rt = FakeRuntime(vocab=64, seed=3)
    mem = NgramMemory(4096)
    prompt = [5, 9, 2, 7, 3, 8, 11, 4]
    params = SamplingParams(logit_bias=((1, 0.5),))  # a bias moves the gaps: the raw rows' are not the answer's
    list(Engine(rt).generate(prompt, params, 20, (), FixedPolicy(NgramProposer(2, 12, mem), 8)))
    recall = mem.lookup(prompt, 64, MATCH_CAP, question_key(prompt, shaping(params, None)), 0)
    assert len(recall.tokens) == 20 and recall.gaps.size == 0


def test_gaps_stay_with_their_answer_when_older_answers_are_forgotten():
    mem = NgramMemory(200)  # three entries of 61 tokens at most
    for i in range(6):
        q, a = list(range(1000 * i, 1000 * i + 50)), [100 * i + j for j in range(12)]
        mem.add(q + a, 50, question_key(q), np.arange(12, dtype=np.float32) + i)
    assert mem.lookup(q, 16, MATCH_CAP, question_key(q), 0).gaps.tolist() == list(range(5, 17))
    mem.add(QUESTION + ANSWER, len(QUESTION), question_key(QUESTION))  # no gaps given: none known
    recall = mem.lookup(QUESTION, 16, MATCH_CAP, question_key(QUESTION), 0)
    assert recall.tokens == ANSWER and recall.gaps.size == 0


def test_a_memory_dumped_and_loaded_in_another_drafts_the_same_question_again():
    """Kept across a restart (Host.persist_prefixes): the same answers, questions and gaps."""
    mem = NgramMemory(1000)
    mem.add([50, 51, 52, 53, 54, 60, 61], 5)
    key = question_key(QUESTION)
    mem.add(QUESTION + ANSWER, len(QUESTION), key, [0.5] * len(ANSWER))
    restarted = NgramMemory(1000)
    assert restarted.load(mem.dump()) == 2 and len(restarted) == len(mem)
    got = restarted.lookup(QUESTION + ANSWER[:3], 4, MATCH_CAP, key, answered=3)
    assert got.same_question and got.tokens == ANSWER[3:7] and got.gaps.tolist() == [0.5] * 4


def test_a_dump_larger_than_the_memory_keeps_its_newest_answers():
    mem = NgramMemory(1000)
    for i in range(6):
        mem.add([200 + i] * 20 + [300 + i] * 30, 20)
    small = NgramMemory(120)  # room for two entries of 51 tokens
    small.load(mem.dump())
    assert small.answers == 2 and small.lookup([205] * 20, 3, MATCH_CAP).tokens == [305] * 3


def test_a_question_key_is_the_same_in_another_process_grammar_and_all():
    """Python's hash of a string changes with every process; the key must not, or a remembered
    tool call is not the same question after a restart."""
    shaped = ((), (), 'root ::= "call"')
    script = ("from homespec.speculation.proposers.ngram_memory import question_key;"
              f"print(question_key({QUESTION!r}, {shaped!r}))")
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert int(other.stdout) == question_key(QUESTION, shaped)
