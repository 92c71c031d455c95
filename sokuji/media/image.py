"""Untrusted image bytes -> a BGR ``uint8`` array, limits checked from the header first.

- ``probe(data)`` reads only the header (Pillow's ``Image.open`` with ``formats`` PNG, JPEG,
  WebP): format, width, height, mode. Nothing is decoded yet.
- ``check(info, limits)`` refuses, still before decoding: a picture of more than
  ``max_pixels`` pixels or a side longer than ``max_side`` (``PayloadTooLarge``, 413, naming
  W x H, the megapixels and the limit). A 74-byte PNG that claims 100000 x 100000, or an
  8000 x 8000 "bomb" of 62 KB, is refused here in well under a millisecond.
- ``decode(data, limits)`` = probe + check + Pillow's decode + rapidocr-onnxruntime 1.4.4's
  channel rules (``utils/load_image.py: LoadImage``), so the array equals what
  ``RapidOCR()(bytes)`` works on: mode ``1`` -> ``L``; gray -> ``GRAY2BGR``; ``LA`` -> gray
  over white by alpha; ``RGB`` -> ``RGB2BGR``; ``RGBA`` -> its odd rule (masked by alpha, then
  *inverted* unless the masked picture is all black). **Divergence:** every other mode
  (``P`` palette, ``I;16``, ``I``, ``F``, ``CMYK``, ``PA``, ...) is ``convert("RGB")`` first;
  rapidocr reads a palette PNG's indices as gray levels and mishandles the others.
- Errors: an unknown or unsupported format is ``UnsupportedMediaType`` (415, "send PNG, JPEG
  or WebP"); empty, truncated or corrupt data is ``InvalidInput`` (400, "truncated or corrupt
  PNG"). Pillow's own bomb guard (``DecompressionBombError``, and its warning, turned into an
  error for this call only) also answers 413; ``Image.MAX_IMAGE_PIXELS`` is a process-wide
  global and is left alone. ``ImageFile.LOAD_TRUNCATED_IMAGES`` is left False.

The channel rules are copied from rapidocr-onnxruntime 1.4.4 (``LoadImage.convert_img``,
``cvt_two_to_three``, ``cvt_four_to_three``), Copyright SWHL, Apache License 2.0
(http://www.apache.org/licenses/LICENSE-2.0). ``cv2`` and Pillow are imported on first use.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from io import BytesIO
from typing import TYPE_CHECKING, Any

from sokuji.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

FORMATS = ("PNG", "JPEG", "WEBP")
MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp", "application/octet-stream")
"""What an image may be uploaded as (the file itself as the body; the header decides)."""
_UNSUPPORTED = "unsupported image format; send PNG, JPEG or WebP"


@dataclass(frozen=True, slots=True)
class ImageInfo:
    format: str
    """``PNG``, ``JPEG`` or ``WEBP``."""
    width: int
    height: int
    mode: str
    """Pillow's mode: ``RGB``, ``RGBA``, ``L``, ``LA``, ``1``, ``P``, ..."""


@dataclass(frozen=True, slots=True)
class ImageLimits:
    max_pixels: int = 25_000_000
    max_side: int = 20_000


def _open(data: bytes, limits: ImageLimits) -> Image.Image:
    """Pillow's header parse, its bomb guard answered as 413 (the warning too)."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise InvalidInput("empty image: 0 bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(BytesIO(data), formats=list(FORMATS))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        claimed = _claimed(data)
        if claimed is not None:
            check(claimed, limits)  # the usual message, naming W x H and the limit
        raise PayloadTooLarge(f"image refused as a decompression bomb: {exc}") from exc
    except UnidentifiedImageError as exc:
        raise UnsupportedMediaType(_UNSUPPORTED) from exc
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        # A file that starts like a supported format and then breaks (a WebP cut short
        # already fails here: its decoder is created at open).
        raise InvalidInput(f"truncated or corrupt {_sniff(data)}: {exc}") from exc


def _sniff(data: bytes) -> str:
    """The format a broken file's magic bytes claim, to name it in the error."""
    if data.startswith(b"\x89PNG"):
        return "PNG"
    if data.startswith(b"\xff\xd8"):
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return "image"


