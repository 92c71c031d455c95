"""A loop that takes a step of work whenever there may be some: at once when woken (work
was added, a retry fell due), else every ``interval_s`` (work another process added is
found that way), never busy-waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable


class PollLoop:
    """``run(step)`` on the event loop; ``wake`` and ``wake_in`` from it."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._wake = asyncio.Event()
        self._timers: set[asyncio.TimerHandle] = set()

    def wake(self) -> None:
        """Take the next step now, or as soon as the one running ends."""
        self._wake.set()

    def wake_in(self, delay_s: float) -> None:
        """``wake()`` after ``delay_s`` (unless the loop has ended by then)."""
        handle: asyncio.TimerHandle

        def fire() -> None:
            self._timers.discard(handle)
            self._wake.set()

        handle = asyncio.get_running_loop().call_later(delay_s, fire)
        self._timers.add(handle)

    async def run(self, step: Callable[[], Awaitable[bool]]) -> None:
        """``step()`` until cancelled: again at once while it returns True (there is more to
        take), else after a wake or ``interval_s``, whichever comes first. A wake while a
        step runs is kept: the wait after it ends at once. Once the loop ends (cancelled, or
        a step raised), the wakes it was given for later are cancelled."""
        try:
            while True:
                self._wake.clear()  # before the step: a wake from now on is for the next
                if not await step():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self.interval_s)
        finally:
            for handle in self._timers:
                handle.cancel()
            self._timers.clear()
