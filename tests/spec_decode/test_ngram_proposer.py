"""The ngram (prompt lookup) drafter against hand-worked sequences."""
from __future__ import annotations

import pytest

from pagellm.config import SpeculativeConfig
from pagellm.spec_decode.ngram_proposer import NgramProposer


def proposer(k: int = 3, lo: int = 1, hi: int = 3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi))


def test_longest_suffix_wins_and_latest_occurrence():
    # Suffix [2, 3] occurs at index 1 (followed by 9) and [1, 2, 3] at index 4 (followed by 7, 8).
    tokens = [0, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert proposer().draft(tokens)[0] == [7, 8, 5]
    # Only 1-grams allowed: the latest earlier 3 is at index 6, followed by 7, 8, 5.
    assert proposer(hi=1).draft(tokens)[0] == [7, 8, 5]


def test_draft_is_cut_at_k_max_tokens_and_sequence_end():
    tokens = [4, 5, 6, 4, 5]
    assert proposer(k=5).draft(tokens)[0] == [6, 4, 5]  # what follows [4, 5] up to the end
    assert proposer(k=5).draft(tokens, max_tokens=2)[0] == [6, 4]
    assert proposer().draft(tokens, max_tokens=0)[0] == []


def test_no_match_no_draft():
    assert proposer().draft([1, 2, 3, 4])[0] == []
    assert proposer(lo=2).draft([1, 2, 1])[0] == []  # the 1-gram [1] recurs, but 2-grams are required
    assert proposer().draft([7])[0] == []


@pytest.mark.parametrize("bad", [{"method": "eagle"}, {"num_speculative_tokens": 0},
                                 {"prompt_lookup_min": 3, "prompt_lookup_max": 2}, {"lookahead": 2}])
def test_config_refuses_bad_values(bad):
    with pytest.raises(ValueError, match="speculative_config"):
        SpeculativeConfig.from_dict(bad)


def test_draft_names_the_length_of_the_ngram_it_follows():
    tokens = [0, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert proposer().draft(tokens) == ([7, 8, 5], 3)
    assert proposer(hi=2).draft(tokens) == ([7, 8, 5], 2)
    assert proposer().draft([1, 2, 3, 4]) == ([], 0)
