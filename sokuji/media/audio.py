"""Audio files in, float32 samples out: WAV and FLAC only, every limit checked from the header
before a sample is decoded.

- **Format** from the first bytes: ``RIFF....WAVE`` is WAV, ``fLaC`` (or an ID3 tag that
  libsndfile then reads as FLAC) is FLAC; anything else (MP3, OGG, PNG, garbage) is 415 before
  any decoder sees it.
- **WAV** is parsed here (``parse_wav_header``; the streaming decoder shares it): PCM 8/16/24/
  32-bit integer and 32-bit float, plain or WAVE_FORMAT_EXTENSIBLE; other encodings are 415.
  Samples are converted with numpy exactly as libsndfile converts them to float32 (tested).
  Neither stdlib ``wave`` (no float WAV) nor libsndfile (which silently reports only the frames
  present) can tell a truncated file: the header's ``data`` size against the bytes present
  can (400 naming both).
- **FLAC** goes through soundfile (libsndfile 1.2.2, bundled in its wheel): STREAMINFO gives
  the rate, channels and total frames before decoding. A FLAC whose total is unknown (0, as
  streaming encoders write) is read at most ``max_audio_s`` + 1 frames deep, then refused
  (413) if longer. A truncated FLAC ("lost sync", or fewer frames than STREAMINFO) is 400.
- **Limits** (``AudioLimits``): duration (413 naming seconds and the limit), sample rate
  8000-192000 Hz, channels <= 8 (400). A header's rate of 0 is refused (400) where it is
  read, before anything divides by it; a duration is frames / rate of two header integers
  (never NaN), checked before a sample is decoded. Peak memory is the mono signal at the
  source rate plus one block: at most ``max_audio_s`` x rate x 4 bytes (600 s at 192 kHz:
  460 MB); after resampling to 16 kHz, at most ``max_audio_s`` x 16000 samples
  (``samples_at``, checked before resampling).
- **Downmix** by the mean of the channels (as silero's ``read_audio``); **resample** with
  soxr HQ (chunk-invariant: its streaming resampler gives the same samples, tested).
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

import numpy as np

from sokuji.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType

MAX_WAV_HEADER_BYTES = 1 << 20
"""Chunks before ``data`` beyond this are refused (400): a header is a few hundred bytes."""
MEDIA_TYPES = ("audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave", "audio/flac",
               "audio/x-flac", "application/octet-stream")
"""What audio may be uploaded as (the file itself as the body; the header decides)."""
NOT_WAV_OR_FLAC = "not WAV or FLAC (send audio/wav or audio/flac)"
UNKNOWN_SIZE = 0xFFFFFFFF
"""A ``data`` size written by a streaming encoder that could not seek back: read what is
present."""
_EXTENSIBLE = 0xFFFE
_GUID_TAIL = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
_SUBTYPES = {(1, 8): "PCM_U8", (1, 16): "PCM_16", (1, 24): "PCM_24", (1, 32): "PCM_32",
             (3, 32): "FLOAT"}
_FLAC_BLOCK_FRAMES = 65536


@dataclass(frozen=True, slots=True)
class AudioLimits:
    max_audio_s: float = 600.0
    min_rate_hz: int = 8000
    max_rate_hz: int = 192000
    max_channels: int = 8

    @property
    def max_source_bytes(self) -> int:
        """The most bytes one file's mono float32 signal holds at its source rate."""
        return int(self.max_audio_s * self.max_rate_hz) * 4


