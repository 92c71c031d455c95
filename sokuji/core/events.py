"""A generation's events, and the one stream every generation handle is.

A generation gives ``Delta``s, then exactly one ``Finish`` (whatever ended it). Every
generation handle (local, upstream, on a Ray replica, routed, a pipeline's) is an
``EventStream``: it says how to take the events delivered so far (``next_events``), and
``events()`` and ``result()`` follow from that. A handle whose events are made elsewhere (an
engine thread, a relay task) is an ``EventQueue``: the maker puts, the caller takes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from sokuji.core.model import NOTHING, Report
from sokuji.errors import SokujiError


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability (``logprobs``), and its most likely
    alternatives' (``top_logprobs``): (text, bytes, log-probability) each."""

    token: str
    raw: bytes
    """Its bytes (a token may hold part of a character)."""
    logprob: float
    offset: int
    """Where its text begins in the generated text (characters)."""
    top: tuple[tuple[str, bytes, float], ...] = ()


@dataclass(frozen=True)
class Delta:
    text: str
    tokens: int
    """Generated tokens so far."""
    logprobs: tuple[TokenLogprob, ...] = ()
    """The log-probabilities of the tokens whose text this delta ends (asked for with
    ``logprobs``; ``llm/sequence.py`` says how they line up with the text)."""


@dataclass(frozen=True)
class Finish:
    reason: str
    """stop | length | cancelled | deadline | error"""
    completion_tokens: int
    error: SokujiError | None = None
    """Why it failed (reason deadline: ``DeadlineExceeded``; error: ``ModelNotReady`` when
    the server shuts down, ``RuntimeFailed`` otherwise); None when it did not."""


Event = Delta | Finish


@dataclass(frozen=True)
class Generated:
    """A whole generation's output."""

    text: str
    finish: Finish


class EventStream:
    """``events()`` and ``result()`` over a handle's ``next_events()``; its ``report``
    (``core.model.Report``) says nothing unless the handle has more to say."""

    @property
    def report(self) -> Report:
        return NOTHING

    async def next_events(self) -> list[Event]:
        """Wait for, and take, the events delivered so far (at least one)."""
        raise NotImplementedError

    async def events(self) -> AsyncIterator[Event]:
        """Each event as it comes: ``Delta``s, then one ``Finish`` (whatever its reason)."""
        while True:
            for event in await self.next_events():
                yield event
                if isinstance(event, Finish):
                    return

    async def result(self) -> Generated:
        """The whole text and its finish; raises the error a failed generation carries."""
        texts: list[str] = []
        async for event in self.events():
            if isinstance(event, Delta):
                texts.append(event.text)
            elif event.error is not None:
                raise event.error
            else:
                return Generated("".join(texts), event)
        raise AssertionError("unreachable: events() ends with a Finish")


class EventQueue(EventStream):
    """Events ``put`` on the event loop, taken by ``next_events`` in the order they came.
    Not thread-safe: a maker on another thread hands each event over with
    ``loop.call_soon_threadsafe(queue.put, event)``."""

    def __init__(self) -> None:
        self._events: deque[Event] = deque()
        self._wake = asyncio.Event()

    def put(self, event: Event) -> None:
        self._events.append(event)
        self._wake.set()

    async def next_events(self) -> list[Event]:
        while not self._events:
            self._wake.clear()
            await self._wake.wait()
        out = list(self._events)
        self._events.clear()
        return out
