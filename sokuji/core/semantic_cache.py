"""Semantic cache: answers to requests asked before in other words, found by the cosine
similarity of their embeddings.

It sits after the exact cache (``core/cache.py``): an exact miss is embedded, its nearest
stored neighbour is looked up **within its scope only** and is a hit when the similarity
reaches ``threshold`` and the cheap guards (``guard_ok``) pass. A scope is (tenant, model,
version, a hash of the output-changing parameters). Each scope has its own matrix of unit
vectors, never a shared index with a filter: another tenant's entries are not even searched,
so neither their answers nor their existence can leak (the side channel the prefix cache
closes). A lookup costs one matrix-vector product over its scope's rows (exact cosine;
measured on one core of the busy 2-core dev machine: p50 0.3-0.8 ms at 10,000 384-d entries,
a 15 MB scan, the same as the bare numpy product; 30 us at 1,000).

Why guards: mean-pooled sentence embeddings are nearly order-invariant and barely move for a
negation, so "flights from London to Paris" and "... Paris to London" score ~0.997 and no
global threshold separates them (docs/research/issue15-routing.md §6). Two principled
guards refuse such hits: the same multiset of words in another order, and a different
sequence of numbers. Both can only turn a hit into a miss: they never make a wrong answer.

Bounded by entries and by bytes, least recently used first, across all scopes (an entry's
bytes: ``size_bytes`` given by the caller + its vector + its text in UTF-8).

Not thread-safe: it is called from the event loop only (no awaits inside, so each call is
atomic there). Pure: numpy only.
"""

from __future__ import annotations

import math
import re
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from sokuji.errors import ConfigError, RuntimeFailed

Scope = tuple[str, ...]
"""(tenant, model, version, params_hash)."""

RESULTS = ("hit", "miss", "guarded", "empty")

_MIN_ROWS = 8


@dataclass(frozen=True)
class SemanticHit:
    value: Any
    similarity: float
    text: str
    """The stored text whose answer this is."""


@dataclass
class _Entry:
    value: Any
    nbytes: int


