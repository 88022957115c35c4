"""Prompt-lookup proposer."""

from __future__ import annotations

import numpy as np

from homespec.speculation.proposers.ngram import COPY_MATCH, MATCH_CAP, RESUME_WINDOW, NgramIndex, NgramProposer
from homespec.speculation.sampling import SamplingParams


def _got(m):
    return m.tokens, m.length


def test_proposes_what_followed_the_earlier_occurrence_of_the_suffix():
    idx = NgramIndex(2, 4)
    idx.sync([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert _got(idx.lookup(3)) == ([4, 5, 9], 3)


def test_longest_matching_suffix_wins_over_a_shorter_one():
    idx = NgramIndex(1, 3)
    # "2 3" occurs twice; the 3-gram "1 2 3" only once, followed by 7.
    idx.sync([1, 2, 3, 7, 0, 2, 3, 8, 5, 1, 2, 3])
    assert _got(idx.lookup(1)) == ([7], 3)


def test_most_recent_occurrence_is_used_for_equal_length_matches():
    idx = NgramIndex(2, 2)
    idx.sync([4, 5, 1, 9, 4, 5, 2, 9, 4, 5])
    assert _got(idx.lookup(1)) == ([2], 3)  # "9 4 5": the 2-gram found, then one more token back


def test_no_match_proposes_nothing():
    idx = NgramIndex(2, 3)
    idx.sync([1, 2, 3, 4, 5])
    assert _got(idx.lookup(4)) == ([], 0)


def test_proposal_is_cut_at_the_end_of_the_context():
    idx = NgramIndex(2, 2)
    idx.sync([7, 8, 9, 7, 8])
    assert _got(idx.lookup(5)) == ([9, 7, 8], 2)


def test_growing_context_extends_index_and_changed_context_rebuilds_it():
    idx = NgramIndex(2, 2)
    idx.sync([1, 2, 3])
    idx.sync([1, 2, 3, 1, 2])  # extension
    assert _got(idx.lookup(1)) == ([3], 2)
    idx.sync([5, 6, 7, 5, 6])  # a different request
    assert _got(idx.lookup(1)) == ([7], 2)
    assert idx.tokens == [5, 6, 7, 5, 6]


def test_proposer_reports_point_mass_and_match_length():
    prop = NgramProposer(2, 3)
    prop.begin([1, 2, 3, 4])
    p = prop.propose([1, 2, 3, 4, 1, 2], 2, SamplingParams(), np.random.default_rng(0))
    assert p.tokens == [3, 4] and p.q is None and p.info.evidence.match == 2


def test_match_length_counts_back_past_n_max_up_to_the_cap():
    idx = NgramIndex(2, 3)
    run = list(range(100, 110))  # 10 distinct tokens, repeated: the suffix matches 10 back
    idx.sync([1, *run, 7, 2, *run])
    assert _got(idx.lookup(1)) == ([7], 10)
    long = list(range(200, 260))
    idx.sync([*long, 9, *long])
    assert _got(idx.lookup(1)) == ([9], MATCH_CAP)


def test_a_match_says_whether_it_copies_the_prompt_or_repeats_the_answer():
    prop = NgramProposer(2, 4)
    prompt = [1, 2, 3, 4, 5]
    prop.begin(prompt)
    copy = prop.match([*prompt, 1, 2], 2)  # "1 2" occurs in the prompt: copying it
    assert copy.tokens == [3, 4] and copy.from_prompt
    ctx = [*prompt, 8, 9, 6, 8, 9]  # "8 9" last occurred in the answer: a repeat
    prop.begin(prompt)  # a new request
    repeat = prop.match(ctx, 2)
    assert repeat.tokens == [6, 8] and not repeat.from_prompt
    assert prop.propose(ctx, 2, SamplingParams(), np.random.default_rng(0)).info.evidence.from_prompt is False


def test_a_short_match_just_past_where_the_answers_copy_of_the_prompt_broke_off_resumes_it():
    prompt = list(range(100, 100 + RESUME_WINDOW + 60))  # distinct tokens: every match is where it says
    prop = NgramProposer(2, 12)
    copied = [*prompt, *prompt[20:32]]  # the answer copies 12 tokens of the prompt (an edit)
    changed = [*copied, *prompt[32:40], 1, 2, 3]  # copies 8 more (a draft kept), breaks off at prompt[40]

    def after_the_copy(tail: list[int]):
        prop.begin(prompt)
        assert prop.match(copied, 4).length >= 8  # a copy under way
        return prop.match([*changed, *tail], 4)

    resumed = after_the_copy(prompt[43:45])  # ... and goes on from prompt[43]
    assert resumed.tokens == prompt[45:49] and resumed.length == 2 and resumed.from_prompt and resumed.resumes
    ev = prop.propose([*changed, *prompt[43:45]], 4, SamplingParams(), np.random.default_rng(0)).info.evidence
    assert ev.resumes and ev.match == 2
    near = 40 + RESUME_WINDOW - 4  # the window counts from the break, not from the last long match
    assert after_the_copy(prompt[near - 2 : near]).resumes
    # a short match behind the break, or further on than RESUME_WINDOW, is no resumption
    behind = after_the_copy(prompt[3:5])
    assert behind.tokens == prompt[5:9] and behind.from_prompt and not behind.resumes
    far = 40 + RESUME_WINDOW + 5
    ahead = after_the_copy(prompt[far : far + 2])
    assert ahead.tokens == prompt[far + 2 : far + 6] and ahead.from_prompt and not ahead.resumes
    # nor in an answer that has not been copying: the same 2 tokens in a new request
    prop.begin(prompt)
    fresh = prop.match([*prompt, 1, 2, 3, *prompt[43:45]], 4)
    assert fresh.tokens == prompt[45:49] and fresh.from_prompt and not fresh.resumes


def test_an_edit_resumes_its_copy_one_token_after_words_it_inserted_even_mid_token_of_the_prompt():
    # "def f(a):\n    return a" edited to "def f(a: int) -> int:\n    return a", where the prompt's
    # "):\n" is one token (30) and the answer writes ")" (31) and ":\n" (32) apart
    text = {30: b"):\n", 31: b")", 32: b":\n", 33: b"    return", 34: b" a", 40: b": int", 41: b" ->", 42: b" int"}
    filler = list(range(100, 112))  # the function's file before it: a copy of COPY_MATCH tokens and more
    prompt = [*filler, 30, 33, 34, 7, 8, 9]
    edited = [*prompt, *filler, 40, 31, 41, 42]  # copies the filler, then inserts the hints
    for piece, after_colon in ((lambda t: text.get(t, b"<%d>" % t), [33, 34, 7, 8]), (None, [])):
        prop = NgramProposer(2, 12, piece=piece)
        prop.begin(prompt)
        assert prop.match(prompt + filler, 4).length >= COPY_MATCH  # a copy under way
        assert prop.match(edited, 4).tokens == []  # inside the insertion: nothing resumes
        resumed = prop.match([*edited, 32], 4)  # ":\n" ends as the prompt's "):\n" does
        assert resumed.tokens == after_colon
        if piece:
            assert resumed.from_prompt and resumed.resumes and resumed.length == 1
            assert prop.evidence(resumed).match == 1  # learned apart from 2-token resumptions
    # by id alone, the answer's token itself in the prompt past the break resumes
    prop = NgramProposer(2, 12)
    prop.begin(prompt)
    prop.match(prompt + filler, 4)
    assert prop.match([*edited, 30], 4).tokens == [33, 34, 7, 8]
    # no copy under way (a new request), or a token only before the break: nothing
    prop.begin(prompt)
    assert prop.match([*prompt, 40, 31, 41, 42, 30], 4).tokens == []
    prop.begin(prompt)
    prop.match(prompt + filler, 4)
    assert prop.match([*edited, filler[0]], 4).tokens == []


def _answer(prop: NgramProposer, prompt: list[int], answer: list[int], k: int):
    """Prompt lookup's match after `answer`, asked at every token of it, as the engine asks."""
    prop.begin(prompt)
    for i in range(len(answer)):
        prop.match([*prompt, *answer[:i]], k)
    return prop.match([*prompt, *answer], k)


def test_a_copy_stops_before_a_token_where_the_answers_copy_broke_off_more_often_than_it_went_on():
    # Three blocks, each followed by token 50: the edit changes the answer at every 50 (a
    # signature's "):\n"), so a draft past the next 50 would be thrown away.
    prompt = [*range(100, 110), 50, *range(110, 120), 50, *range(120, 130), 50, 1, 2, 3]
    edited = [*prompt[0:10], 7, 8, *prompt[11:21], 7, 8, *prompt[22:30]]
    m = _answer(NgramProposer(2, 12), prompt, edited, 6)
    assert m.from_prompt and m.tokens == [128, 129]  # broke at 50 twice, went on past it never
    # Where it broke at 50 once and went on past it once (a docstring after one signature, not
    # after another), the copy runs on through it.
    once = [*prompt[0:21], 7, 8, *prompt[22:30]]
    assert _answer(NgramProposer(2, 12), prompt, once, 6).tokens == [128, 129, 50, 1, 2, 3]
    # A copy is never cut to nothing: a proposal that starts with such a token keeps it.
    assert _answer(NgramProposer(2, 12), prompt, [*edited, 128, 129], 4).tokens[0] == 50


def test_a_new_request_without_begin_takes_its_context_as_the_prompt():
    prop = NgramProposer(2, 2)
    prop.begin([1, 2, 3])
    m = prop.match([5, 6, 7, 5, 6], 1)  # not an extension of [1, 2, 3]: a new request
    assert m.tokens == [7] and m.from_prompt


def test_lookup_after_guesses_matches_as_if_they_followed_without_indexing_them():
    idx = NgramIndex(2, 3)
    idx.sync([1, 2, 3, 4, 5, 6, 7, 2])
    assert _got(idx.lookup(2, after=[3, 4])) == ([5, 6], 3)  # "2 3 4": the guesses and one token back
    assert _got(idx.lookup(2, after=[4, 8])) == ([], 0)
    assert idx.tokens == [1, 2, 3, 4, 5, 6, 7, 2]  # the guesses were not indexed


# A file in the prompt; the answer changes its first token, then copies it.
FILE = list(range(100, 140))
EDIT_PROMPT = [1, 2, *FILE, 3]


def test_copy_goes_on_as_the_prompt_once_the_guesses_copy_it_copy_match_tokens_back():
    prop = NgramProposer(2, 5)
    prop.begin(EDIT_PROMPT)
    context = [*EDIT_PROMPT, 99]  # the answer so far: the change (99 for FILE[0])
    short = FILE[1:COPY_MATCH]  # guesses copying the prompt COPY_MATCH - 1 tokens back
    assert prop.copy(context, short, 5) == []
    assert prop.copy(context, [*short, FILE[COPY_MATCH]], 5) == FILE[COPY_MATCH + 1 : COPY_MATCH + 6]
    assert prop.index.tokens == context


def test_copy_takes_nothing_from_the_answer_only_from_the_prompt():
    prop = NgramProposer(2, 5)
    prop.begin([1, 2, 3])
    answer = list(range(200, 220))
    context = [1, 2, 3, *answer, 7]  # the answer says again what it said before
    assert prop.copy(context, answer[:COPY_MATCH], 5) == []
