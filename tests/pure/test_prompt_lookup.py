"""Prompt lookup (speculators.prompt_lookup): the draft token is what followed the longest recent n-gram."""

import pytest

from speculators.prompt_lookup import PromptLookupSpeculator


def test_prompt_lookup_copies_what_followed_the_longest_recent_match():
    speculator = PromptLookupSpeculator(max_ngram=3)
    text = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    assert speculator.extend(text) == 4  # "1 2 3" (longest) was followed by 4
    assert PromptLookupSpeculator(max_ngram=2).extend(text) == 7  # "2 3" most recently by 7
    assert PromptLookupSpeculator(max_ngram=3).extend(text[:-1]) == 3  # "1 2" -> 3
    assert speculator.extend([5, 6, 7]) is None
    assert speculator.extend([1, 2, 3, 9, 9, 1, 2, 3]) == 9


# -- contexts too short for any n-gram, and n-grams shorter than min_ngram

@pytest.mark.parametrize("context", [[], [5], [5, 5]])
def test_a_context_too_short_for_an_ngram_with_a_continuation_proposes_nothing(context):
    assert PromptLookupSpeculator().extend(context) is None


def test_an_ngram_shorter_than_min_ngram_is_not_matched():
    context = [1, 2, 3, 1]  # only the single token 1 recurs
    assert PromptLookupSpeculator(max_ngram=3, min_ngram=2).extend(context) is None
    assert PromptLookupSpeculator(max_ngram=3, min_ngram=1).extend(context) == 2
