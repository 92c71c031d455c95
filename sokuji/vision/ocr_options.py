"""The OCR engine's options (checked at start: ``ConfigError`` naming ``options.<key>``) and
its per-request V2 parameters (checked per request: ``InvalidInput`` naming the key).

Per request: ``text_score`` (drop lines scored below), ``box_thresh`` and ``unclip_ratio``
(det post-processing, run per image), ``use_cls`` (whether the image's crops go through the
orientation classifier). None of them changes a batch's shape, so all four apply per job
without touching cross-request batching.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from sokuji.errors import ConfigError, InvalidInput


@dataclass(frozen=True, slots=True)
class OcrOptions:
    det_threads: int = 1
    """Intra-op threads of the det session (default: the model's ``intra_op_threads``, or 1)."""
    rec_threads: int = 1
    """Intra-op threads of the cls and rec sessions (same default)."""
    rec_max_batch: int = 8
    rec_max_pixels: int = 2560
    """A rec batch's budget: items x padded width (8 crops at 320, 4 at 640, 2 at 960); 0:
    none.
    Measured (1 thread, real rec model): per crop, a batch is never cheaper than one crop
    alone, and above ~2560 it gets dearer (W=640: 24 ms a crop up to b4, 30-33 ms at b6;
    W=960: 36 ms alone, 47-50 ms at b4); up to 2560 it costs the same."""
    cross_request_batching: bool = True
    max_pixels: int = 25_000_000
    max_side: int = 20_000
    text_score: float = 0.5
    box_thresh: float = 0.5
    unclip_ratio: float = 1.6
    use_cls: bool = True
    priority_aging_ms: float = 1000.0

    @classmethod
    def parse(cls, options: Mapping[str, Any], intra_op_threads: int) -> OcrOptions:
        known = {f.name for f in fields(cls)}
        for key in options:
            if key not in known:
                raise ConfigError.for_key(f"options.{key}", options[key],
                                          f"unknown OCR option; known: {', '.join(sorted(known))}")
        threads = intra_op_threads if intra_op_threads > 0 else 1
        values: dict[str, Any] = {"det_threads": threads, "rec_threads": threads}
        for key, value in options.items():
            values[key] = _checked(key, value)
        return cls(**values)


_INTS = {"det_threads": (1, 64), "rec_threads": (1, 64), "rec_max_batch": (1, 256),
         "rec_max_pixels": (0, 10_000_000), "max_pixels": (1, 1_000_000_000),
         "max_side": (1, 1_000_000)}
_UNIT = ("text_score", "box_thresh")
_BOOLS = ("cross_request_batching", "use_cls")


def _checked(key: str, value: Any) -> Any:
    def bad(reason: str) -> ConfigError:
        return ConfigError.for_key(f"options.{key}", value, reason)

    if key in _INTS:
        lo, hi = _INTS[key]
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise bad(f"must be an integer from {lo} to {hi}")
        return value
    if key in _BOOLS:
        if not isinstance(value, bool):
            raise bad("must be true or false")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad("must be a number")
    value = float(value)
    if key in _UNIT and not 0.0 <= value <= 1.0:
        raise bad("must be from 0 to 1")
    if key == "unclip_ratio" and not 0.0 < value <= 10.0:
        raise bad("must be above 0 and at most 10")
    if key == "priority_aging_ms" and value < 0:
        raise bad("must be zero or more")
    return value


def request_parameters(raw: Mapping[str, Any], o: OcrOptions) -> dict[str, Any]:
    """The request's known parameters, checked (``InvalidInput`` naming the key), over the
    model's defaults."""
    out: dict[str, Any] = {"text_score": o.text_score, "box_thresh": o.box_thresh,
                           "unclip_ratio": o.unclip_ratio, "use_cls": o.use_cls}
    for key in out:
        if key not in raw:
            continue
        value = raw[key]
        if key == "use_cls":
            if not isinstance(value, bool):
                raise InvalidInput(f"parameter '{key}' must be true or false", param=key)
            out[key] = value
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidInput(f"parameter '{key}' must be a number", param=key)
        value = float(value)
        ok = (0.0 < value <= 10.0) if key == "unclip_ratio" else (0.0 <= value <= 1.0)
        if not ok:
            limits = "above 0 and at most 10" if key == "unclip_ratio" else "from 0 to 1"
            raise InvalidInput(f"parameter '{key}' must be {limits}; got {value}", param=key)
        out[key] = value
    return out