def samples_at(frames: int, from_hz: int, to_hz: int) -> int:
    """How many samples ``frames`` at ``from_hz`` become at ``to_hz`` (soxr's count:
    rounded; an upper bound within one sample). Integers only: nothing to divide by 0
    (``from_hz`` > 0 is the header check's)."""
    return (frames * to_hz + from_hz // 2) // from_hz


DEFAULT_LIMITS = AudioLimits()


@dataclass(frozen=True, slots=True)
class AudioInfo:
    format: str
    """``wav`` or ``flac``."""
    sample_rate: int
    channels: int
    frames: int | None
    """From the header; None for a FLAC that does not say (bounded while decoding)."""
    duration_s: float | None
    subtype: str
    """PCM_U8, PCM_16, PCM_24, PCM_32, FLOAT (WAV); libsndfile's for FLAC."""
    data_offset: int = 0
    """WAV: where the samples start."""


def _u16(b: bytes | bytearray, at: int) -> int:
    return int.from_bytes(b[at:at + 2], "little")


def _u32(b: bytes | bytearray, at: int) -> int:
    return int.from_bytes(b[at:at + 4], "little")


def parse_wav_header(head: bytes | bytearray) -> tuple[AudioInfo, int] | None:
    """The WAV header at the start of ``head``: (info with ``frames`` from the data size, or
    None when the size is ``UNKNOWN_SIZE``; the data chunk's size in bytes). None when
    ``head`` ends before the ``data`` chunk begins (a stream: wait for more). Raises 415 for
    an unsupported encoding, 400 for a malformed header."""
    if len(head) < 12:
        return None
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        raise UnsupportedMediaType(NOT_WAV_OR_FLAC)
    pos = 12
    fmt: tuple[int, int, int, int] | None = None  # (code, channels, rate, bits)
    while True:
        if pos > MAX_WAV_HEADER_BYTES:
            raise InvalidInput(f"WAV has over {MAX_WAV_HEADER_BYTES} bytes of chunks before "
                               f"its data")
        if len(head) < pos + 8:
            return None
        chunk, size = bytes(head[pos:pos + 4]), _u32(head, pos + 4)
        if chunk == b"data":
            break
        if chunk == b"fmt ":
            if len(head) < pos + 8 + min(size, 40):
                return None
            fmt = _parse_fmt(head[pos + 8:pos + 8 + min(size, 40)], size)
        pos += 8 + size + (size & 1)
    if fmt is None:
        raise InvalidInput("WAV has no fmt chunk before its data")
    code, channels, rate, bits = fmt
    block_align = channels * bits // 8
    frames = None if size == UNKNOWN_SIZE else size // block_align
    info = AudioInfo("wav", rate, channels, frames,
                     None if frames is None else frames / rate,
                     _SUBTYPES[code, bits], pos + 8)
    return info, size


def _parse_fmt(fmt: bytes | bytearray, size: int) -> tuple[int, int, int, int]:
    if size < 16:
        raise InvalidInput(f"WAV fmt chunk is {size} bytes (at least 16)")
    code, channels, rate = _u16(fmt, 0), _u16(fmt, 2), _u32(fmt, 4)
    bits = _u16(fmt, 14)
    if code == _EXTENSIBLE:
        if size < 40 or bytes(fmt[26:40]) != _GUID_TAIL:
            raise UnsupportedMediaType("WAV_FORMAT_EXTENSIBLE with an unknown sub-format")
        code = _u16(fmt, 24)
    if (code, bits) not in _SUBTYPES:
        what = {1: f"{bits}-bit PCM", 3: f"{bits}-bit float"}.get(code, f"format code {code}")
        raise UnsupportedMediaType(f"WAV encoding {what} not supported (send PCM 8/16/24/"
                                   f"32-bit integer or 32-bit float)")
    if channels < 1:
        raise InvalidInput("WAV header says 0 channels")
    if rate < 1:  # before anything divides by it (frames / rate)
        raise InvalidInput("WAV header says sample rate 0 Hz", param="audio")
    return code, channels, rate, bits


def check_limits(info: AudioInfo, limits: AudioLimits) -> None:
    if not limits.min_rate_hz <= info.sample_rate <= limits.max_rate_hz:
        raise InvalidInput(f"sample rate {info.sample_rate} Hz not supported "
                           f"({limits.min_rate_hz}-{limits.max_rate_hz})")
    if info.channels > limits.max_channels:
        raise InvalidInput(f"audio has {info.channels} channels (at most "
                           f"{limits.max_channels})")
    if info.duration_s is not None and info.duration_s > limits.max_audio_s:
        raise too_long(info.duration_s, limits)


def too_long(duration_s: float, limits: AudioLimits, at_least: bool = False) -> PayloadTooLarge:
    return PayloadTooLarge(f"audio is {'over ' if at_least else ''}{duration_s:.1f} s, "
                           f"limit {limits.max_audio_s:g} s (options.max_audio_s)",
                           param="options.max_audio_s")


def probe(data: bytes, limits: AudioLimits = DEFAULT_LIMITS) -> AudioInfo:
    """Format, rate, channels and length from the header only, every limit checked (415 not
    WAV/FLAC or an unsupported encoding; 413 too long; 400 rate, channels, truncated)."""
    if data[:4] == b"RIFF":
        parsed = parse_wav_header(data)
        if parsed is None:
            raise InvalidInput("truncated WAV: the file ends inside its header")
        info, size = parsed
        block_align = info.channels * bits_of(info) // 8
        present = len(data) - info.data_offset
        if info.frames is None:
            info = _with_frames(info, present // block_align)
        check_limits(info, limits)  # first: a header claiming hours is 413, truncated or not
        if size != UNKNOWN_SIZE and present < size:
            raise InvalidInput(f"truncated WAV: header says {info.frames} frames, body has "
                               f"{present // block_align}")
        return info
    if data[:4] == b"fLaC" or data[:3] == b"ID3":
        info = _probe_flac(data)
        check_limits(info, limits)
        return info
    raise UnsupportedMediaType(NOT_WAV_OR_FLAC)


def bits_of(info: AudioInfo) -> int:
    return 8 if info.subtype == "PCM_U8" else int(info.subtype[-2:]) if info.subtype.startswith(
        "PCM") else 32


def _with_frames(info: AudioInfo, frames: int) -> AudioInfo:
    return AudioInfo(info.format, info.sample_rate, info.channels, frames,
                     frames / info.sample_rate, info.subtype, info.data_offset)


def _probe_flac(data: bytes) -> AudioInfo:
    import soundfile as sf

    try:
        raw = sf.info(io.BytesIO(data))
    except (RuntimeError, ValueError) as exc:  # LibsndfileError is a RuntimeError
        if data[:4] != b"fLaC":  # an ID3 tag before something libsndfile cannot read
            raise UnsupportedMediaType(NOT_WAV_OR_FLAC) from exc
        reason = getattr(exc, "error_string", str(exc)).removeprefix("Error : ").rstrip(".")
        raise InvalidInput(f"corrupt FLAC: {reason}") from exc
    if raw.format != "FLAC":
        raise UnsupportedMediaType(NOT_WAV_OR_FLAC)
    if raw.samplerate < 1 or raw.channels < 1:
        raise InvalidInput(f"FLAC header says {raw.samplerate} Hz x {raw.channels} channels")
    # libsndfile reports an unknown total (STREAMINFO 0) as SF_COUNT_MAX.
    frames = None if raw.frames >= (1 << 62) or raw.frames <= 0 else int(raw.frames)
    return AudioInfo("flac", int(raw.samplerate), int(raw.channels), frames,
                     None if frames is None else frames / raw.samplerate, raw.subtype)


def pcm_to_float(body: bytes | bytearray | memoryview, subtype: str) -> np.ndarray:
    """Interleaved little-endian PCM to float32, as libsndfile scales it (a power of two per
    width, so each value is exact)."""
    if subtype == "PCM_16":
        return np.frombuffer(body, "<i2").astype(np.float32) * np.float32(1 / 32768)
    if subtype == "FLOAT":
        return np.frombuffer(body, "<f4").astype(np.float32)
    if subtype == "PCM_32":
        return np.frombuffer(body, "<i4").astype(np.float32) * np.float32(1 / 2147483648)
    if subtype == "PCM_U8":
        return (np.frombuffer(body, np.uint8).astype(np.float32) - np.float32(128)) * \
            np.float32(1 / 128)
    if subtype == "PCM_24":
        b = np.frombuffer(body, np.uint8).reshape(-1, 3)
        wide = np.zeros((len(b), 4), np.uint8)
        wide[:, 1:] = b  # the 24 bits in the top of an int32: value x 256, sign included
        return wide.view("<i4").reshape(-1).astype(np.float32) * np.float32(1 / 2147483648)
    raise AssertionError(subtype)


def downmix(x: np.ndarray, channels: int) -> np.ndarray:
    """Interleaved samples to mono by the mean of the channels (silero's ``read_audio``)."""
    if channels == 1:
        return x
    frames = x.reshape(-1, channels)
    # Column by column (numpy's ``mean(axis=1)`` is ~10x slower on a short axis); a frame's
    # value depends on that frame alone, so any chunking of a stream gives the same samples.
    mono = frames[:, 0].copy()
    for c in range(1, channels):
        mono += frames[:, c]
    mono /= np.float32(channels)
    return mono


def decode(data: bytes, limits: AudioLimits = DEFAULT_LIMITS) -> tuple[np.ndarray, AudioInfo]:
    """``probe`` (every limit), then the samples: float32 mono at the source rate."""
    info = probe(data, limits)
    if info.format == "wav":
        assert info.frames is not None
        block_align = info.channels * bits_of(info) // 8
        body = memoryview(data)[info.data_offset:info.data_offset + info.frames * block_align]
        return downmix(pcm_to_float(body, info.subtype), info.channels), info
    return _decode_flac(data, info, limits)


def _decode_flac(data: bytes, info: AudioInfo,
                 limits: AudioLimits) -> tuple[np.ndarray, AudioInfo]:
    import soundfile as sf

    max_frames = int(limits.max_audio_s * info.sample_rate)
    want = info.frames if info.frames is not None else max_frames + 1
    out = np.empty(min(want, max_frames + 1), np.float32)
    got = 0
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            block = np.empty((_FLAC_BLOCK_FRAMES, info.channels), np.float32)
            while got < len(out):
                n = _read_block(sf, f, block, min(_FLAC_BLOCK_FRAMES, len(out) - got))
                if n == 0:
                    break
                out[got:got + n] = downmix(block[:n].reshape(-1), info.channels)
                got += n
    except sf.LibsndfileError as exc:
        raise InvalidInput("truncated or corrupt FLAC: "
                           + exc.error_string.removeprefix("Error : ").rstrip(".")) from exc
    if info.frames is None:
        if got > max_frames:
            raise too_long(got / info.sample_rate, limits, at_least=True)
        info = _with_frames(info, got)
    elif got < info.frames:
        raise InvalidInput(f"truncated FLAC: header says {info.frames} frames, body has {got}")
    return out[:got], info


def _read_block(sf: object, f: object, block: np.ndarray, frames: int) -> int:
    """Read up to ``frames`` frames into ``block``; returns how many. Calls libsndfile's
    ``sf_readf_float`` through soundfile's own cffi handle: ``SoundFile.read`` seeks after
    every read, and libsndfile cannot seek in a FLAC without a total frame count (it raises
    "psf_fseek() failed" after reading the last block)."""
    snd, ffi = sf._snd, sf._ffi  # type: ignore[attr-defined]
    n = snd.sf_readf_float(f._file, ffi.cast("float *", block.ctypes.data),  # type: ignore[attr-defined]
                           frames)
    err = snd.sf_error(f._file)  # type: ignore[attr-defined]
    if err:
        raise sf.LibsndfileError(err)  # type: ignore[attr-defined]
    return int(n)


def resample(x: np.ndarray, from_hz: int, to_hz: int = 16000) -> np.ndarray:
    """soxr HQ; the input itself when the rates are equal."""
    if from_hz == to_hz:
        return x
    import soxr

    return np.asarray(soxr.resample(x, from_hz, to_hz, "HQ"), dtype=np.float32)


def pack_wav(x: np.ndarray, rate_hz: int, subtype: str = "PCM_16") -> bytes:
    """A WAV file of float samples in [-1, 1) (tests and warm-up)."""
    x = np.asarray(x, np.float32)
    channels = 1 if x.ndim == 1 else x.shape[1]
    if subtype == "FLOAT":
        body, bits, code = x.astype("<f4").tobytes(), 32, 3
    else:
        body, bits, code = (np.clip(x * 32768, -32768, 32767).astype("<i2").tobytes(), 16, 1)
    fmt = struct.pack("<HHIIHH", code, channels, rate_hz, rate_hz * channels * bits // 8,
                      channels * bits // 8, bits)
    return (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(body)) + b"WAVE"
            + b"fmt " + struct.pack("<I", len(fmt)) + fmt
            + b"data" + struct.pack("<I", len(body)) + body)
