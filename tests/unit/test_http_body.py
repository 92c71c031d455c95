"""A request body is bounded in time (``server/http.py`` ``read_body``, ``BodyTimeout``) and a
stream's admission in count (``server/stream.py`` ``Streams.cap``); the HTTP replays are in
``tests/integration/test_stream_bounds.py``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sokuji.config import ServerConfig, StreamsConfig
from sokuji.errors import RequestTimeout
from sokuji.server.http import BodyTimeout, read_body
from sokuji.server.stream import AUTO_CAP, Streams


def _receiver(pieces: list[bytes], then_wait: bool, every_s: float = 0.0) -> Any:
    """An ASGI ``receive`` giving ``pieces`` (``every_s`` apart), then waiting forever
    (``then_wait``: the client holds the body open) or ending the body."""
    it = iter(pieces)

    async def receive() -> dict[str, Any]:
        piece = next(it, None)
        if piece is None:
            await asyncio.Event().wait()
        if every_s:
            await asyncio.sleep(every_s)
        return {"type": "http.request", "body": piece, "more_body": then_wait or bool(
            it.__length_hint__())}

    return receive


def _read(receive: Any, timeout: BodyTimeout, size: int = 100) -> bytes:
    return asyncio.run(read_body(receive, {"content-length": str(size)}, 1000, timeout))


def test_a_body_held_open_is_refused_at_the_idle_bound() -> None:
    with pytest.raises(RequestTimeout, match="body_idle_timeout_s") as info:
        _read(_receiver([b"x" * 50], then_wait=True), BodyTimeout(5.0, 0.05))
    assert info.value.status == 408 and info.value.headers == {"connection": "close"}


def test_a_trickled_body_is_refused_at_the_total_bound() -> None:
    with pytest.raises(RequestTimeout, match="body_timeout_s"):
        _read(_receiver([b"x"] * 100, then_wait=True, every_s=0.01), BodyTimeout(0.1, 1.0))


def test_a_body_within_both_bounds_is_read_whole() -> None:
    assert _read(_receiver([b"x" * 40, b"y" * 60], then_wait=False),
                 BodyTimeout(5.0, 1.0)) == b"x" * 40 + b"y" * 60


def test_the_bounds_come_from_the_config() -> None:
    bounds = BodyTimeout.of(ServerConfig())
    assert (bounds.total_s, bounds.idle_s) == (60.0, 10.0)


def test_the_per_tenant_stream_cap() -> None:
    keyed, open_ = Streams(StreamsConfig(), keyed=True), Streams(StreamsConfig(), keyed=False)
    assert [keyed.cap(n) for n in (1, 2, 5)] == [1, 1, 4]  # never every slot, but at least 1
    assert keyed.cap(0) == AUTO_CAP
    assert open_.cap(2) == 0  # no keys: every caller is one tenant, the model bounds it
    assert Streams(StreamsConfig(max_per_tenant=3), keyed=False).cap(2) == 3


def test_a_read_cancelled_by_its_request_stays_cancelled_and_nothing_is_left() -> None:
    timeout = BodyTimeout(5.0, 0.05)

    async def main() -> None:
        task = asyncio.create_task(read_body(_receiver([], then_wait=True), {}, 1000, timeout))
        await asyncio.sleep(0.01)
        task.cancel()  # the request's own cancel (a shutdown), before the idle bound
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not timeout._waiting and not timeout._expired
        with pytest.raises(RequestTimeout):  # the next read is still bounded
            await read_body(_receiver([], then_wait=True), {}, 1000, timeout)
        assert not timeout._waiting and not timeout._expired

    asyncio.run(main())
