"""Streaming VAD: ``POST /v2/models/{vad}/infer`` with ``Accept: application/x-ndjson`` and
a WAV body sent in chunks (``Transfer-Encoding: chunked``, e.g. from a microphone).

Each speech segment is written as one NDJSON line as soon as no later audio can change it
(``audio/vad_stream.py`` says when that is; with the defaults, once its trailing silence
reaches ``min_silence_duration_ms``), so a client learns of an utterance's end while it
is still sending. The last line is ``{"done": true, "duration_s": ..., "segments": N,
"timing_ms": {...}}``. The segments are exactly the whole-file answer's (tested).

- The status is sent once the WAV header has arrived and passed its checks, so a wrong
  format, rate or declared duration is still a proper 4xx. A problem found later (the audio
  runs past ``max_audio_s``, the body past the model's ``max_request_bytes``, a truncated
  body) ends the stream with ``{"error": ..., "status": N}`` as its last line.
- Per-request parameters come in the query string (``?threshold=0.6&speech_pad_ms=50``),
  checked like the V2 parameters (400 naming the key).
- V2 itself cannot stream its input: a V2 request is one JSON document (or one header plus
  its binary tensors), decoded whole. FLAC is refused here (415): libsndfile decodes it only
  from a seekable, complete file; send it as one body.
- Each chunk is decoded and run in the preparation pool, one chunk at a time per stream; a
  stream counts as one file in flight toward the model's ``max_concurrency``.
"""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import parse_qsl

import orjson
from starlette.types import Receive, Send

from sokuji.core import offload
from sokuji.errors import (
    BadRequest,
    InvalidInput,
    PayloadTooLarge,
    RuntimeFailed,
    SokujiError,
    UnsupportedMediaType,
)
from sokuji.media.model import MediaModel
from sokuji.server.http import Headers

log = logging.getLogger(__name__)
NDJSON = "application/x-ndjson"
WAV_TYPES = frozenset({"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave",
                       "application/octet-stream"})


def wants_stream(headers: Headers) -> bool:
    return NDJSON in headers.get("accept", "")


def _params(query: bytes) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
        try:
            out[key] = float(value)
        except ValueError:
            raise InvalidInput(f"query parameter '{key}' must be a number, got {value!r}",
                               param=key) from None
    return out


async def stream_vad(media: MediaModel, limit: int, headers: Headers, query: bytes,
                     receive: Receive, send: Send) -> None:
    """Answer one streamed WAV. Raises a ``SokujiError`` only before the status is sent."""
    from sokuji.audio.vad_stream import VadStream

    if media.input_name != "audio" or not hasattr(media.engine, "stream_session"):
        raise BadRequest(f"model '{media.name}' does not stream; send the whole file")
    base = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if base not in WAV_TYPES:
        raise UnsupportedMediaType(f"Content-Type {base or None!r} cannot be streamed; send a "
                                   "WAV (audio/wav) in chunks, or a FLAC as one body")
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of "
                              f"{limit} bytes")
    media.check_admission()
    stream = VadStream(media.engine, _params(query))
    media.num_admitted += 1
    t0 = time.perf_counter_ns()
    started = False
    count = total = 0
    work_ns = 0

    async def lines(segments: list[dict[str, Any]]) -> None:
        nonlocal count
        count += len(segments)
        if segments:
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"".join(orjson.dumps(s) + b"\n" for s in segments)})

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
            segments = await run(stream.feed, chunk) if chunk else []
            if not started and stream.decoder.info is not None:
                await send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", NDJSON.encode()), (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no")]})
                started = True
            if started:
                await lines(segments)
        segments = await run(stream.finish)
        if not started:  # a body shorter than a WAV header: ``finish`` raised already
            raise InvalidInput("the body ended before a WAV header")
        await lines(segments)
        end = {"done": True, "duration_s": stream.samples_16k / 16000, "segments": count,
               "timing_ms": {"total": (time.perf_counter_ns() - t0) / 1e6,
                             "decode+resample+infer": work_ns / 1e6}}
        await send({"type": "http.response.body", "body": orjson.dumps(end) + b"\n"})
    except Exception as exc:  # after the status, any failure is the stream's last line
        if not started:
            raise
        if not isinstance(exc, SokujiError):
            log.exception("VAD stream of model '%s' failed", media.name)
            exc = RuntimeFailed(f"model '{media.name}' failed: {exc!r}")
        await send({"type": "http.response.body", "body": orjson.dumps(
            {"error": exc.message, "status": exc.status}) + b"\n"})
    finally:
        media.num_admitted -= 1
