"""The one poll loop (sokuji/core/poll_loop.py) with a scripted step: a wake runs it, a step
with more runs again at once, the interval bounds the wait, a wake during a step is kept,
and cancelling it stops it and the wakes it was given for later."""

from __future__ import annotations

import asyncio

from sokuji.core.poll_loop import PollLoop

LONG_S = 3600.0  # an interval the test never waits out


class Steps:
    def __init__(self, more: int = 0) -> None:
        self.more = more
        self.count = 0
        self.ran = asyncio.Event()
        self.hold: asyncio.Event | None = None

    async def __call__(self) -> bool:
        self.count += 1
        self.ran.set()
        if self.hold is not None:
            await self.hold.wait()
        if self.more:
            self.more -= 1
            return True
        return False

    async def next(self) -> None:
        self.ran.clear()
        await asyncio.wait_for(self.ran.wait(), 5)


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()


async def test_a_wake_runs_the_next_step() -> None:
    poll, steps = PollLoop(LONG_S), Steps()
    task = asyncio.create_task(poll.run(steps))
    await steps.next()
    assert steps.count == 1
    poll.wake()
    await steps.next()
    assert steps.count == 2
    await stop(task)


async def test_a_step_with_more_runs_again_at_once() -> None:
    poll, steps = PollLoop(LONG_S), Steps(more=3)
    task = asyncio.create_task(poll.run(steps))
    while steps.count < 4:
        await steps.next()
    await asyncio.sleep(0)
    assert steps.count == 4  # then it waits
    await stop(task)


async def test_the_interval_bounds_the_wait() -> None:
    poll, steps = PollLoop(0.01), Steps()
    task = asyncio.create_task(poll.run(steps))
    for _ in range(3):
        await steps.next()
    await stop(task)


async def test_a_wake_during_a_step_is_kept() -> None:
    poll, steps = PollLoop(LONG_S), Steps()
    steps.hold = asyncio.Event()
    task = asyncio.create_task(poll.run(steps))
    await steps.next()
    poll.wake()  # while the first step runs
    steps.hold.set()
    await steps.next()
    assert steps.count == 2
    await stop(task)


async def test_wake_in_and_a_clean_stop() -> None:
    poll, steps = PollLoop(LONG_S), Steps()
    task = asyncio.create_task(poll.run(steps))
    await steps.next()
    poll.wake_in(0.01)
    await steps.next()
    assert steps.count == 2 and not poll._timers  # a fired wake is forgotten
    poll.wake_in(LONG_S)
    (later,) = poll._timers
    await stop(task)
    assert later.cancelled() and not poll._timers