def _claimed(data: bytes) -> ImageInfo | None:
    """What the header claims, read by the format's own Pillow plugin without
    ``Image.open``'s bomb check (only to word the refusal of a picture Pillow refused)."""
    from PIL import Image

    for fmt in FORMATS:
        factory, accept = Image.OPEN[fmt]
        if accept is not None and not accept(data[:16]):
            continue
        try:
            im = factory(BytesIO(data), "")
        except Exception:  # noqa: BLE001 - any failure: Pillow's own message instead
            return None
        try:
            return _info(im)
        finally:
            im.close()
    return None


def probe(data: bytes, limits: ImageLimits | None = None) -> ImageInfo:
    """Format, size and mode from the header alone (see the module doc for the errors);
    with ``limits``, also ``check``-ed."""
    im = _open(data, limits or ImageLimits())
    try:
        info = _info(im)
        if limits is not None:
            check(info, limits)
        return info
    finally:
        im.close()


def _info(im: Image.Image) -> ImageInfo:
    fmt = im.format or ""
    if fmt not in FORMATS:
        raise UnsupportedMediaType(_UNSUPPORTED)
    width, height = im.size
    return ImageInfo(fmt, int(width), int(height), im.mode)


def check(info: ImageInfo, limits: ImageLimits) -> None:
    """``PayloadTooLarge`` for a picture over the limits; ``InvalidInput`` for an empty one."""
    w, h = info.width, info.height
    if w <= 0 or h <= 0:
        raise InvalidInput(f"{info.format} image has no pixels ({w}x{h})")
    pixels = w * h
    if pixels > limits.max_pixels:
        raise PayloadTooLarge(
            f"{info.format} image is {w}x{h} ({pixels / 1e6:.1f} Mpx); the limit is "
            f"{limits.max_pixels / 1e6:.1f} Mpx (max_pixels {limits.max_pixels})")
    if max(w, h) > limits.max_side:
        raise PayloadTooLarge(
            f"{info.format} image is {w}x{h}; the longest side may be {limits.max_side} px")


def decode(data: bytes, limits: ImageLimits | None = None) -> np.ndarray:
    """The image as rapidocr-onnxruntime 1.4.4 sees it: BGR ``uint8`` [H, W, 3]."""
    import numpy as np

    limits = limits or ImageLimits()
    im = _open(data, limits)
    try:
        info = _info(im)
        check(info, limits)
        try:
            im.load()
            if im.mode == "1":
                arr = np.array(im.convert("L"))
            elif im.mode in ("L", "LA", "RGB", "RGBA"):
                arr = np.array(im)
            else:
                arr = np.array(im.convert("RGB"))  # the documented divergence
        except (OSError, ValueError, SyntaxError, EOFError) as exc:
            raise InvalidInput(f"truncated or corrupt {info.format}: {exc}") from exc
    finally:
        im.close()
    return to_bgr(arr)


def to_bgr(img: np.ndarray) -> np.ndarray:
    """rapidocr's ``LoadImage.convert_img`` for an array decoded from bytes."""
    import cv2

    if img.ndim == 2 or (img.ndim == 3 and img.shape[2] == 1):
        return cv2.cvtColor(img, cv2.COLOR_GRAY2BGR)
    channels = img.shape[2]
    if channels == 2:
        return _two_to_three(img)
    if channels == 3:
        return cv2.cvtColor(img, cv2.COLOR_RGB2BGR)
    if channels == 4:
        return _four_to_three(img)
    raise InvalidInput(f"image has {channels} channels; expected 1 to 4")


def _two_to_three(img: np.ndarray) -> Any:
    """Gray + alpha -> BGR: gray where opaque, white where transparent."""
    import cv2

    gray = cv2.cvtColor(img[..., 0], cv2.COLOR_GRAY2BGR)
    alpha = img[..., 1]
    not_a = cv2.cvtColor(cv2.bitwise_not(alpha), cv2.COLOR_GRAY2BGR)
    return cv2.add(cv2.bitwise_and(gray, gray, mask=alpha), not_a)


def _four_to_three(img: np.ndarray) -> Any:
    """RGBA -> BGR by rapidocr's rule: masked by alpha; then white where transparent if
    the masked picture is all black, else the whole picture inverted (sic)."""
    import cv2
    import numpy as np

    r, g, b, a = cv2.split(img)
    bgr = cv2.merge((b, g, r))
    not_a = cv2.cvtColor(cv2.bitwise_not(a), cv2.COLOR_GRAY2BGR)
    bgr = cv2.bitwise_and(bgr, bgr, mask=a)
    if float(np.mean(np.asarray(bgr, np.float64))) <= 0.0:
        return cv2.add(bgr, not_a)
    return cv2.bitwise_not(bgr)
