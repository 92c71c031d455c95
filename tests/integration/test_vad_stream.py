"""VAD over a WAV fed in chunks (sokuji/audio/vad_stream.py): the streamed segments equal the
batch engine's exactly, whatever the chunking, and each is emitted as soon as no later audio
can change it (with the defaults: once its silence reaches min_silence_duration_ms)."""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sokuji.audio.vad import VadEngine
from sokuji.audio.vad_options import VadOptions
from sokuji.audio.vad_stream import VadStream, WavStreamDecoder
from sokuji.core.request import Priority
from sokuji.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType
from sokuji.media import audio
from sokuji.media.engine import MediaJob, StageClock

DATA = Path(__file__).resolve().parent.parent / "data" / "media" / "audio"
WAVS = sorted(p.name for p in DATA.iterdir() if p.suffix == ".wav")
PARAMS: list[dict[str, Any]] = [
    {}, {"max_speech_duration_s": 1.0}, {"speech_pad_ms": 200, "min_silence_duration_ms": 50},
    {"threshold": 0.3, "max_speech_duration_s": 2.0, "speech_pad_ms": 100}]


@pytest.fixture(scope="module")
def engine() -> Iterator[VadEngine]:
    eng = VadEngine("vad", VadOptions())
    eng.load()
    eng.start()
    yield eng
    eng.stop()
    eng.close()


def batch(eng: VadEngine, data: bytes, params: dict[str, Any]) -> list[tuple[int, int]]:
    import threading

    box: list[Any] = []
    called = threading.Event()

    def done(result: Any, error: BaseException | None) -> None:
        box.append((result, error))
        called.set()

    j = MediaJob(eng.decode(data, StageClock()), eng.parameters(params), StageClock(), None,
                 Priority.INTERACTIVE, done)
    eng.enqueue(j)
    assert called.wait(30)
    result, error = box[0]
    assert error is None
    return list(result.segments)


def streamed(eng: VadEngine, data: bytes, params: dict[str, Any], rng: random.Random,
             most: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Segments, and the 16 kHz samples the stream had seen when each was emitted (-1: at
    ``finish``)."""
    stream = VadStream(eng, params)
    out: list[tuple[int, int]] = []
    seen: list[int] = []
    i = 0
    while i < len(data):
        n = rng.randint(1, most)
        for s in stream.feed(data[i:i + n]):
            out.append((s["start_sample"], s["end_sample"]))
            seen.append(stream.samples_16k)
        i += n
    for s in stream.finish():
        out.append((s["start_sample"], s["end_sample"]))
        seen.append(-1)
    return out, seen


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("name", WAVS)
def test_streamed_equals_batch(engine: VadEngine, name: str, params: dict[str, Any]) -> None:
    data = (DATA / name).read_bytes()
    ref = batch(engine, data, params)
    rng = random.Random(f"{name}{params}")
    for most in (7, 5000, 70000):
        got, _ = streamed(engine, data, params, rng, most)
        assert got == ref


def frames_fed(eng: VadEngine, data: bytes, params: dict[str, Any]
               ) -> tuple[list[tuple[int, int]], list[int]]:
    """Fed one 512-sample frame of a 16 kHz mono 16-bit WAV at a time."""
    stream = VadStream(eng, params)
    out, seen = [], []
    chunks = [data[:44]] + [data[i:i + 1024] for i in range(44, len(data), 1024)]
    for chunk in chunks:
        for s in stream.feed(chunk):
            out.append((s["start_sample"], s["end_sample"]))
            seen.append(stream.samples_16k)
    for s in stream.finish():
        out.append((s["start_sample"], s["end_sample"]))
        seen.append(-1)
    return out, seen


def test_with_defaults_a_segment_is_final_when_its_silence_reaches_min_silence(
        engine: VadEngine) -> None:
    data = (DATA / "talk16k.wav").read_bytes()
    got, seen = frames_fed(engine, data, {})
    assert got == batch(engine, data, {}) and len(got) == 3
    pad, min_silence = 480, 1600
    for (_, end), at in zip(got, seen, strict=True):
        raw_end = end - pad  # these gaps are over two pads: each side got one
        # silero closes the segment at the first frame that starts min_silence or more after
        # its raw end; the stream emits it in the feed that completed that frame: the pad
        # rule could not change it any more.
        closing_frame_start = -(-(raw_end + min_silence) // 512) * 512
        assert at == closing_frame_start + 512, (end, at)


def test_a_long_pad_defers_emission_but_stays_exact(engine: VadEngine) -> None:
    data = (DATA / "talk16k.wav").read_bytes()
    params = {"speech_pad_ms": 200}  # two pads (6400 samples) > min_silence (1600)
    got, seen = frames_fed(engine, data, params)
    assert got == batch(engine, data, params)
    pad = 3200
    deferred = [at for (_, end), at in zip(got, seen, strict=True)
                if at != -1 and at >= end - pad + 2 * pad]
    assert deferred, "some segment had to wait for two pads of audio after its raw end"


def test_a_segment_open_at_the_end_waits_for_finish(engine: VadEngine) -> None:
    x, _ = audio.decode((DATA / "talk16k.wav").read_bytes())
    data = audio.pack_wav(x[:int(7.0 * 16000)], 16000)  # cut inside the second sentence
    got, seen = frames_fed(engine, data, {})
    assert got == batch(engine, data, {}) and len(got) == 2
    assert seen[0] != -1 and seen[-1] == -1


def test_flac_is_refused_with_the_reason(engine: VadEngine) -> None:
    stream = VadStream(engine)
    with pytest.raises(UnsupportedMediaType, match="FLAC cannot be streamed"):
        stream.feed((DATA / "talk16k.flac").read_bytes()[:100])


def test_limits_are_checked_as_the_stream_goes() -> None:
    with pytest.raises(InvalidInput, match=r"sample rate 4000 Hz not supported"):
        WavStreamDecoder().feed(audio.pack_wav(np.zeros(100, np.float32), 4000)[:50])
    data = (DATA / "talk16k.wav").read_bytes()
    limits = audio.AudioLimits(max_audio_s=5)
    with pytest.raises(PayloadTooLarge, match=r"limit 5 s"):  # from the header
        WavStreamDecoder(limits).feed(data[:44])
    unknown = bytearray(data)
    unknown[40:44] = struct.pack("<I", audio.UNKNOWN_SIZE)
    decoder = WavStreamDecoder(limits)
    fed = 0
    with pytest.raises(PayloadTooLarge, match=r"audio is over 5\.[01] s, limit 5 s"):
        for i in range(0, len(unknown), 4096):
            decoder.feed(bytes(unknown[i:i + 4096]))
            fed = i + 4096
    assert fed < 6 * 16000 * 2, "refused as the limit passed, not at the end"


def test_a_truncated_stream_fails_at_finish(engine: VadEngine) -> None:
    data = (DATA / "talk16k.wav").read_bytes()
    stream = VadStream(engine)
    stream.feed(data[:20000])
    with pytest.raises(InvalidInput, match=r"truncated WAV: header says 153360 frames, "
                                           r"body has 9978"):
        stream.finish()
    with pytest.raises(InvalidInput, match="ends inside its header"):
        s = VadStream(engine)
        s.feed(data[:30])
        s.finish()
    with pytest.raises(InvalidInput, match="empty audio body"):
        VadStream(engine).finish()


def test_stream_parameters_are_checked(engine: VadEngine) -> None:
    with pytest.raises(InvalidInput, match="'threshold'"):
        VadStream(engine, {"threshold": 2})
