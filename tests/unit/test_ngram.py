"""Prompt-lookup proposer."""

from __future__ import annotations

import numpy as np

from homespec.proposers.ngram import NgramIndex, NgramProposer
from homespec.sampling import SamplingParams


def test_proposes_what_followed_the_earlier_occurrence_of_the_suffix():
    idx = NgramIndex(2, 4)
    idx.sync([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert idx.lookup(3) == ([4, 5, 9], 3)


def test_longest_matching_suffix_wins_over_a_shorter_one():
    idx = NgramIndex(1, 3)
    # "2 3" occurs twice; the 3-gram "1 2 3" only once, followed by 7.
    idx.sync([1, 2, 3, 7, 0, 2, 3, 8, 5, 1, 2, 3])
    assert idx.lookup(1) == ([7], 3)


def test_most_recent_occurrence_is_used_for_equal_length_matches():
    idx = NgramIndex(2, 2)
    idx.sync([4, 5, 1, 9, 4, 5, 2, 9, 4, 5])
    assert idx.lookup(1) == ([2], 2)


def test_no_match_proposes_nothing():
    idx = NgramIndex(2, 3)
    idx.sync([1, 2, 3, 4, 5])
    assert idx.lookup(4) == ([], 0)


def test_proposal_is_cut_at_the_end_of_the_context():
    idx = NgramIndex(2, 2)
    idx.sync([7, 8, 9, 7, 8])
    assert idx.lookup(5) == ([9, 7, 8], 2)


def test_growing_context_extends_index_and_changed_context_rebuilds_it():
    idx = NgramIndex(2, 2)
    idx.sync([1, 2, 3])
    idx.sync([1, 2, 3, 1, 2])  # extension
    assert idx.lookup(1) == ([3], 2)
    idx.sync([5, 6, 7, 5, 6])  # a different request
    assert idx.lookup(1) == ([7], 2)
    assert idx.tokens == [5, 6, 7, 5, 6]


def test_proposer_reports_point_mass_and_match_length():
    prop = NgramProposer(2, 3)
    prop.begin([1, 2, 3, 4])
    p = prop.propose([1, 2, 3, 4, 1, 2], 2, SamplingParams(), np.random.default_rng(0))
    assert p.tokens == [3, 4] and p.q is None and p.info["match_len"] == 2
