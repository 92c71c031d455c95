"""The OCR engine's options (``OcrOptions``: checked when the config loads, ``ConfigError``
naming ``models[i].options.<key>``) and its per-request V2 parameters (checked per request:
``InvalidInput`` naming the key).

Per request: ``text_score`` (drop lines scored below), ``box_thresh`` and ``unclip_ratio``
(det post-processing, run per image), ``use_cls`` (whether the image's crops go through the
orientation classifier). None of them changes a batch's shape, so all four apply per job
without touching cross-request batching.

The cost bound (``max_*``; ``OcrEngine.limits``, shown as ``limit.options.<key>`` in the
model's config): one image's decoded size, aspect ratio and pixels after every resize and
pad, checked from its header; its boxes, and the request's crops and rec widths summed over
its images, checked after det and before cls / rec. Past any: 413 naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from msgspec import Meta

from sokuji.config_types import ZeroOrMoreS, _Table, _why
from sokuji.errors import InvalidInput


def _ints(lo: int, hi: int) -> Meta:
    return _why(f"must be an integer from {lo} to {hi}", ge=lo, le=hi)


class OcrOptions(_Table, frozen=True):
    det_threads: Annotated[int, _ints(1, 64)] = 1
    """Intra-op threads of the det session (default: the model's ``intra_op_threads``, or 1:
    its kind fills it in)."""
    rec_threads: Annotated[int, _ints(1, 64)] = 1
    """Intra-op threads of the cls and rec sessions (same default)."""
    rec_max_batch: Annotated[int, _ints(1, 256)] = 8
    rec_max_pixels: Annotated[int, _ints(0, 10_000_000)] = 2560
    """A rec batch's budget: items x padded width (8 crops at 320, 4 at 640, 2 at 960); 0:
    none.
    Measured (1 thread, real rec model): per crop, a batch is never cheaper than one crop
    alone, and above ~2560 it gets dearer (W=640: 24 ms a crop up to b4, 30-33 ms at b6;
    W=960: 36 ms alone, 47-50 ms at b4); up to 2560 it costs the same."""
    cross_request_batching: bool = True
    max_pixels: Annotated[int, _ints(1, 1_000_000_000)] = 25_000_000
    """Pixels of one decoded image (from its header, before decoding)."""
    max_side: Annotated[int, _ints(1, 1_000_000)] = 20_000
    """The longest side of one decoded image, px (from its header)."""
    max_aspect_ratio: Annotated[float, _why("must be from 1 to 1000000", ge=1, le=1_000_000)] \
        = 64.0
    """One image's long side over its short side (from its header). rapidocr upscales a
    short side under 30 px to 30 and pads a wide image to 4:1, so a strip's work grows with
    the square of its ratio (a 2000 x 1 PNG of 80 bytes: a 15000 x 60000 det input). 64
    takes a 2000 x 32 line of text."""
    max_det_pixels: Annotated[int, _ints(1, 1_000_000_000)] = 4_500_000
    """Pixels of one image after every resize and pad: the larger of the letterboxed image
    and det's input, computed from the header before a pixel is decoded. Every image of
    aspect ratio up to 8 (rapidocr's letterbox ratio: documents, photos) needs at most
    4,333,568 (a 1 x 8 shape: 736 x 5888); a taller one needs 736 x 736 x its ratio.
    Measured, det on one thread: ~0.7 s and ~180 MB a megapixel."""
    max_boxes: Annotated[int, _ints(1, 1000)] = 1000
    """Text boxes of one image (rapidocr's det looks for at most 1000)."""
    max_crops: Annotated[int, _ints(1, 1_000_000)] = 1000
    """Crops of one request, summed over its images, counted after det and before cls /
    rec: the recognition work (a dense page's 1000 crops: ~45 s of rec on one thread)."""
    max_rec_width: Annotated[int, _ints(1, 1_000_000_000)] = 320_000
    """rec's padded widths (px, at 48 px high) of one request's crops, summed: what rec's
    work is proportional to. 320,000: 1000 crops at the narrowest width rapidocr pads to
    (320), or fewer, wider ones."""
    text_score: Annotated[float, _why("must be from 0 to 1", ge=0, le=1)] = 0.5
    box_thresh: Annotated[float, _why("must be from 0 to 1", ge=0, le=1)] = 0.5
    unclip_ratio: Annotated[float, _why("must be above 0 and at most 10", gt=0, le=10)] = 1.6
    use_cls: bool = True
    priority_aging_ms: ZeroOrMoreS = 1000.0
    """Default: the model's ``priority_aging_ms`` (its kind fills it in)."""


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
