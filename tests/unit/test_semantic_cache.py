"""The semantic cache's store (sokuji/core/semantic_cache.py): scope isolation, guards, LRU
by entries and bytes, the nearest similarity of every lookup."""

from __future__ import annotations

import numpy as np
import pytest

from sokuji.core.semantic_cache import SemanticCache, guard_ok, numbers, words
from sokuji.errors import ConfigError, RuntimeFailed

DIMS = 384
A = ("tenant-a", "gen", "1", "p0")
B = ("tenant-b", "gen", "1", "p0")


def unit(seed: int, dims: int = DIMS) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(dims).astype(np.float32)
    return v / np.linalg.norm(v)


def near(v: np.ndarray, cos: float, seed: int = 99) -> np.ndarray:
    """A unit vector at cosine ``cos`` from unit ``v``."""
    w = unit(seed, len(v))
    w -= (w @ v) * v
    w /= np.linalg.norm(w)
    return (cos * v + np.sqrt(1 - cos * cos) * w).astype(np.float32)


def test_other_tenant_never_hits_even_identical_text_and_vector() -> None:
    cache = SemanticCache(threshold=0.9)
    v = unit(1)
    cache.store(A, "what is the refund policy", v, "A's answer", 100)
    assert cache.lookup(B, "what is the refund policy", v) == (None, -1.0, "empty")
    cache.store(B, "how do I reset my password", unit(2), "B's answer", 100)
    hit, sim, result = cache.lookup(B, "what is the refund policy", v)
    assert hit is None and result == "miss"
    assert sim == pytest.approx(float(unit(2) @ v), abs=1e-5)  # B's own entry, never A's
    hit, sim, result = cache.lookup(A, "what is the refund policy", v)
    assert result == "hit" and hit is not None and hit.value == "A's answer"
    assert cache.scopes == 2


def test_params_hash_model_and_version_separate_entries() -> None:
    cache = SemanticCache(threshold=0.9)
    v = unit(3)
    cache.store(("t", "gen", "1", "temp0-max64"), "tell me a joke", v, "joke", 10)
    for scope in (("t", "gen", "1", "temp0-max128"), ("t", "gen", "2", "temp0-max64"),
                  ("t", "other", "1", "temp0-max64")):
        assert cache.lookup(scope, "tell me a joke", v)[2] == "empty"
    assert cache.lookup(("t", "gen", "1", "temp0-max64"), "tell me a joke", v)[2] == "hit"


def test_nearest_similarity_is_reported_for_every_lookup() -> None:
    cache = SemanticCache(threshold=0.95)
    stored = [unit(10 + i) for i in range(50)]
    for i, v in enumerate(stored):
        cache.store(A, f"text {i}", v, i, 8)
    matrix = np.stack(stored)
    for j in range(20):
        q = near(stored[j], 0.97, seed=200 + j) if j % 2 else unit(500 + j)
        hit, sim, result = cache.lookup(A, f"query {j}", q)
        assert sim == pytest.approx(float(np.max(matrix @ q)), abs=1e-5)
        assert result == ("hit" if sim >= 0.95 else "miss")
        if result == "hit":
            assert hit is not None and hit.value == j and hit.similarity == sim
            assert hit.text == f"text {j}"


def test_threshold_is_inclusive_and_vectors_are_normalised() -> None:
    cache = SemanticCache(threshold=0.9)
    v = unit(4)
    cache.store(A, "stored", 3.0 * v, "x", 1)  # not unit length: normalised on store
    _, sim, result = cache.lookup(A, "asked", near(v, 0.9001) * 5.0)
    assert result == "hit" and sim == pytest.approx(0.9001, abs=1e-5)
    assert cache.lookup(A, "asked", near(v, 0.8999))[2] == "miss"