class _ScopeRows:
    """One scope's unit vectors (rows ``[0, n)`` of ``matrix``) and the text of each row."""

    __slots__ = ("matrix", "n", "row_of", "texts")

    def __init__(self, dims: int) -> None:
        self.matrix = np.empty((_MIN_ROWS, dims), np.float32)
        self.n = 0
        self.texts: list[str] = []
        self.row_of: dict[str, int] = {}

    def put(self, text: str, vector: np.ndarray) -> None:
        row = self.row_of.get(text)
        if row is None:
            if self.n == len(self.matrix):
                grown = np.empty((2 * len(self.matrix), self.matrix.shape[1]), np.float32)
                grown[: self.n] = self.matrix[: self.n]
                self.matrix = grown
            row = self.n
            self.n += 1
            self.texts.append(text)
            self.row_of[text] = row
        self.matrix[row] = vector

    def remove(self, text: str) -> None:
        row = self.row_of.pop(text)
        last = self.n - 1
        if row != last:  # move the last row into the hole
            self.matrix[row] = self.matrix[last]
            moved = self.texts[last]
            self.texts[row] = moved
            self.row_of[moved] = row
        self.texts.pop()
        self.n = last
        if len(self.matrix) > _MIN_ROWS and self.n <= len(self.matrix) // 4:
            self.matrix = self.matrix[: len(self.matrix) // 2].copy()


class SemanticCache:
    """Per-scope nearest-neighbour cache; see the module docstring."""

    def __init__(self, threshold: float, guards: bool = True, max_entries: int = 10000,
                 max_bytes: int = 64 << 20, tenant_share: float = 1.0) -> None:
        if not math.isfinite(threshold) or not -1.0 <= threshold <= 1.0:
            raise ConfigError(f"semantic cache threshold {threshold!r}: a cosine similarity "
                              "in [-1, 1] is needed", param="semantic_cache.threshold")
        if max_entries < 1 or max_bytes < 1:
            raise ConfigError("semantic cache: max_entries and max_bytes must be >= 1",
                              param="semantic_cache.max_entries")
        self.threshold = float(threshold)
        self.guards = guards
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.tenant_max = max(1, int(max_entries * tenant_share))
        """Entries one tenant (a scope's first element) may hold: past it, that tenant's own
        least recently used entry goes, so one tenant cannot flush the others' entries."""
        self._per_tenant: dict[str, OrderedDict[tuple[Scope, str], None]] = {}
        self._scopes: dict[Scope, _ScopeRows] = {}
        self._lru: OrderedDict[tuple[Scope, str], _Entry] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def scopes(self) -> int:
        return len(self._scopes)

    def lookup(self, scope: Scope, text: str, vector: np.ndarray
               ) -> tuple[SemanticHit | None, float, str]:
        """(the hit or None, the nearest stored similarity in this scope (-1.0 when the scope
        is empty), the result: hit | miss (below the threshold) | guarded (at or above it,
        refused by a guard) | empty). Only the nearest entry is considered, as calibrated."""
        rows = self._scopes.get(scope)
        if rows is None or rows.n == 0:
            return None, -1.0, "empty"
        query = _unit(vector, rows.matrix.shape[1])
        sims = rows.matrix[: rows.n] @ query
        best = int(np.argmax(sims))
        similarity = float(sims[best])
        if similarity < self.threshold:
            return None, similarity, "miss"
        cached = rows.texts[best]
        if self.guards and not guard_ok(text, cached):
            return None, similarity, "guarded"
        key = (scope, cached)
        self._lru.move_to_end(key)
        self._per_tenant[scope[0] if scope else ""].move_to_end(key)
        return SemanticHit(self._lru[key].value, similarity, cached), similarity, "hit"

    def store(self, scope: Scope, text: str, vector: np.ndarray, value: Any,
              size_bytes: int) -> None:
        """Store ``value`` as the answer to ``text`` in ``scope`` (replacing the entry of the
        same text there), then evict the least recently used entries of any scope while the
        cache holds more than ``max_entries`` or ``max_bytes``. An entry larger than
        ``max_bytes`` alone is not stored."""
        rows = self._scopes.get(scope)
        vec = np.asarray(vector)
        unit = _unit(vec, rows.matrix.shape[1] if rows is not None else
                     len(vec) if vec.ndim == 1 else 0)
        nbytes = max(0, int(size_bytes)) + 4 * len(unit) + len(text.encode())
        if nbytes > self.max_bytes:
            return
        key = (scope, text)
        if key in self._lru:
            self._bytes -= self._lru.pop(key).nbytes
            self._per_tenant[scope[0] if scope else ""].pop(key, None)
        if rows is None:
            rows = self._scopes[scope] = _ScopeRows(len(unit))
        rows.put(text, unit)
        self._lru[key] = _Entry(value, nbytes)
        self._bytes += nbytes
        own = self._per_tenant.setdefault(scope[0] if scope else "", OrderedDict())
        own[key] = None
        while len(own) > self.tenant_max:
            self._evict(next(iter(own)))
        while len(self._lru) > self.max_entries or self._bytes > self.max_bytes:
            self._evict(next(iter(self._lru)))

    def clear(self) -> None:
        self._scopes.clear()
        self._lru.clear()
        self._per_tenant.clear()
        self._bytes = 0

    def _evict(self, key: tuple[Scope, str]) -> None:
        scope, text = key
        self._bytes -= self._lru.pop(key).nbytes
        tenant = scope[0] if scope else ""
        own = self._per_tenant[tenant]
        own.pop(key, None)
        if not own:
            del self._per_tenant[tenant]
        rows = self._scopes[scope]
        rows.remove(text)
        if rows.n == 0:
            del self._scopes[scope]


def _unit(vector: np.ndarray, dims: int) -> np.ndarray:
    """``vector`` as float32 of length 1, or RuntimeFailed (an embedder's fault, not the
    client's: a 500 is right)."""
    v = np.asarray(vector, dtype=np.float32)
    if v.ndim != 1 or len(v) != dims or dims <= 0:
        raise RuntimeFailed(f"semantic cache: a vector of shape {v.shape} where ({dims},) is "
                            "stored for this scope")
    norm = float(np.linalg.norm(v))
    if not math.isfinite(norm) or norm == 0.0:
        raise RuntimeFailed("semantic cache: a zero or non-finite embedding")
    return v / np.float32(norm)


# --- guards ---------------------------------------------------------------------------

_NUMBER_WORDS = {w: str(i) for i, w in enumerate((
    "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
    "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty"), start=1)}
_WORD = re.compile(r"[^\W_]+")
_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\b(?:"
                     + "|".join(_NUMBER_WORDS) + r")\b", re.IGNORECASE)


def words(text: str) -> list[str]:
    """Lower-cased runs of letters and digits, in order."""
    return _WORD.findall(text.casefold())


def numbers(text: str) -> list[str]:
    """The numbers of ``text`` in order, canonical: digits without thousands separators or
    leading zeros ("1,000" -> "1000", "07" -> "7"; "3.10" stays "3.10", unlike "3.1"), and
    the words one..twenty as digits ("seven" -> "7")."""
    out = []
    for token in _NUMBER.findall(text):
        low = token.casefold()
        if low in _NUMBER_WORDS:
            out.append(_NUMBER_WORDS[low])
            continue
        whole, dot, frac = token.replace(",", "").partition(".")
        out.append((whole.lstrip("0") or "0") + dot + frac)
    return out


def guard_ok(query: str, cached: str) -> bool:
    """False when ``cached``'s answer must not serve ``query`` even if their embeddings are
    close: the same multiset of words in a different order (swapped arguments: "London to
    Paris" / "Paris to London"), or a different sequence of numbers (digits, and the words
    one..twenty). Not fitted to any data; each refusal is a miss, never a wrong answer.
    Known costs: a true paraphrase that only reorders its words, or writes a number another
    way ("twenty-one" vs "21", "half past seven" vs "7:30"), is refused too."""
    if numbers(query) != numbers(cached):
        return False
    wq, wc = words(query), words(cached)
    return wq == wc or Counter(wq) != Counter(wc)
