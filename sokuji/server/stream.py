"""``Api.STREAM`` over HTTP: ``POST /v2/models/{m}/infer`` with ``Accept:
application/x-ndjson`` and a body sent in chunks (``Transfer-Encoding: chunked``, e.g. a WAV
from a microphone), for a model that serves it (its ``open_stream``: VAD's segments,
``audio/vad_stream.py``).

Each record is written as one NDJSON line as soon as the model has it, so a client learns of
it while it is still sending; the last line is the model's own summary (``end``).

- The status is sent once the body's head has arrived and passed the model's checks
  (``ready``), so a wrong format or parameter is still a proper 4xx. A problem found later
  (the body past the model's ``max_request_bytes``, a body the model finds wrong or
  truncated) ends the stream with ``{"error": ..., "status": N}`` as its last line.
- Per-request parameters come in the query string (``?threshold=0.6``), checked by the model.
- V2 itself cannot stream its input: a V2 request is one JSON document (or one header plus
  its binary tensors), decoded whole.
- Each chunk is fed in the preparation pool, one chunk at a time per stream; the model counts
  a stream in flight until it is closed.
"""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import parse_qsl

import orjson
from starlette.types import Receive, Send

from sokuji.core import offload
from sokuji.core.model import RequestContext, ServedModel
from sokuji.errors import PayloadTooLarge, RuntimeFailed, SokujiError
from sokuji.server.http import Headers

log = logging.getLogger(__name__)
NDJSON = "application/x-ndjson"
_START = [(b"content-type", NDJSON.encode()), (b"cache-control", b"no-cache"),
          (b"x-accel-buffering", b"no")]


def wants_stream(headers: Headers) -> bool:
    return NDJSON in headers.get("accept", "")


async def relay(model: ServedModel, limit: int, headers: Headers, query: bytes,
                ctx: RequestContext, receive: Receive, send: Send) -> None:
    """Answer one streamed body. Raises a ``SokujiError`` only before the status is sent."""
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of "
                              f"{limit} bytes")
    params = dict(parse_qsl(query.decode("latin-1"), keep_blank_values=True))
    records = model.open_stream(headers.get("content-type", ""), params, ctx)
    t0 = time.perf_counter_ns()
    started = False
    count = total = 0
    work_ns = 0

    async def lines(out: list[dict[str, Any]]) -> None:
        nonlocal count
        count += len(out)
        if out:
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"".join(orjson.dumps(r) + b"\n" for r in out)})

    async def run(fn: Any, *args: Any) -> list[dict[str, Any]]:
        nonlocal work_ns
        t = time.perf_counter_ns()
        try:
            return list(await offload.run(fn, *args))
        finally:
            work_ns += time.perf_counter_ns() - t

    try:
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk, more = message.get("body", b""), message.get("more_body", False)
            total += len(chunk)
            if total > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            out = await run(records.feed, chunk) if chunk else []
            if not started and records.ready:
                await send({"type": "http.response.start", "status": 200, "headers": _START})
                started = True
            if started:
                await lines(out)
        out = await run(records.finish)
        if not started:  # (it did not refuse the body: its head came with the last chunk)
            await send({"type": "http.response.start", "status": 200, "headers": _START})
            started = True
        await lines(out)
        end = records.end(count, (time.perf_counter_ns() - t0) / 1e6, work_ns / 1e6)
        await send({"type": "http.response.body", "body": orjson.dumps(end) + b"\n"})
    except Exception as exc:  # after the status, any failure is the stream's last line
        if not started:
            raise
        if not isinstance(exc, SokujiError):
            log.exception("the stream of model '%s' failed", model.name)
            exc = RuntimeFailed(f"model '{model.name}' failed: {exc!r}")
        await send({"type": "http.response.body", "body": orjson.dumps(
            {"error": exc.message, "status": exc.status}) + b"\n"})
    finally:
        records.close()