def test_guards_refuse_reordered_words_and_other_numbers() -> None:
    v = unit(5)
    guarded = SemanticCache(threshold=0.5)
    plain = SemanticCache(threshold=0.5, guards=False)
    for cache in (guarded, plain):
        cache.store(A, "flights from London to Paris tomorrow", v, "LON-PAR", 10)
        cache.store(B, "set a timer for 5 minutes", v, "5 min", 10)
    # identical vectors: only the guards can tell these apart
    assert guarded.lookup(A, "flights from Paris to London tomorrow", v)[2] == "guarded"
    assert plain.lookup(A, "flights from Paris to London tomorrow", v)[2] == "hit"
    assert guarded.lookup(B, "set a timer for 15 minutes", v)[2] == "guarded"
    assert guarded.lookup(B, "set a timer for fifteen minutes", v)[2] == "guarded"
    assert guarded.lookup(B, "set a timer for five minutes", v)[2] == "hit"
    assert guarded.lookup(B, "please set a 5 minute timer", v)[2] == "hit"
    hit, _, result = guarded.lookup(A, "Flights from London to Paris tomorrow?", v)
    assert result == "hit" and hit is not None and hit.value == "LON-PAR"


def test_guard_ok_rules() -> None:
    assert not guard_ok("convert 10 miles to kilometers", "convert 10 kilometers to miles")
    assert not guard_ok("what is 4 divided by 20", "what is 20 divided by 4")  # numbers reorder
    assert not guard_ok("is Rust safer than C++", "is C++ safer than Rust")
    assert guard_ok("how do I change my password", "how do I update my password")
    assert guard_ok("set an alarm for 7 am", "set an alarm for seven in the morning")
    assert guard_ok("send 1,000 dollars", "send 1000 dollars")
    assert guard_ok("same words same order", "Same words, same order!")
    assert not guard_ok("what's new in Python 3.10", "what's new in Python 3.1")
    assert not guard_ok("how do I get to gate B12", "how do I get to gate B21")
    assert not guard_ok("book a table for two", "book a table")
    assert guard_ok("someone at the door", "somebody at the door")  # no number inside words
    assert numbers("twenty-one, 07 and 3.50 or 12,500.5") == ["20", "1", "7", "3.50", "12500.5"]
    assert words("Don't STOP_me now") == ["don", "t", "stop", "me", "now"]


def test_lru_by_entries_keeps_recently_hit() -> None:
    cache = SemanticCache(threshold=0.99, max_entries=3)
    vs = [unit(20 + i) for i in range(4)]
    for i in range(3):
        cache.store(A if i % 2 else B, f"t{i}", vs[i], i, 1)
    assert cache.lookup(B, "t0", vs[0])[2] == "hit"  # t0 is now the most recent
    cache.store(A, "t3", vs[3], 3, 1)  # evicts t1, the least recently used
    assert len(cache) == 3
    assert cache.lookup(A, "t1", vs[1])[2] == "miss"
    assert [cache.lookup(s, t, v)[2] for s, t, v in
            ((B, "t0", vs[0]), (B, "t2", vs[2]), (A, "t3", vs[3]))] == ["hit"] * 3


def test_lru_by_bytes_and_oversized_entries() -> None:
    per = 4 * DIMS + 2  # vector + a two-byte text
    limit = 3 * (per + 1000) + 500
    cache = SemanticCache(threshold=0.99, max_bytes=limit)
    for i in range(3):
        cache.store(A, f"t{i}", unit(30 + i), i, 1000)
    assert cache.nbytes == 3 * (per + 1000) and len(cache) == 3
    cache.store(A, "t3", unit(33), 3, 1500)  # over by one entry and some: t0 goes
    assert len(cache) == 3 and cache.nbytes == 2 * (per + 1000) + per + 1500
    assert cache.lookup(A, "t0", unit(30))[2] == "miss"
    cache.store(A, "big", unit(34), "x", 10**9)  # larger than the whole cache: not stored
    assert len(cache) == 3 and cache.lookup(A, "big", unit(34))[2] == "miss"
    cache.store(B, "huge", unit(35), "y", limit - 4 * DIMS - 4)  # fills it alone
    assert len(cache) == 1 and cache.scopes == 1
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_same_text_replaces_its_entry() -> None:
    cache = SemanticCache(threshold=0.99)
    cache.store(A, "q", unit(40), "old", 100)
    cache.store(A, "q", unit(41), "new", 50)
    assert len(cache) == 1 and cache.nbytes == 50 + 4 * DIMS + 1
    assert cache.lookup(A, "q", unit(40))[2] == "miss"
    hit, _, _ = cache.lookup(A, "q", unit(41))
    assert hit is not None and hit.value == "new"


