"""sokuji/media/image.py: limits from the header before any decoding, clear 4xx for hostile
or broken files, and rapidocr-onnxruntime's own channel rules (compared with its LoadImage)."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from sokuji.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType
from sokuji.media import image as mi

IMAGES = Path(__file__).resolve().parent.parent / "data" / "media" / "images"


def encoded(im: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def lying_png(width: int, height: int) -> bytes:
    """A valid PNG signature and IHDR claiming width x height, and no pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk
            + struct.pack(">I", zlib.crc32(chunk)) + b"\x00\x00\x00\x00IEND\xaeB`\x82")


@pytest.fixture
def no_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any pixel decoding fails the test: refusals must come from the header alone."""
    def boom(self: object) -> None:
        raise AssertionError("decoded pixels of a file that should have been refused")
    monkeypatch.setattr(ImageFile.ImageFile, "load", boom)


def test_probe_reads_the_header() -> None:
    for name, fmt, mode in (("lines3.png", "PNG", "RGB"), ("lines3.jpg", "JPEG", "RGB"),
                            ("lines3.webp", "WEBP", "RGB"), ("banner_rgba.png", "PNG", "RGBA"),
                            ("doc_a4.png", "PNG", "L"), ("tiny_la.png", "PNG", "LA")):
        info = mi.probe((IMAGES / name).read_bytes())
        with Image.open(IMAGES / name) as im:
            assert (info.format, info.width, info.height, info.mode) == (fmt, *im.size, mode)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "1"])
@pytest.mark.parametrize("fmt", ["PNG", "WEBP", "JPEG"])
def test_decode_equals_rapidocr_load_image(mode: str, fmt: str) -> None:
    from rapidocr_onnxruntime.utils import LoadImage

    if fmt == "JPEG" and mode in ("RGBA", "LA"):
        pytest.skip("JPEG has no alpha")
    rng = np.random.default_rng(3)
    base = Image.fromarray(rng.integers(0, 256, (37, 53, 4), dtype=np.uint8), "RGBA")
    im = base.convert(mode) if mode != "RGBA" else base
    if fmt == "WEBP" and mode in ("L", "LA", "1"):
        im = im.convert("RGB")  # WebP stores RGB(A) only
    data = encoded(im, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    got = mi.decode(data)
    assert got.dtype == np.uint8 and got.ndim == 3 and got.shape[2] == 3
    np.testing.assert_array_equal(got, LoadImage()(data))


def test_committed_images_decode_like_rapidocr() -> None:
    from rapidocr_onnxruntime.utils import LoadImage

    for path in sorted(IMAGES.iterdir()):
        data = path.read_bytes()
        np.testing.assert_array_equal(mi.decode(data), LoadImage()(data), err_msg=path.name)


def test_rgba_keeps_rapidocrs_inverting_rule() -> None:
    """rapidocr's odd RGBA rule: a picture that is not all black after masking is inverted."""
    im = Image.new("RGBA", (8, 4), (200, 100, 50, 255))
    got = mi.decode(encoded(im, "PNG"))
    assert got[0, 0].tolist() == [255 - 50, 255 - 100, 255 - 200]
    transparent = mi.decode(encoded(Image.new("RGBA", (8, 4), (0, 0, 0, 0)), "PNG"))
    assert transparent[0, 0].tolist() == [255, 255, 255]


def test_palette_is_converted_to_rgb_unlike_rapidocr() -> None:
    """The documented divergence: a palette PNG is its colours, not its indices as gray."""
    rgb = Image.new("RGB", (6, 6), (10, 200, 30))
    pal = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=4)
    got = mi.decode(encoded(pal, "PNG"))
    assert got[0, 0].tolist() == list(pal.convert("RGB").getpixel((0, 0)))[::-1]


def test_empty_garbage_and_other_formats_are_refused() -> None:
    with pytest.raises(InvalidInput, match="0 bytes"):
        mi.decode(b"")
    with pytest.raises(UnsupportedMediaType, match="send PNG, JPEG or WebP"):
        mi.decode(b"this is not an image at all" * 10)
    gif = encoded(Image.new("RGB", (10, 10), "white"), "GIF")
    with pytest.raises(UnsupportedMediaType, match="send PNG, JPEG or WebP"):
        mi.probe(gif)
    bmp = encoded(Image.new("RGB", (10, 10), "white"), "BMP")
    with pytest.raises(UnsupportedMediaType):
        mi.decode(bmp)


def test_lying_header_is_refused_before_decoding(no_decoding: None) -> None:
    data = lying_png(100_000, 100_000)
    assert len(data) < 80
    with pytest.raises(PayloadTooLarge) as err:
        mi.decode(data)
    msg = str(err.value)
    assert "100000x100000" in msg and "Mpx" in msg and "25.0" in msg
    # Just over Sokuji's limit, well under Pillow's own: our check, same wording.
    with pytest.raises(PayloadTooLarge, match=r"6000x5000 \(30.0 Mpx\)"):
        mi.probe(lying_png(6000, 5000), mi.ImageLimits())


def test_real_bomb_is_refused_before_decoding(no_decoding: None) -> None:
    bomb = encoded(Image.new("L", (8000, 8000), 0), "PNG", optimize=True)
    assert len(bomb) < 100_000  # 64 Mpx in a few tens of KB
    with pytest.raises(PayloadTooLarge, match="8000x8000"):
        mi.decode(bomb)
    with pytest.raises(PayloadTooLarge, match="longest side"):
        mi.decode(encoded(Image.new("L", (5000, 10), 0), "PNG"),
                  mi.ImageLimits(max_pixels=10**6, max_side=4000))


def test_pillow_global_limit_is_left_alone() -> None:
    before = Image.MAX_IMAGE_PIXELS
    with pytest.raises(PayloadTooLarge):
        mi.decode(lying_png(12_000, 12_000), mi.ImageLimits(max_pixels=10**9, max_side=10**6))
    assert before == Image.MAX_IMAGE_PIXELS


@pytest.mark.parametrize("name,fmt", [("lines3.png", "PNG"), ("lines3.jpg", "JPEG"),
                                      ("lines3.webp", "WEBP")])
def test_truncated_files_are_400(name: str, fmt: str) -> None:
    data = (IMAGES / name).read_bytes()
    with pytest.raises(InvalidInput, match=f"truncated or corrupt {fmt}"):
        mi.decode(data[: len(data) // 2])


def test_corrupt_png_body_is_400() -> None:
    data = bytearray((IMAGES / "lines3.png").read_bytes())
    data[200:260] = b"\x00" * 60  # inside the compressed pixel data
    with pytest.raises(InvalidInput, match="corrupt PNG"):
        mi.decode(bytes(data))
