"""Prompt-lookup edges found by mutation testing: contexts too short for any
n-gram, and n-grams shorter than min_ngram."""

import pytest

from speculators.prompt_lookup import PromptLookupSpeculator

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("context", [[], [5], [5, 5]])
def test_a_context_too_short_for_an_ngram_with_a_continuation_proposes_nothing(context):
    assert PromptLookupSpeculator().extend(context) is None


def test_an_ngram_shorter_than_min_ngram_is_not_matched():
    context = [1, 2, 3, 1]  # only the single token 1 recurs
    assert PromptLookupSpeculator(max_ngram=3, min_ngram=2).extend(context) is None
    assert PromptLookupSpeculator(max_ngram=3, min_ngram=1).extend(context) == 2
