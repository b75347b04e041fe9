"""The prefix cache's decisions (orchestrator.decoding.prefix_cache): which entry a prompt copies, which entry a
finished request goes to, what goes when space runs out (pure)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.decoding import prefix_cache
from orchestrator.decoding.prefix_cache import PREFIX_BLOCK, PrefixCache, PrefixHit, common_prefix

B = PREFIX_BLOCK


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def test_the_longest_shared_prefix_is_found_to_the_token_not_to_the_block():
    cache = PrefixCache([10, 11], budget_tokens=1000)
    assert cache.store(tokens(0, 3 * B)) == 10
    assert cache.store(tokens(0, B) + tokens(500, 2 * B)) == 11
    assert cache.lookup(tokens(0, 2 * B + 5) + [9999]) == PrefixHit(10, 2 * B + 5)
    assert cache.lookup(tokens(0, B) + tokens(500, B + 3)) == PrefixHit(11, 2 * B + 3)
    assert cache.lookup(tokens(0, B - 1)) is None  # under a block: a copy is not worth it
    assert cache.lookup([7] + tokens(1, 3 * B)) is None


def test_a_finished_turn_replaces_the_entry_it_extends_and_a_shorter_one_is_not_kept_twice():
    cache = PrefixCache([10, 11], budget_tokens=1000)
    first_turn = tokens(0, 2 * B)
    assert cache.store(first_turn) == 10
    assert cache.store(first_turn + tokens(900, B)) == 10  # the conversation grew: same entry
    assert cache.tokens == 3 * B
    assert cache.store(first_turn) is None  # already held inside the longer one
    assert cache.store(tokens(0, B - 1)) is None  # too short


def test_the_least_recently_used_entry_goes_first_within_the_sequences_and_the_budget():
    cache = PrefixCache([10, 11], budget_tokens=5 * B)
    a, b, c = tokens(0, 2 * B), tokens(1000, 2 * B), tokens(2000, 2 * B)
    assert (cache.store(a), cache.store(b)) == (10, 11)
    assert cache.lookup(a + [1]) == PrefixHit(10, 2 * B)  # a is used: b is now the least recent
    assert cache.store(c) == 11
    assert cache.lookup(b) is None and cache.lookup(a)
    assert cache.store(tokens(3000, 4 * B)) is not None  # over the budget with a and c: both go
    assert cache.tokens == 4 * B and cache.lookup(a) is None
    assert cache.store(tokens(0, 6 * B)) is None  # more than the whole budget


def test_a_hash_collision_cannot_reuse_a_wrong_token(monkeypatch):
    """Every block hashes alike: the hash proposes, the tokens decide."""
    monkeypatch.setattr(prefix_cache, "block_hashes", lambda found: [0] * (len(found) // B))
    cache = PrefixCache([10], budget_tokens=1000)
    cache.store(tokens(0, 2 * B))
    assert cache.lookup(tokens(100, 2 * B)) is None
    assert cache.lookup(tokens(0, B + 4) + [1]) == PrefixHit(10, B + 4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=70), min_size=1, max_size=8),
       st.lists(st.integers(0, 3), min_size=0, max_size=70))
def test_a_lookup_finds_the_longest_common_prefix_of_any_entry_held(stored, prompt):
    cache = PrefixCache(list(range(20)), budget_tokens=10**6)
    for entry in stored:
        cache.store(entry)
    held = list(cache._entries.values())
    best = max((common_prefix(entry, prompt) for entry in held), default=0)
    hit = cache.lookup(prompt)
    if best < B:
        assert hit is None
    else:
        assert hit.length == best and common_prefix(cache._entries[hit.sequence], prompt) == best


def test_a_cache_without_room_is_a_mistake():
    with pytest.raises(ValueError):
        PrefixCache([], budget_tokens=1000)
