"""Prompt lookup across requests: earlier answers as drafts for the same question again."""

from __future__ import annotations

import numpy as np

from homespec.speculation.engine import Engine, FixedPolicy, GenerationStats
from homespec.speculation.proposers.ngram import MATCH_CAP, Match, NgramProposer
from homespec.speculation.proposers.ngram_memory import TAIL, NgramMemory
from homespec.speculation.sampling import SamplingParams

from .fakes import FakeRuntime

QUESTION = list(range(100, 160))  # [60] a prompt
ANSWER = [7, 3, 9, 4, 8, 2, 6, 5, 1, 30, 31, 32]  # [12]


def test_a_repeated_question_gets_the_earlier_answer_as_a_draft_matched_to_the_cap():
    mem = NgramMemory(1000)
    mem.add(QUESTION + ANSWER, len(QUESTION))
    assert mem.lookup(QUESTION, 5, MATCH_CAP) == (ANSWER[:5], MATCH_CAP)
    # halfway through the answer it continues from there
    assert mem.lookup(QUESTION + ANSWER[:6], 16, MATCH_CAP) == (ANSWER[6:], MATCH_CAP)


def test_a_draft_stops_where_the_remembered_answer_ended_and_never_runs_into_the_next():
    mem = NgramMemory(1000)
    mem.add(QUESTION + ANSWER, len(QUESTION))
    mem.add([50, 51, 52, 53, 54] + [60, 61], 5)
    tokens, _ = mem.lookup(QUESTION + ANSWER[:-2], 16, MATCH_CAP)
    assert tokens == ANSWER[-2:]


def test_only_the_prompts_tail_is_kept_and_an_unanswered_generation_leaves_nothing():
    mem = NgramMemory(1000)
    mem.add(QUESTION, len(QUESTION))
    assert len(mem) == 0
    long_prompt = list(range(1000, 1300))  # [300]
    mem.add(long_prompt + ANSWER, len(long_prompt))
    assert len(mem) == TAIL + len(ANSWER) + 1  # and a separator
    assert mem.lookup(long_prompt, 3, MATCH_CAP) == (ANSWER[:3], MATCH_CAP)


def test_an_unrelated_context_finds_nothing_and_a_short_coincidence_reports_its_short_length():
    mem = NgramMemory(1000)
    mem.add(QUESTION + ANSWER, len(QUESTION))
    assert mem.lookup(list(range(500, 540)), 4, MATCH_CAP) == ([], 0)
    other = list(range(900, 940)) + ANSWER[:4]  # another question whose answer opens the same 4 tokens
    assert mem.lookup(other, 3, MATCH_CAP) == (ANSWER[4:7], 4)


def test_past_its_capacity_the_oldest_answers_go_and_the_newest_stay():
    mem = NgramMemory(400)
    prompts = [list(range(1000 * i, 1000 * i + 60)) for i in range(1, 11)]  # [60] each, distinct
    for i, p in enumerate(prompts):
        mem.add(p + [i] * 40, len(p))  # [48 tail + 40 answer] + separator each
        assert len(mem) <= 400
    assert mem.lookup(prompts[-1], 2, MATCH_CAP) == ([9, 9], MATCH_CAP)
    assert mem.lookup(prompts[0], 2, MATCH_CAP) == ([], 0)


def test_a_memory_of_no_capacity_remembers_nothing():
    mem = NgramMemory(0)
    mem.add(QUESTION + ANSWER, len(QUESTION))
    assert len(mem) == 0 and mem.lookup(QUESTION, 4, MATCH_CAP) == ([], 0)


def test_the_proposer_prefers_the_memory_only_where_it_matches_further_back_than_the_request_itself():
    mem = NgramMemory(1000)
    mem.add(QUESTION + ANSWER, len(QUESTION))
    prop = NgramProposer(2, 12, mem)
    prop.begin(QUESTION)
    m = prop.match(QUESTION, 4)
    assert (m.tokens, m.length, m.from_memory, m.from_prompt) == (ANSWER[:4], MATCH_CAP, True, False)
    evidence = prop.propose(QUESTION, 4, SamplingParams(), np.random.default_rng(0)).info.evidence
    assert evidence.from_memory and evidence.repeat  # all MATCH_CAP tokens led into it: the same question
    assert not prop.evidence(Match(ANSWER[:4], MATCH_CAP - 1, from_memory=True)).repeat
    # A prompt that quotes a passage twice copies it further back than a phrase an earlier
    # answer shares with it: the request's own text wins.
    mem.add([70, 71, 12, 1, 2, 3, 99], 2)
    quoting = [10, 11, 12, 1, 2, 3, 4, 5, 20, 10, 11, 12, 1, 2, 3]
    prop.begin(quoting)
    assert mem.lookup(quoting, 2, MATCH_CAP) == ([99], 4)
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
