"""sokuji/media/audio.py: every refusal before decoding (415 / 413 / 400, each naming the
problem), and decoding equal to libsndfile's float32 for every fixture and encoding."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from sokuji.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType
from sokuji.media import audio

DATA = Path(__file__).resolve().parent.parent / "data" / "media" / "audio"
FIXTURES = {
    # file: (format, rate, channels, subtype)
    "talk16k.wav": ("wav", 16000, 1, "PCM_16"),
    "talk16k.flac": ("flac", 16000, 1, "PCM_16"),
    "talk8k.wav": ("wav", 8000, 1, "PCM_16"),
    "talk22k_cut.wav": ("wav", 22050, 1, "PCM_16"),
    "talk44k_stereo_cut.wav": ("wav", 44100, 2, "PCM_16"),
    "talk48k_cut.wav": ("wav", 48000, 1, "PCM_16"),
    "talk16k_float.wav": ("wav", 16000, 1, "FLOAT"),
    "talk16k_24bit.wav": ("wav", 16000, 1, "PCM_24"),
    "silence.wav": ("wav", 22050, 1, "PCM_16"),
}


def read(name: str) -> bytes:
    return (DATA / name).read_bytes()


def libsndfile_mono(data: bytes) -> np.ndarray:
    x, _ = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return x.mean(axis=1, dtype=np.float32) if x.shape[1] > 1 else x[:, 0]


def written(x: np.ndarray, rate: int, subtype: str, fmt: str = "WAV") -> bytes:
    bio = io.BytesIO()
    sf.write(bio, x, rate, subtype=subtype, format=fmt)
    return bio.getvalue()


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_decodes_like_libsndfile(name: str) -> None:
    data = read(name)
    fmt, rate, channels, subtype = FIXTURES[name]
    x, info = audio.decode(data)
    ref = sf.info(io.BytesIO(data))
    assert (info.format, info.sample_rate, info.channels, info.subtype) == (
        fmt, rate, channels, subtype)
    assert info.frames == ref.frames and info.duration_s == pytest.approx(ref.duration)
    assert x.dtype == np.float32 and x.ndim == 1
    assert np.array_equal(x, libsndfile_mono(data))


def test_flac_of_the_wav_samples_decodes_equal() -> None:
    x, _ = audio.decode(read("talk16k.wav"))
    for subtype in ("PCM_16", "PCM_24"):
        y, info = audio.decode(written(x, 16000, subtype, "FLAC"))
        assert info.format == "flac" and np.array_equal(x, y)


@pytest.mark.parametrize("subtype", ["PCM_U8", "PCM_16", "PCM_24", "PCM_32", "FLOAT"])
@pytest.mark.parametrize("fmt", ["WAV", "WAVEX"])
def test_every_wav_encoding_in_stereo(subtype: str, fmt: str) -> None:
    x, _ = audio.decode(read("talk22k_cut.wav"))
    data = written(np.stack([x, -0.5 * x], axis=1), 22050, subtype, fmt)
    y, info = audio.decode(data)
    assert info.subtype == subtype and info.channels == 2
    assert np.array_equal(y, libsndfile_mono(data))


@pytest.mark.parametrize(("data", "what"), [
    (b"\x89PNG\r\n\x1a\n" + b"\0" * 100, "png"),
    (bytes(range(256)) * 4, "garbage"),
    (b"", "empty"),
    (b"OggS" + b"\0" * 100, "ogg magic"),
    (b"ID3\x03\x00\x00\x00\x00\x00\x00" + b"\x55" * 200, "id3 then garbage"),
])
def test_not_wav_or_flac_is_415(data: bytes, what: str) -> None:
    with pytest.raises(UnsupportedMediaType, match="not WAV or FLAC"):
        audio.probe(data)


@pytest.mark.parametrize("fmt", ["MP3", "OGG"])
def test_real_mp3_and_ogg_are_415(fmt: str) -> None:
    x, _ = audio.decode(read("talk16k.wav"))
    data = written(x[:16000], 16000, "MPEG_LAYER_III" if fmt == "MP3" else "VORBIS", fmt)
    with pytest.raises(UnsupportedMediaType, match="not WAV or FLAC"):
        audio.probe(data)
    # An ID3 tag in front does not smuggle it in either: libsndfile says what it is.
    with pytest.raises(UnsupportedMediaType, match="not WAV or FLAC"):
        audio.probe(b"ID3\x03\x00\x00\x00\x00\x00\x00" + data)


@pytest.mark.parametrize(("subtype", "what"), [
    ("ULAW", "format code 7"), ("ALAW", "format code 6"), ("DOUBLE", "64-bit float"),
    ("IMA_ADPCM", "format code 17")])
def test_unsupported_wav_encodings_are_415(subtype: str, what: str) -> None:
    data = written(np.zeros(1600, np.float32), 16000, subtype)
    with pytest.raises(UnsupportedMediaType, match=what):
        audio.probe(data)


def test_too_long_is_413_naming_seconds_and_limit() -> None:
    limits = audio.AudioLimits(max_audio_s=5)
    for name in ("talk16k.wav", "talk16k.flac"):
        with pytest.raises(PayloadTooLarge, match=r"audio is 9\.6 s, limit 5 s"):
            audio.decode(read(name), limits)
    # A header that claims an hour is refused from the header, body or not.
    head = read("talk16k.wav")[:44]
    lying = head[:40] + struct.pack("<I", 3600 * 16000 * 2) + b"\0" * 1000
    with pytest.raises(PayloadTooLarge, match=r"audio is 3600\.0 s, limit 600 s"):
        audio.probe(lying)


def test_default_limit_is_600_s() -> None:
    assert audio.AudioLimits().max_audio_s == 600
    ten_minutes_and_a_bit = audio.pack_wav(np.zeros(int(600.5 * 8000), np.float32), 8000)
    with pytest.raises(PayloadTooLarge, match=r"600\.5 s, limit 600 s"):
        audio.probe(ten_minutes_and_a_bit)


@pytest.mark.parametrize("rate", [4000, 7999, 192001, 384000])
def test_sample_rate_out_of_range_is_400(rate: int) -> None:
    data = audio.pack_wav(np.zeros(800, np.float32), rate)
    with pytest.raises(InvalidInput, match=rf"sample rate {rate} Hz not supported "
                                           r"\(8000-192000\)"):
        audio.probe(data)


def test_rate_limits_accept_the_ends() -> None:
    for rate in (8000, 192000):
        assert audio.probe(audio.pack_wav(np.zeros(800, np.float32), rate)).sample_rate == rate


def test_too_many_channels_is_400() -> None:
    data = audio.pack_wav(np.zeros((100, 9), np.float32), 16000)
    with pytest.raises(InvalidInput, match="9 channels"):
        audio.probe(data)
    assert audio.probe(audio.pack_wav(np.zeros((100, 8), np.float32), 16000)).channels == 8


def test_truncated_wav_is_400_with_both_counts() -> None:
    data = read("talk16k.wav")
    with pytest.raises(InvalidInput, match=r"truncated WAV: header says 153360 frames, "
                                           r"body has 76658"):
        audio.decode(data[:44 + 76658 * 2 + 1])
    with pytest.raises(InvalidInput, match="truncated WAV"):
        audio.probe(data[:30])  # inside the header


def test_wav_without_fmt_chunk_is_400() -> None:
    data = b"RIFF" + struct.pack("<I", 12) + b"WAVE" + b"data" + struct.pack("<I", 0)
    with pytest.raises(InvalidInput, match="no fmt chunk"):
        audio.probe(data)


def test_wav_of_unknown_length_reads_what_is_present() -> None:
    data = bytearray(read("talk16k.wav"))
    data[40:44] = struct.pack("<I", audio.UNKNOWN_SIZE)
    x, info = audio.decode(bytes(data))
    assert info.frames == 153360 and np.array_equal(x, audio.decode(read("talk16k.wav"))[0])


def test_truncated_flac_is_400() -> None:
    data = read("talk16k.flac")
    for cut in (len(data) // 2, len(data) - 100, 2000):
        with pytest.raises(InvalidInput, match="lost sync"):
            audio.decode(data[:cut])
    with pytest.raises(InvalidInput, match=r"truncated FLAC: header says 153360 frames, "
                                           r"body has 0"):
        audio.decode(data[:60])  # STREAMINFO and nothing else


def unknown_total(flac: bytes) -> bytes:
    """The FLAC with STREAMINFO's total sample count zeroed (as streaming encoders write)."""
    b = bytearray(flac)
    assert b[:4] == b"fLaC" and b[4] & 0x7F == 0  # the first block is STREAMINFO
    b[21] &= 0xF0
    b[22:26] = b"\0\0\0\0"
    return bytes(b)