def test_rows_stay_consistent_through_evictions() -> None:
    """Swap-removal moves rows around: every surviving entry is still found by its own
    vector, with its own value; emptied scopes are dropped."""
    cache = SemanticCache(threshold=0.999, max_entries=40)
    scopes: list[tuple[str, ...]] = [("t", "m", "1", str(k)) for k in range(3)]
    rng = np.random.default_rng(0)
    alive: dict[tuple[tuple[str, ...], str], int] = {}
    for i in range(300):
        scope = scopes[int(rng.integers(3))]
        cache.store(scope, f"x{i}", unit(1000 + i), i, 1)
        alive[(scope, f"x{i}")] = i
        if i % 7 == 0 and alive:  # touch a random survivor
            s, t = list(alive)[int(rng.integers(len(alive)))]
            cache.lookup(s, t, unit(1000 + alive[(s, t)]))
    survivors = 0
    for (scope, text), i in alive.items():
        hit, sim, result = cache.lookup(scope, text, unit(1000 + i))
        if result == "hit":
            survivors += 1
            assert hit is not None and hit.value == i and hit.text == text
            assert sim == pytest.approx(1.0, abs=1e-5)
    assert survivors == len(cache) == 40


def test_bad_vectors_and_settings_are_refused() -> None:
    cache = SemanticCache(threshold=0.9)
    cache.store(A, "q", unit(50), "x", 1)
    with pytest.raises(RuntimeFailed):
        cache.lookup(A, "q", unit(50, dims=768))
    with pytest.raises(RuntimeFailed):
        cache.store(A, "r", np.zeros(DIMS, np.float32), "x", 1)
    with pytest.raises(RuntimeFailed):
        cache.store(B, "r", np.full(DIMS, np.nan, np.float32), "x", 1)
    for bad in (1.5, float("nan"), -2.0):
        with pytest.raises(ConfigError):
            SemanticCache(threshold=bad)
    with pytest.raises(ConfigError):
        SemanticCache(threshold=0.9, max_entries=0)


def test_ten_thousand_entries_one_product_per_lookup() -> None:
    """At 10k 384-d entries the answer equals a brute-force search (the lookup's speed is
    measured by the benchmark, not asserted here)."""
    cache = SemanticCache(threshold=0.9, guards=False, max_entries=10_000)
    rng = np.random.default_rng(1)
    m = rng.standard_normal((10_000, DIMS)).astype(np.float32)
    m /= np.linalg.norm(m, axis=1, keepdims=True)
    for i in range(10_000):
        cache.store(A, f"e{i}", m[i], i, 0)
    assert len(cache) == 10_000
    for j in (0, 4321, 9999):
        q = near(m[j], 0.95, seed=j)
        hit, _, result = cache.lookup(A, "q", q)
        assert result == "hit" and hit is not None and hit.value == int(np.argmax(m @ q))


def test_one_tenant_cannot_flush_the_others() -> None:
    """Past its share of the entries, a tenant evicts its own oldest entries, not others'."""
    import numpy as np

    from sokuji.core.semantic_cache import SemanticCache

    cache = SemanticCache(0.9, max_entries=8, tenant_share=0.5)
    rng = np.random.default_rng(0)
    a = ("a", "m", "1", "")
    b = ("b", "m", "1", "")
    kept = rng.normal(size=8)
    cache.store(a, "a's question", kept, "a's answer", 8)
    for i in range(20):  # tenant b floods
        cache.store(b, f"b question {i}", rng.normal(size=8), "x", 8)
    hit, _, result = cache.lookup(a, "a's question", kept)
    assert result == "hit" and hit is not None and hit.value == "a's answer"
    assert len(cache) == 1 + 4  # b holds its share (4 of 8), a keeps its one
