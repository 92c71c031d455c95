"""Request coalescing in the response cache (``core/cache.py`` ``get_or_compute``) against
the mutants mutmut left alive there (docs/mutation.md): each test names the mutant(s) it
kills, by mutmut's name."""

from __future__ import annotations

import asyncio

import numpy as np

from sokuji.core.cache import CacheResult, Entry, ResponseCache
from sokuji.stores.cache_memory import MemoryBackend


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _gated(gate: asyncio.Event, calls: list[int]):  # type: ignore[no-untyped-def]
    async def compute() -> Entry:
        calls.append(1)
        await gate.wait()
        return Entry(np.full((1, 3), float(len(calls)), dtype=np.float32), 3)
    return compute


async def test_a_coalesced_request_gets_the_leaders_entry() -> None:
    """Kills ``xǁResponseCacheǁget_or_compute__mutmut_31`` (the leader's future resolved
    with None: every follower answered nothing) and ``_15`` (the follower's report without
    its model: the metrics' cache counter would count it under no model)."""
    reported: list[tuple[str, CacheResult]] = []
    cache = ResponseCache(MemoryBackend(1 << 20, 60),
                          on_result=lambda model, result: reported.append((model, result)))
    gate, calls = asyncio.Event(), []
    compute = _gated(gate, calls)
    leader = asyncio.create_task(cache.get_or_compute("m", "k", compute))
    await _settle()
    follower = asyncio.create_task(cache.get_or_compute("m", "k", compute))
    await _settle()
    gate.set()
    (lead_entry, lead), (entry, result) = await asyncio.gather(leader, follower)
    assert (lead, result, len(calls)) == (CacheResult.MISS, CacheResult.COALESCED, 1)
    assert entry is lead_entry
    assert sorted(reported) == [("m", CacheResult.COALESCED), ("m", CacheResult.MISS)]


async def test_a_follower_computes_for_itself_when_the_leader_is_cancelled() -> None:
    """The leader's client went away: its follower is not cancelled with it. Kills
    ``xǁResponseCacheǁget_or_compute__mutmut_23`` (``or``: the follower re-raises the
    leader's cancellation as its own)."""
    cache = ResponseCache(MemoryBackend(1 << 20, 60))
    gate, calls = asyncio.Event(), []
    compute = _gated(gate, calls)
    leader = asyncio.create_task(cache.get_or_compute("m", "k", compute))
    await _settle()
    follower = asyncio.create_task(cache.get_or_compute("m", "k", compute))
    await _settle()
    leader.cancel()
    await _settle()
    gate.set()
    lead, (_, result) = await asyncio.gather(leader, follower, return_exceptions=True)
    assert isinstance(lead, asyncio.CancelledError)
    assert result is CacheResult.MISS and len(calls) == 2


async def test_a_cancelled_follower_stops_and_computes_nothing() -> None:
    """Kills ``xǁResponseCacheǁget_or_compute__mutmut_22`` and ``_24`` (the follower's own
    cancellation taken for the leader's: it would go on to compute a second time)."""
    cache = ResponseCache(MemoryBackend(1 << 20, 60))
    gate, calls = asyncio.Event(), []
    compute = _gated(gate, calls)
    leader = asyncio.create_task(cache.get_or_compute("m", "k", compute))
    await _settle()
    follower = asyncio.create_task(cache.get_or_compute("m", "k", compute))
    await _settle()
    follower.cancel()
    await _settle()
    gate.set()
    (_, lead), gone = await asyncio.gather(leader, follower, return_exceptions=True)
    assert lead is CacheResult.MISS and isinstance(gone, asyncio.CancelledError)
    assert len(calls) == 1
