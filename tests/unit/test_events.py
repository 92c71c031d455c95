"""The one event stream (sokuji/core/events.py): a queue hands over what was put since the
last take, in order; ``events()`` ends at the Finish; ``result()`` joins the text or raises
the Finish's error."""

from __future__ import annotations

import asyncio

import pytest

from sokuji.core.events import Delta, EventQueue, Finish, Generated
from sokuji.errors import RuntimeFailed


async def test_a_take_waits_for_an_event_and_takes_all_there_are() -> None:
    q = EventQueue()
    take = asyncio.create_task(q.next_events())
    await asyncio.sleep(0)
    assert not take.done()
    q.put(Delta("a", 1))
    q.put(Delta("b", 2))
    assert await take == [Delta("a", 1), Delta("b", 2)]
    q.put(Finish("stop", 2))
    assert await q.next_events() == [Finish("stop", 2)]


async def test_events_end_at_the_finish_and_result_joins_the_text() -> None:
    q = EventQueue()
    for event in (Delta("Hel", 1), Delta("lo", 2), Finish("length", 2), Delta("late", 3)):
        q.put(event)
    assert await q.result() == Generated("Hello", Finish("length", 2))


async def test_a_failed_generation_raises_its_error() -> None:
    q = EventQueue()
    error = RuntimeFailed("the engine died")
    loop = asyncio.get_running_loop()
    loop.call_soon(q.put, Delta("x", 1))
    loop.call_soon(q.put, Finish("error", 1, error))
    with pytest.raises(RuntimeFailed) as exc:
        await q.result()
    assert exc.value is error
    seen = [e async for e in _finished("cancelled").events()]
    assert seen == [Finish("cancelled", 0)]


def _finished(reason: str) -> EventQueue:
    q = EventQueue()
    q.put(Finish(reason, 0))
    return q
