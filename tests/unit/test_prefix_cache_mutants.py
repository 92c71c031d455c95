"""``llm/prefix_cache.py`` at its boundaries: what is reused, from which stored prompt, and
the counters ``/metrics`` reports. Each test names the mutmut mutants of ``PrefixCache`` it
kills (docs/mutation.md; numbers as at the commit recorded there). A wrong answer here is
silent: a sequence decoded on another prompt's state, or a state never reused."""

from __future__ import annotations

from sokuji.llm.prefix_cache import PrefixCache

T = "tenant-a"


def test_every_miss_is_counted_once_and_a_miss_reuses_nothing() -> None:
    """Kills ``lookup`` 9, 10, 11 and 40 (a miss counted as 1, -1 or 2) and 43, 46 (a miss
    reporting ``None`` or 1 reused token)."""
    cache = PrefixCache(max_bytes=100, min_tokens=2)
    for _ in range(3):  # nothing stored for the tenant: the first branch
        m = cache.lookup([1, 2, 3, 4], T)
        assert (m.tokens, m.state) == (0, None)
    cache.store([9, 9, 9], T, b"s")
    for _ in range(2):  # something stored, nothing shared: the second branch
        m = cache.lookup([1, 2, 3, 4], T)
        assert (m.tokens, m.state) == (0, None)
    assert (cache.hits, cache.misses) == (0, 5)


def test_a_cache_of_zero_bytes_reuses_nothing_even_an_empty_state() -> None:
    """Kills ``lookup`` 4 and 5 (``max_bytes = 0`` no longer off: an empty state fits)."""
    cache = PrefixCache(max_bytes=0, min_tokens=1)
    cache.store([1, 2, 3], T, b"")
    assert cache.lookup([1, 2, 3, 4], T).state is None
    assert not cache.wants([1, 2, 3, 4], T)


def test_a_one_byte_cache_holds_a_one_byte_state() -> None:
    """Kills ``lookup`` 6 and ``wants`` 3 (``max_bytes <= 1`` taken as off) and ``store`` 1
    (a state of exactly ``max_bytes`` refused)."""
    cache = PrefixCache(max_bytes=1, min_tokens=1)
    assert cache.wants([1, 2, 3], T)
    cache.store([1, 2, 3], T, b"x")
    assert cache.lookup([1, 2, 3, 4], T).state == b"x"


def test_a_shared_prefix_of_exactly_min_tokens_is_reused_and_one_less_is_not() -> None:
    """Kills ``lookup`` 37 (a too-short match reused) and 39 (one of exactly
    ``min_tokens`` refused)."""
    cache = PrefixCache(max_bytes=100, min_tokens=3)
    cache.store([1, 2, 3, 9, 9], T, b"s")
    assert cache.lookup([1, 2, 3, 7, 7], T).tokens == 3
    assert cache.lookup([1, 2, 7, 7, 7], T).state is None


def test_one_shared_token_is_a_match_when_min_tokens_is_one() -> None:
    """Kills ``lookup`` 22 (the best match starting at 1, so a 1-token match is never
    taken)."""
    cache = PrefixCache(max_bytes=100, min_tokens=1)
    cache.store([5, 7, 7], T, b"s")
    m = cache.lookup([5, 9, 9], T)
    assert (m.tokens, m.state) == (1, b"s")


def test_wants_a_prompt_of_exactly_min_tokens_and_one_beside_a_longer_unrelated() -> None:
    """Kills ``wants`` 4 (a prompt of ``min_tokens`` not wanted) and 13 (any longer stored
    prompt taken as covering it, related or not)."""
    cache = PrefixCache(max_bytes=100, min_tokens=3)
    assert cache.wants([1, 2, 3], T)
    cache.store([9, 9, 9, 9, 9], T, b"s")
    assert cache.wants([1, 2, 3, 4], T)
    assert not cache.wants([9, 9, 9, 9], T)  # covered by the stored one


def test_storing_the_same_prompt_again_replaces_it() -> None:
    """Kills ``store`` 16 (the same prompt not dropped first: its bytes counted twice)."""
    cache = PrefixCache(max_bytes=100, min_tokens=1)
    cache.store([1, 2, 3], T, b"abcd")
    cache.store([1, 2, 3], T, b"wxyz")
    assert (len(cache), cache.bytes) == (1, 4)
    assert cache.lookup([1, 2, 3, 4], T).state == b"wxyz"


def test_every_eviction_is_counted() -> None:
    """Kills ``store`` 36 (evictions set to 1 rather than counted)."""
    cache = PrefixCache(max_bytes=4, min_tokens=1)
    for i in range(4):
        cache.store([i, i], T, b"abcd")
    assert cache.evictions == 3 and len(cache) == 1
