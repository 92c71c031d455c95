"""The response cache's in-process backend (``core/cache.py``'s ``Backend``)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from sokuji.core.cache import Entry


class MemoryBackend:
    """LRU bounded by ``max_bytes``; entries older than ``ttl_s`` are misses."""

    def __init__(self, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self.bytes = 0
        self._data: OrderedDict[str, tuple[float, Entry]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    async def get(self, key: str) -> Entry | None:
        item = self._data.get(key)
        if item is None:
            return None
        stored, entry = item
        if self.clock() - stored > self.ttl_s:
            self._drop(key)
            return None
        self._data.move_to_end(key)
        return entry

    async def set(self, key: str, entry: Entry) -> None:
        if entry.nbytes > self.max_bytes:
            return
        if key in self._data:
            self._drop(key)
        self._data[key] = (self.clock(), entry)
        self.bytes += entry.nbytes
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._data)))

    def _drop(self, key: str) -> None:
        _, entry = self._data.pop(key)
        self.bytes -= entry.nbytes

    async def close(self) -> None:
        self._data.clear()
        self.bytes = 0
