"""Regenerate the OCR test images (run from anywhere: ``python tests/data/media/make_images.py``).

Only Pillow's bundled font (``ImageFont.load_default(size=...)``) is used, so no system font
is needed. Deterministic: the same Pillow gives the same bytes. Images:

- ``lines3.png`` / ``.jpg`` / ``.webp``: three lines on white, 720 x 240 (RGB)
- ``lines3_upside.png``: the same turned 180 degrees (cls turns the crops back)
- ``eight_lines.png``: eight similar lines (crops of one width: they share rec batches)
- ``doc_a4.png``: an A4 page at 150 dpi, 40 lines of random words (1240 x 1754, gray ``L``)
- ``banner_rgba.png``: one wide line on a transparent background (RGBA; w/h > 8: letterbox)
- ``tiny_la.png``: a 24 px high gray+alpha line (``LA``; below 30 px: upscaled first)
- ``photo.jpg``: a "photo" of a printed note: tinted paper, uneven light, rotated 4 degrees,
  blurred, noisy, JPEG q75 (no real photograph or renderer was available on this machine)
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

OUT = Path(__file__).resolve().parent / "images"
LINES = ["Sokuji serves models fast", "Invoice 2026-11-30 total 42.50",
         "The quick brown fox jumps"]
WORDS = ["latency", "batching", "queue", "deadline", "tenant", "model", "image", "audio",
         "server", "request", "response", "timing", "stage", "decode", "resize"]


def font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def lines3() -> Image.Image:
    im = Image.new("RGB", (720, 240), "white")
    d = ImageDraw.Draw(im)
    for i, t in enumerate(LINES):
        d.text((30, 30 + i * 70), t, fill="black", font=font(34))
    return im


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    im = lines3()
    im.save(OUT / "lines3.png")
    im.save(OUT / "lines3.jpg", quality=90)
    im.save(OUT / "lines3.webp", quality=90)
    im.rotate(180).save(OUT / "lines3_upside.png")

    im = Image.new("RGB", (800, 8 * 60 + 40), "white")
    d = ImageDraw.Draw(im)
    for i in range(8):
        d.text((30, 20 + i * 60), f"Line number {i} of the batch test", fill="black",
               font=font(34))
    im.save(OUT / "eight_lines.png")

    rng = random.Random(1)
    im = Image.new("L", (1240, 1754), 255)
    d = ImageDraw.Draw(im)
    for i in range(40):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
        d.text((80, 60 + i * 40), words, fill=0, font=font(24))
    im.save(OUT / "doc_a4.png", optimize=True)

    im = Image.new("RGBA", (900, 70), (0, 0, 0, 0))
    ImageDraw.Draw(im).text((20, 12), "Wide banner text on a transparent background",
                            fill=(20, 40, 160, 255), font=font(36))
    im.save(OUT / "banner_rgba.png")

    im = Image.new("LA", (260, 24), (255, 0))
    ImageDraw.Draw(im).text((4, 2), "tiny label 123", fill=(0, 255), font=font(18))
    im.save(OUT / "tiny_la.png")

    im = Image.new("RGB", (900, 520), (232, 222, 196))
    d = ImageDraw.Draw(im)
    for i, t in enumerate(["Meeting notes, room 4B", "Order #5521 ships Monday",
                           "Call Ana before 10:30", "Total due: 318.75 EUR"]):
        d.text((70, 70 + i * 95), t, fill=(35, 30, 40), font=font(44))
    im = im.rotate(4, resample=Image.Resampling.BICUBIC, expand=True, fillcolor=(90, 80, 70))
    arr = np.asarray(im).astype(np.float32)
    h, w = arr.shape[:2]
    light = np.linspace(1.08, 0.72, w)[None, :, None] * np.linspace(1.0, 0.85, h)[:, None, None]
    noise = np.random.default_rng(7).normal(0, 9, arr.shape)
    arr = np.clip(arr * light + noise, 0, 255).astype(np.uint8)
    im = Image.fromarray(arr).filter(ImageFilter.GaussianBlur(1.2))
    im.save(OUT / "photo.jpg", quality=75)


if __name__ == "__main__":
    main()
