"""silero-vad's sequence ONNX model without torch, and silero's rules around it: the file,
the session, frames to probabilities, a request's parameters, probabilities to segments.
Shared by the batch engine (``vad.py``) and the stream (``vad_stream.py``).

The model: ``silero_vad_16k_sequence.onnx`` from the installed ``silero-vad`` wheel, found with
``importlib.util.find_spec`` (importing ``silero_vad`` would import torch). Input ``[F, 576]``:
each 512-sample frame at 16 kHz after the last 64 samples of the frame before (zeros first),
the last frame zero-padded, as silero frames it; the LSTM state ``h``/``c`` carried from call
to call. Its probabilities are bit-identical to silero's ``OnnxWrapper`` over
``silero_vad.onnx`` one frame at a time, whatever the grouping of frames into calls (tested).
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from sokuji.audio.vad_options import VadOptions
from sokuji.audio.vad_segments import get_speech_timestamps_from_probs
from sokuji.errors import ConfigError, InvalidInput

MODEL_FILE = "silero_vad_16k_sequence.onnx"
RATE_HZ = 16000
FRAME = 512
CONTEXT = 64
MAX_FRAMES = 512
"""Frames per ONNX call (16.4 s of audio): silero's own default for the sequence model."""

PARAMETERS = ("threshold", "min_speech_duration_ms", "min_silence_duration_ms",
              "speech_pad_ms", "max_speech_duration_s")
"""Per-request V2 parameters (silero's arguments of the same names)."""
DEFAULTS: dict[str, float] = {k: getattr(VadOptions(), k) for k in PARAMETERS}
"""Their defaults where a model sets none (``VadOptions``)."""


def model_path() -> str:
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError.for_key("runtime", "vad", "needs the silero-vad package (install "
                                  "it with --no-deps: serving needs no torch)")
    return os.path.join(next(iter(spec.submodule_search_locations)), "data", MODEL_FILE)


def new_session(threads: int) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # Spinning threads steal the core that the event loop needs between calls.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model_path(), opts, providers=["CPUExecutionProvider"])


class FrameModel:
    """One stream through the sequence model: the context and LSTM state carried over
    calls, so frames may come in any grouping and give the same probabilities."""

    __slots__ = ("c", "context", "h", "session")

    def __init__(self, session: Any) -> None:
        self.session = session
        self.h = np.zeros((1, 1, 128), np.float32)
        self.c = np.zeros((1, 1, 128), np.float32)
        self.context = np.zeros(CONTEXT, np.float32)

    def run(self, frames: np.ndarray) -> np.ndarray:
        """``frames``: float32 ``[F, 512]``; returns F probabilities (float32)."""
        out = []
        for first in range(0, len(frames), MAX_FRAMES):
            block = frames[first:first + MAX_FRAMES]
            x = np.empty((len(block), CONTEXT + FRAME), np.float32)
            x[:, CONTEXT:] = block
            x[0, :CONTEXT] = self.context
            x[1:, :CONTEXT] = block[:-1, -CONTEXT:]
            self.context = block[-1, -CONTEXT:].copy()
            probs, self.h, self.c = self.session.run(
                ["speech_probs", "hn", "cn"], {"input": x, "h": self.h, "c": self.c})
            out.append(np.asarray(probs, np.float32).reshape(-1))
        return np.concatenate(out) if out else np.zeros(0, np.float32)


def frames_of(x16k: np.ndarray) -> np.ndarray:
    """The signal as ``[F, 512]`` frames, the last zero-padded (as silero pads it)."""
    count = -(-len(x16k) // FRAME)
    frames = np.zeros((count, FRAME), np.float32)
    frames.reshape(-1)[:len(x16k)] = x16k
    return frames


def number(key: str, value: Any, lo: float, hi: float, *, open_lo: bool = False,
            integer: bool = False) -> float:
    """``value`` if it is a number in range, else the reason (raised by the caller)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            integer and not isinstance(value, int)):
        raise ValueError(f"must be {'an integer' if integer else 'a number'}")
    ok = (lo < value if open_lo else lo <= value) and value <= hi
    if not ok or (math.isnan(value)):
        raise ValueError(f"must be {'>' if open_lo else '>='} {lo:g} and <= {hi:g}")
    return value


RULES: dict[str, tuple[float, float, bool, bool]] = {
    # key: (lo, hi, open_lo, integer): a request's parameters (the options' are VadOptions)
    "threshold": (0, 1, True, False),
    "min_speech_duration_ms": (0, 3_600_000, False, False),
    "min_silence_duration_ms": (0, 3_600_000, False, False),
    "speech_pad_ms": (0, 60_000, False, False),
    "max_speech_duration_s": (0, math.inf, True, False),
}


def check_parameters(raw: Mapping[str, Any], base: Mapping[str, float]) -> dict[str, float]:
    """silero's arguments for one request: ``base`` updated with the known keys of ``raw``,
    each checked (``InvalidInput`` naming the key)."""
    out = {k: base[k] for k in PARAMETERS}
    for key in PARAMETERS:
        if key in raw:
            lo, hi, open_lo, integer = RULES[key]
            try:
                out[key] = number(key, raw[key], lo, hi, open_lo=open_lo, integer=integer)
            except ValueError as exc:
                raise InvalidInput(f"parameter '{key}' {exc}", param=key) from None
            if key == "threshold" and out[key] >= 1:
                raise InvalidInput("parameter 'threshold' must be < 1", param=key)
    return out


def segment(probs: np.ndarray, n_samples: int, params: Mapping[str, float]) -> list[tuple[int,
                                                                                            int]]:
    speeches = get_speech_timestamps_from_probs(
        probs.tolist(), RATE_HZ, threshold=params["threshold"],
        min_speech_duration_ms=params["min_speech_duration_ms"],
        max_speech_duration_s=params["max_speech_duration_s"],
        min_silence_duration_ms=params["min_silence_duration_ms"],
        speech_pad_ms=params["speech_pad_ms"], audio_length_samples=n_samples)
    return [(int(s["start"]), int(s["end"])) for s in speeches]
