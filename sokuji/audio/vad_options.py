"""Runtime ``vad``'s options (``[models.options]``): ``VadOptions``, checked when the config
loads (``kinds/vad``). The last five are the defaults of the per-request parameters of the
same names (silero's ``get_speech_timestamps`` arguments; ``vad_model.PARAMETERS``)."""

from __future__ import annotations

import math
from typing import Annotated

from msgspec import Meta

from sokuji.config_types import _Table


class VadOptions(_Table, frozen=True):
    instances: Annotated[int, Meta(ge=1, le=64)] = 1
    """Worker threads, each with its own session."""
    threads: Annotated[int, Meta(ge=0, le=64)] = 0
    """Intra-op threads of each session; 0: the model's ``intra_op_threads`` (its kind fills
    it in), else 1."""
    max_audio_s: Annotated[float, Meta(gt=0, le=86400)] = 600.0
    """Seconds of one file (from its header, before decoding: 413)."""
    max_rate_hz: Annotated[int, Meta(ge=8000, le=768_000)] = 192_000
    """Sample rate of one file (from its header: 400 past it, or under 8000 Hz)."""
    max_channels: Annotated[int, Meta(ge=1, le=64)] = 8
    """Channels of one file (from its header: 400 past it)."""
    priority_aging_ms: Annotated[float, Meta(ge=0, le=86_400_000)] = 1000.0
    """Default: the model's ``priority_aging_ms`` (its kind fills it in)."""
    threshold: Annotated[float, Meta(gt=0, lt=1)] = 0.5
    min_speech_duration_ms: Annotated[float, Meta(ge=0, le=3_600_000)] = 250.0
    min_silence_duration_ms: Annotated[float, Meta(ge=0, le=3_600_000)] = 100.0
    speech_pad_ms: Annotated[float, Meta(ge=0, le=60_000)] = 30.0
    max_speech_duration_s: Annotated[float, Meta(gt=0)] = math.inf
