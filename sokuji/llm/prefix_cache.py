"""Prefix cache: the KV state of earlier prompts, kept in host memory and reused.

After a prompt is prefilled, its sequence's KV state (``llama_state_seq_get_data``: ~23 KB a
token for SmolLM2-135M) is stored under its tenant and its token ids. A new prompt looks for
the stored prompt **of the same tenant** with the longest common prefix; that state is loaded
into the new request's slot, cut back to the common prefix (``llama_memory_seq_rm``), and only
the rest of the prompt is prefilled. A shared system prompt or few-shot block is thus
prefilled once per tenant.

Why per tenant: a hit is visible to the caller twice over, in ``usage`` (``cached_tokens``,
exact) and in time (a hit skips prefill, so the first token comes sooner). A cache shared
across tenants would let one tenant test guesses of another's system prompt token by token
through either signal. Keyed by tenant, a lookup only ever matches the caller's own prompts,
so neither the count nor the timing depends on what other tenants sent. (With no API keys
configured every caller is the one tenant ``anonymous`` and shares the cache.)

Memory is bounded (``max_bytes``, all tenants together) with least-recently-used eviction. A
stored prompt that is a prefix of a newer one of the same tenant is replaced by it; a prompt
that is a prefix of a stored one is not stored again. Everything here runs on the engine
thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

Key = tuple[str, tuple[int, ...]]
"""(tenant, prompt token ids)"""


@dataclass
class Match:
    tokens: int
    """How many leading prompt tokens the state covers (0: a miss)."""
    state: bytes | None


class PrefixCache:
    def __init__(self, max_bytes: int, min_tokens: int = 16) -> None:
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self._entries: OrderedDict[Key, bytes] = OrderedDict()
        """LRU order over every tenant's entries (oldest first)."""
        self._arrays: dict[str, dict[Key, np.ndarray]] = {}
        """tenant -> its stored prompts as arrays (for the prefix comparison)."""
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _common(a: np.ndarray, b: np.ndarray) -> int:
        n = min(len(a), len(b))
        diff = np.flatnonzero(a[:n] != b[:n])
        return int(diff[0]) if len(diff) else n

    def lookup(self, prompt: list[int], tenant: str) -> Match:
        """The state of ``tenant``'s stored prompt sharing the longest prefix with ``prompt``
        (at least ``min_tokens``); at most ``len(prompt) - 1`` tokens are reused, as the last
        prompt token must be decoded again for its logits."""
        own = self._arrays.get(tenant)
        if self.max_bytes <= 0 or len(prompt) <= self.min_tokens or not own:
            self.misses += 1
            return Match(0, None)
        query = np.asarray(prompt, dtype=np.int32)
        best_key, best = None, 0
        for key, arr in own.items():
            n = self._common(query, arr)
            if n > best:
                best_key, best = key, n
        best = min(best, len(prompt) - 1)
        if best_key is None or best < self.min_tokens:
            self.misses += 1
            return Match(0, None)
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.reused_tokens += best
        return Match(best, self._entries[best_key])

    def wants(self, prompt: list[int], tenant: str) -> bool:
        """Whether storing ``prompt`` for ``tenant`` would add anything (it is long enough,
        and not already covered by a stored prompt of that tenant that extends it)."""
        if self.max_bytes <= 0 or len(prompt) < self.min_tokens:
            return False
        query = np.asarray(prompt, dtype=np.int32)
        return not any(len(arr) >= len(query) and self._common(query, arr) == len(query)
                       for arr in self._arrays.get(tenant, {}).values())

    def store(self, prompt: list[int], tenant: str, state: bytes) -> None:
        if len(state) > self.max_bytes:
            return
        key = (tenant, tuple(prompt))
        query = np.asarray(prompt, dtype=np.int32)
        own = self._arrays.setdefault(tenant, {})
        for old, arr in list(own.items()):  # the tenant's stored prompts this one extends
            if len(arr) <= len(query) and self._common(query, arr) == len(arr):
                self._drop(old)
        self._entries[key] = state
        self._arrays.setdefault(tenant, {})[key] = query
        self.bytes += len(state)
        while self.bytes > self.max_bytes and self._entries:
            self._drop(next(iter(self._entries)))
            self.evictions += 1

    def _drop(self, key: Key) -> None:
        state = self._entries.pop(key)
        own = self._arrays[key[0]]
        del own[key]
        if not own:  # no empty dicts left behind by tenants that come and go
            del self._arrays[key[0]]
        self.bytes -= len(state)
