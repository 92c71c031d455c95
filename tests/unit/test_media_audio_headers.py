"""Lying audio headers (issue 25, finding 6): a WAV whose rate is 0 was a 500
ZeroDivisionError (``frames / rate`` before the limits were checked). Every header field
that sizes the work is checked where it is read, before anything divides by it or
allocates: a clear 400 or 413, through the file decoder, the stream decoder and the engine."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from sokuji.audio.vad import VadEngine
from sokuji.audio.vad_options import VadOptions
from sokuji.audio.vad_stream import WavStreamDecoder
from sokuji.core.limits import LimitExceeded
from sokuji.errors import InvalidInput, PayloadTooLarge, SokujiError
from sokuji.media import audio
from sokuji.media.engine import StageClock


def wav(rate: int, channels: int = 1, bits: int = 16, code: int = 1,
        data_bytes: int | None = None, body: bytes = b"\0" * 64) -> bytes:
    """A WAV whose header says what it is told to, whatever the body holds."""
    align = max(1, channels * bits // 8)
    fmt = struct.pack("<HHIIHH", code, channels, rate, (rate * align) & 0xFFFFFFFF,
                      align & 0xFFFF, bits)
    size = len(body) if data_bytes is None else data_bytes
    return (b"RIFF" + struct.pack("<I", 36 + len(body)) + b"WAVE" + b"fmt "
            + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", size) + body)


HOSTILE = [
    ("rate 0", wav(0), InvalidInput, "sample rate 0 Hz"),
    ("rate 0, unknown size", wav(0, data_bytes=audio.UNKNOWN_SIZE), InvalidInput,
     "sample rate 0 Hz"),
    ("rate 1", wav(1), InvalidInput, "sample rate 1 Hz not supported"),
    ("rate 4e9", wav(4_000_000_000), InvalidInput, "sample rate 4000000000 Hz"),
    ("rate 2^32-1", wav(0xFFFFFFFF), InvalidInput, "sample rate 4294967295 Hz"),
    ("0 channels", wav(16000, channels=0), InvalidInput, "0 channels"),
    ("65535 channels", wav(16000, channels=65535), InvalidInput, "65535 channels"),
    ("0 bits", wav(16000, bits=0), SokujiError, "0-bit PCM"),
    ("12 bits", wav(16000, bits=12), SokujiError, "12-bit PCM"),
    ("hours claimed", wav(8000, data_bytes=0xFFFFFFF0), PayloadTooLarge,
     "options.max_audio_s"),
]


@pytest.mark.parametrize(("what", "data", "error", "words"), HOSTILE,
                         ids=[h[0] for h in HOSTILE])
def test_a_lying_header_is_a_clear_4xx_everywhere(what: str, data: bytes,
                                                  error: type[SokujiError],
                                                  words: str) -> None:
    with pytest.raises(error, match=words) as err:
        audio.probe(data)
    assert 400 <= err.value.status < 500
    with pytest.raises(error, match=words):
        audio.decode(data)
    with pytest.raises(error, match=words):
        WavStreamDecoder().feed(data)
    engine = VadEngine("vad", VadOptions())  # no session: decode needs none
    with pytest.raises(error, match=words):
        engine.decode(data, StageClock())


def test_vad_limits_are_stated_and_movable() -> None:
    engine = VadEngine("vad", VadOptions(max_audio_s=60, max_rate_hz=48000, max_channels=2))
    got = {lim.key: lim.value for lim in engine.limits}
    assert got == {"options.max_audio_s": 60, "options.max_rate_hz": 48000,
                   "options.max_channels": 2, "source_bytes": 60 * 48000 * 4,
                   "samples_16k": 960_001}
    with pytest.raises(InvalidInput, match="96000 Hz"):
        engine.decode(audio.pack_wav(np.zeros(960, np.float32), 96000), StageClock())
    stereo = np.zeros((800, 3), np.float32)
    with pytest.raises(InvalidInput, match="3 channels"):
        engine.decode(audio.pack_wav(stereo, 16000), StageClock())


def test_the_samples_after_resampling_are_checked_before_resampling() -> None:
    engine = VadEngine("vad", VadOptions())
    small = engine.limits[-1].__class__("samples_16k", 100, "samples", "after resampling")
    engine._samples = small
    with pytest.raises(LimitExceeded, match="needs 160 samples") as err:
        engine.decode(audio.pack_wav(np.zeros(441, np.float32), 44100), StageClock())
    assert err.value.param == "samples_16k"
    assert audio.samples_at(441, 44100, 16000) == 160
    assert audio.samples_at(22050, 22050, 16000) == 16000