def test_flac_of_unknown_length_is_bounded_while_decoding() -> None:
    data = unknown_total(read("talk16k.flac"))
    assert audio.probe(data).frames is None
    x, info = audio.decode(data)
    assert info.frames == 153360 and np.array_equal(x, audio.decode(read("talk16k.flac"))[0])
    with pytest.raises(PayloadTooLarge, match=r"audio is over 5\.0 s, limit 5 s"):
        audio.decode(data, audio.AudioLimits(max_audio_s=5))


def test_resample_hq_keeps_length_and_pitch() -> None:
    rate = 44100
    t = np.arange(rate, dtype=np.float64) / rate
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    y = audio.resample(tone, rate, 16000)
    assert y.dtype == np.float32 and len(y) == 16000
    spectrum = np.abs(np.fft.rfft(y))
    assert int(np.argmax(spectrum)) == 440  # 1 s of signal: bin k is k Hz
    x = np.ones(10, np.float32)
    assert audio.resample(x, 16000, 16000) is x


def test_pcm_24_sign_and_scale() -> None:
    body = bytes([0xFF, 0xFF, 0x7F, 0x00, 0x00, 0x80, 0x01, 0x00, 0x00])
    assert audio.pcm_to_float(body, "PCM_24").tolist() == [
        (2**23 - 1) / 2**23, -1.0, 1 / 2**23]
