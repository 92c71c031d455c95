"""Slow clients: a body sent in part and held, a stream trickled a byte a second, streams
held open to take every slot of a model. Each kind's case runs at once (threads), so the
suite waits once, not per kind; no timing is asserted but against the wait the test itself
allows."""

from __future__ import annotations

import concurrent.futures
import socket
import time

import pytest

from tests.hostile import declared, wire
from tests.hostile.conftest import Server, auth, post

pytestmark = pytest.mark.integration

HELD_WAIT_S = 8.0
"""How long a held body or a trickling stream is kept up: the server must have ended it by
then (the suite's server sets its body and stream timeouts to ``conftest.SLOW_S``)."""


def _held(d: declared.Declared) -> declared.Request | None:
    return next((r for r in d.requests if r.route != declared.STREAM), None)


def test_a_held_body_is_answered_408_in_every_kind(server: Server) -> None:
    held = {d.runtime: r for d in declared.DECLARED.values() if (r := _held(d)) is not None}
    with concurrent.futures.ThreadPoolExecutor(len(held)) as pool:
        answers = dict(zip(held, pool.map(
            lambda r: wire.held(server.url, r.path, {**r.headers, **auth("t1")}, r.body,
                                HELD_WAIT_S), held.values()), strict=True))
    assert server.alive()
    late = {k: a.status for k, a in answers.items() if a.status != 408 or not a.reason()}
    assert not late, f"not answered 408 within {HELD_WAIT_S} s: {late}"


def _streams() -> list[declared.Declared]:
    return [d for d in declared.DECLARED.values()
            if declared.AUDIO in d.inputs and d.by_route(declared.STREAM) is not None]


def test_a_trickling_stream_is_ended_by_the_server(server: Server) -> None:
    streams = {d.runtime: d.by_route(declared.STREAM) for d in _streams()}
    assert streams
    with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
        answers = dict(zip(streams, pool.map(
            lambda r: wire.trickle(server.url, r.path, {**r.headers, **auth("t1")},
                                   r.body[:1000], HELD_WAIT_S), streams.values()), strict=True))
    assert server.alive()
    kept = {k: round(a.seconds, 1) for k, a in answers.items() if a.seconds >= HELD_WAIT_S - 0.5}
    assert not kept, f"streams still open after {HELD_WAIT_S} s: {kept}"


def _open_stream(server: Server, request: declared.Request, tenant: str) -> socket.socket:
    """A stream whose header is sent and answered, then left open (nothing more sent)."""
    sock = wire.connect(server.url, 10)
    sock.sendall(wire.head(request.path, {**request.headers, **auth(tenant),
                                          "Transfer-Encoding": "chunked"})
                 + b"%x\r\n%s\r\n" % (1000, request.body[:1000]))
    return sock


@pytest.mark.parametrize("d", _streams(), ids=lambda d: d.runtime)
def test_one_tenants_streams_leave_room_for_another(server: Server,
                                                    d: declared.Declared) -> None:
    stream = d.by_route(declared.STREAM)
    assert stream is not None
    held = [_open_stream(server, stream, "t1") for _ in range(2)]  # vad: max_concurrency 2
    try:
        time.sleep(0.5)  # the streams' headers reach the model (no answer to wait for)
        other = post(server, d.normal, "ops", **{"cache-control": "no-cache"})
        assert other.status_code == 200, other.text
    finally:
        for sock in held:
            sock.close()
