"""The n-gram proposer copies what followed the latest, longest earlier match."""

from __future__ import annotations

import pytest

from tandem.engine.spec.ngram import NgramProposer


def test_copies_the_continuation_of_the_longest_match() -> None:
    proposer = NgramProposer(3, min_n=1, max_n=3)
    #         0  1  2  3  4  5  6  7  8  9  10
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 2, 3]
    # The last 3 tokens (7, 2, 3) never occurred before; (2, 3) did, at 1 and, latest, at 6.
    assert proposer.lookup(tokens) == [7, 2, 3]


def test_prefers_longer_ngrams_over_recency() -> None:
    proposer = NgramProposer(2, min_n=1, max_n=3)
    tokens = [5, 1, 2, 8, 8, 0, 2, 6, 6, 5, 1, 2]
    # (5, 1, 2) matches at 0 -> [8, 8]; the more recent (2,) match at 6 would give [6, 6].
    assert proposer.lookup(tokens) == [8, 8]


def test_drafts_stop_at_the_end_of_the_known_tokens() -> None:
    proposer = NgramProposer(5, min_n=2, max_n=2)
    assert proposer.lookup([4, 5, 6, 4, 5]) == [6, 4, 5]


def test_no_match_no_draft() -> None:
    proposer = NgramProposer(4, min_n=2, max_n=4)
    assert proposer.lookup([1, 2, 3, 4]) == []
    assert proposer.lookup([7]) == []
    assert proposer.lookup([]) == []


def test_k_per_call() -> None:
    proposer = NgramProposer(4)
    assert proposer.lookup([1, 2, 3, 1], k=1) == [2]


@pytest.mark.parametrize(
    ("args", "field"),
    [((0,), "num_speculative_tokens"), ((3, 0, 2), "min_n"), ((3, 3, 2), "min_n")],
)
def test_bad_config_names_the_field(args: tuple[int, ...], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        NgramProposer(*args)
