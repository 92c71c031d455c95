"""VAD over a WAV that arrives in chunks (a chunked HTTP body): each segment is yielded as
soon as no later audio can change it, and the segments are exactly the batch engine's.

The way of the bytes: ``WavStreamDecoder`` (the header parsed as bytes arrive, then whole
PCM frames, downmixed) -> ``soxr.ResampleStream`` (HQ; its output is the same samples as
one-shot ``soxr.resample`` whatever the chunking) -> 512-sample frames with 64 samples of
context through the sequence model, the LSTM state carried (``vad.FrameModel``: the same
probabilities as one call over the whole file) -> ``SpeechSegmenter`` (silero's state
machine, one probability at a time).

**When a segment is final.** silero pads after the loop: a segment's padded start depends on
the gap to the previous one, its padded end on the gap to the next (a gap under two pads is
split in half, else each side gets one pad, the last end is cut at the audio's end). A closed
segment is therefore final once the next kept segment's start is known, or once no later
start can come within two pads of its end: every later start is at or after the open
segment's start, or, with none open, the next frame. With the defaults that happens as its
silence reaches ``min_silence_duration_ms`` (1600 samples > 960 = two pads), as the research
said; with a long ``speech_pad_ms`` it comes later but still exactly. Cuts at
``max_speech_duration_s`` are decided from past frames only, so they stream exactly too.
Only the segment still open when the audio ends waits for ``finish``.

**FLAC is not streamed** (415): soundfile/libsndfile read FLAC from a seekable file (they
seek while opening and after every read), so a FLAC can be decoded only once it has fully
arrived. Decoding it as it arrives would need libFLAC's stream decoder through a new native
binding (or a thread per stream blocking in a file object); send FLAC as one body.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sokuji.audio.vad_model import (
    DEFAULTS,
    FRAME,
    RATE_HZ,
    FrameModel,
    check_parameters,
    frames_of,
)
from sokuji.audio.vad_segments import Speech, SpeechSegmenter, pad_speeches
from sokuji.errors import InvalidInput, UnsupportedMediaType
from sokuji.media import audio


class WavStreamDecoder:
    """WAV bytes in any chunking -> float32 mono samples at the source rate, every limit
    checked as soon as the header (or the running length) shows it is passed."""

    def __init__(self, limits: audio.AudioLimits = audio.DEFAULT_LIMITS) -> None:
        self.limits = limits
        self.info: audio.AudioInfo | None = None
        self._head = bytearray()
        self._left: int | None = None
        """Data bytes still expected (None: until the stream ends)."""
        self._partial = b""
        self._block_align = 0
        self.frames = 0

    def feed(self, data: bytes) -> np.ndarray:
        if self.info is None:
            self._head += data
            if len(self._head) >= 4 and self._head[:4] == b"fLaC":
                raise UnsupportedMediaType("FLAC cannot be streamed (it is decoded from a "
                                           "seekable file): send it as one body, or stream WAV")
            parsed = audio.parse_wav_header(self._head)
            if parsed is None:
                return np.zeros(0, np.float32)
            info, size = parsed
            audio.check_limits(info, self.limits)
            self.info = info
            self._block_align = info.channels * audio.bits_of(info) // 8
            self._left = None if info.frames is None else size
            data, self._head = bytes(self._head[info.data_offset:]), bytearray()
        if self._left is not None:
            data = data[:self._left]
            self._left -= len(data)
        body = self._partial + data
        whole = len(body) - len(body) % self._block_align
        self._partial = body[whole:]
        self.frames += whole // self._block_align
        if self.frames / self.info.sample_rate > self.limits.max_audio_s:
            raise audio.too_long(self.frames / self.info.sample_rate, self.limits,
                                 at_least=True)
        return audio.downmix(audio.pcm_to_float(body[:whole], self.info.subtype),
                             self.info.channels)

    def finish(self) -> None:
        """Raises 400 if the stream ended early (inside the header, or before the data size
        the header gave)."""
        if self.info is None:
            if not self._head:
                raise InvalidInput("empty audio body")
            raise InvalidInput("truncated WAV: the stream ends inside its header")
        if self._left:
            expected = self.info.frames or 0
            raise InvalidInput(f"truncated WAV: header says {expected} frames, body has "
                               f"{self.frames}")


class VadStream:
    """``feed(bytes)`` -> the segments that became final; ``finish()`` -> the rest. Each
    segment: ``{"start": s, "end": s, "start_sample": n, "end_sample": n}`` (16 kHz samples,
    as ``VadEngine.plain``). ``model``: a ``VadEngine`` (its first session) or an ONNX Runtime
    session of the sequence model. Not thread-safe: one stream, one caller at a time."""

    def __init__(self, model: Any, params: Mapping[str, Any] | None = None,
                 limits: audio.AudioLimits | None = None) -> None:
        session = getattr(model, "stream_session", model)
        defaults = getattr(model, "defaults", DEFAULTS)
        self.params = check_parameters(params or {}, defaults)
        self.decoder = WavStreamDecoder(
            limits or getattr(model, "audio_limits", None) or audio.DEFAULT_LIMITS)
        self._resampler: Any = None
        self._model = FrameModel(session)
        self._pending = np.zeros(0, np.float32)
        self.samples_16k = 0
        p = self.params
        self._seg = SpeechSegmenter(
            RATE_HZ, p["threshold"], p["min_speech_duration_ms"], p["max_speech_duration_s"],
            p["min_silence_duration_ms"], p["speech_pad_ms"])
        self._emitted = 0

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        x = self.decoder.feed(data)
        if self.decoder.info is None:
            return []
        self._push(self._resample(x, last=False), last=False)
        return self._ready(final=False)

    def finish(self) -> list[dict[str, Any]]:
        self.decoder.finish()
        self._push(self._resample(np.zeros(0, np.float32), last=True), last=True)
        self._seg.close(self.samples_16k)
        return self._ready(final=True)

    def _resample(self, x: np.ndarray, last: bool) -> np.ndarray:
        info = self.decoder.info
        assert info is not None
        if info.sample_rate == RATE_HZ:
            return x
        if self._resampler is None:
            import soxr

            self._resampler = soxr.ResampleStream(info.sample_rate, RATE_HZ, 1,
                                                  dtype="float32", quality="HQ")
        return np.asarray(self._resampler.resample_chunk(x, last=last), np.float32)

    def _push(self, y: np.ndarray, last: bool) -> None:
        self.samples_16k += len(y)
        pending = np.concatenate((self._pending, y)) if len(self._pending) else y
        whole = len(pending) if last else len(pending) - len(pending) % FRAME
        if whole:
            for p in self._model.run(frames_of(pending[:whole])).tolist():
                self._seg.push(p)
        self._pending = pending[whole:]

    def _ready(self, final: bool) -> list[dict[str, Any]]:
        """Padded segments that no later audio can change (all of them when ``final``)."""
        seg, speeches = self._seg, self._seg.speeches
        pad = seg.speech_pad_samples
        # The earliest start a later kept segment can have.
        later = seg.current_speech.get("start", seg.window_size_samples * seg.frames)
        out = []
        while self._emitted < len(speeches):
            k = self._emitted
            has_next = k + 1 < len(speeches)
            if not (final or has_next or later - speeches[k]["end"] >= 2 * pad):
                break
            window: list[Speech] = [dict(s) for s in speeches[max(0, k - 1):k + 2]]
            pad_speeches(window, pad, self.samples_16k)
            mine = window[1 if k else 0]
            out.append({"start": mine["start"] / RATE_HZ, "end": mine["end"] / RATE_HZ,
                        "start_sample": mine["start"], "end_sample": mine["end"]})
            self._emitted += 1
        return out


WAV_TYPES = frozenset({"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave",
                       "application/octet-stream"})
"""What may be streamed: a WAV (FLAC only as one body: see above)."""


class VadRecords:
    """A streamed WAV as ``Api.STREAM`` records (``core.model.RecordStream``): its segments,
    then a last line ``{"done": true, "duration_s", "segments", "timing_ms"}``. Ready (the
    status may be sent) once the WAV header has arrived and passed its checks."""

    def __init__(self, engine: Any, content_type: str, query: Mapping[str, str]) -> None:
        base = content_type.split(";", 1)[0].strip().lower()
        if base not in WAV_TYPES:
            raise UnsupportedMediaType(f"Content-Type {base or None!r} cannot be streamed; "
                                       "send a WAV (audio/wav) in chunks, or a FLAC as one "
                                       "body")
        self.stream = VadStream(engine, _numbers(query))

    @property
    def ready(self) -> bool:
        return self.stream.decoder.info is not None

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        return self.stream.feed(chunk)

    def finish(self) -> list[dict[str, Any]]:
        segments = self.stream.finish()
        if not self.ready:  # a body shorter than a WAV header: ``finish`` raised already
            raise InvalidInput("the body ended before a WAV header")
        return segments

    def end(self, records: int, total_ms: float, work_ms: float) -> dict[str, Any]:
        return {"done": True, "duration_s": self.stream.samples_16k / RATE_HZ,
                "segments": records,
                "timing_ms": {"total": total_ms, "decode+resample+infer": work_ms}}

    def close(self) -> None:
        pass


def _numbers(query: Mapping[str, str]) -> dict[str, Any]:
    """The request's parameters from its query string (``?threshold=0.6``): numbers,
    checked like the V2 parameters (400 naming the key)."""
    out: dict[str, Any] = {}
    for key, value in query.items():
        try:
            out[key] = float(value)
        except ValueError:
            raise InvalidInput(f"query parameter '{key}' must be a number, got {value!r}",
                               param=key) from None
    return out
