"""Kind ocr's cost bound on the real preprocessing code (issue 25, finding 1): the sizes an
image takes after rapidocr's short-side upscale, letterbox and det resize are computed from
its header and refused past ``max_det_pixels`` / ``max_aspect_ratio`` before a pixel is
decoded. Before the fix a 2000 x 1 white PNG of ~80 bytes became a 15000 x 60000 det input
(10.8 GB, then a 21.6 GB float64 temporary) and the kernel killed the server."""

from __future__ import annotations

import contextlib
import io
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from sokuji.core.limits import Limit, LimitExceeded
from sokuji.errors import InvalidInput
from sokuji.media.engine import RequestBudget, StageClock
from sokuji.vision import ocr_stages as st
from sokuji.vision.ocr import OcrEngine
from sokuji.vision.ocr_options import OcrOptions

IMAGES = Path(__file__).resolve().parent.parent / "data" / "media" / "images"


def white_png(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (width, height), 255).save(buf, "PNG")
    return buf.getvalue()


# Sizes whose prepare() is cheap enough to run here (each path of the arithmetic: cut to
# 2000, short side up to 30, letterbox, det's 736, too thin), wide and tall.
SIZES = [(256, 64), (30, 30), (1, 1), (2, 1), (1, 2), (20, 40), (2000, 29), (3000, 40),
         (2489, 9), (5000, 1), (1, 5000), (500, 380)]


@pytest.mark.parametrize(("width", "height"), SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_geometry_equals_what_prepare_allocates(width: int, height: int) -> None:
    img = np.full((height, width, 3), 255, np.uint8)
    try:
        prepared = st.prepare(img)
    except InvalidInput:
        with pytest.raises(InvalidInput, match="too thin"):
            st.geometry(width, height)
        return
    geo = st.geometry(width, height)
    assert geo.image == prepared.image.shape[:2]
    det = (0, 0) if prepared.det_input is None else prepared.det_input.shape[2:]
    assert geo.det == det


def test_the_strips_of_the_report_compute_to_what_was_seen() -> None:
    assert st.geometry(2000, 1).det == (15008, 60000)
    assert st.geometry(300, 1).det == (2240, 8992)  # 1.4 GB peak in the report
    assert st.geometry(1, 100).det == (69184, 736)  # tall: det's 736 px short side


@pytest.fixture(scope="module")
def engine() -> OcrEngine:
    return OcrEngine("ocr", OcrOptions())  # no sessions: decode needs none


@pytest.mark.parametrize(("width", "height", "key"), [
    (2000, 1, "options.max_aspect_ratio"), (300, 1, "options.max_aspect_ratio"),
    (100, 1, "options.max_aspect_ratio"), (1, 100, "options.max_aspect_ratio"),
    (30, 480, "options.max_det_pixels")])
def test_a_strip_is_refused_from_its_header_fast_and_small(engine: OcrEngine, width: int,
                                                           height: int, key: str) -> None:
    data = white_png(width, height)
    assert len(data) < 200
    tracemalloc.start()
    try:
        with pytest.raises(LimitExceeded) as err:
            engine.decode(data, StageClock())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.value.status == 413 and err.value.param == key
    assert key in str(err.value) and f"{width}x{height}" in str(err.value)
    # no pixel was decoded: the whole refusal held less than one row of the det input
    assert peak < 1_000_000, peak


def test_the_pixels_bound_holds_with_the_aspect_bound_lifted() -> None:
    eng = OcrEngine("ocr", OcrOptions(max_aspect_ratio=1_000_000))
    with pytest.raises(LimitExceeded, match=r"options.max_det_pixels = 4.5e\+06") as err:
        eng.decode(white_png(2000, 1), StageClock())
    assert err.value.need == 900_480_000


@pytest.mark.parametrize("name", sorted(p.name for p in IMAGES.iterdir()))
def test_every_fixture_image_is_within_the_defaults(engine: OcrEngine, name: str) -> None:
    engine.decode((IMAGES / name).read_bytes(), StageClock())


def test_every_image_up_to_rapidocrs_letterbox_ratio_is_within_the_default() -> None:
    """Documents and photos: any size up to the 25 Mpx decode bound, aspect up to 8."""
    o = OcrOptions()
    worst = 0
    for short in (*range(1, 80), *range(80, 3000, 7)):
        for aspect in (1, 1.5, 2, 3, 4, 5, 6, 7, 7.99, 8):
            long = int(short * aspect)
            if short * long > o.max_pixels or long > o.max_side:
                continue
            for w, h in ((long, short), (short, long)):
                with contextlib.suppress(InvalidInput):  # too thin: rapidocr's own 400
                    worst = max(worst, st.geometry(w, h).pixels)
    assert worst <= o.max_det_pixels, worst


def test_limits_are_stated_with_their_option_keys(engine: OcrEngine) -> None:
    keys = {limit.key: limit.value for limit in engine.limits}
    assert keys == {"options.max_pixels": 25_000_000, "options.max_side": 20_000,
                    "options.max_aspect_ratio": 64, "options.max_det_pixels": 4_500_000,
                    "options.max_boxes": 1000, "options.max_crops": 1000,
                    "options.max_rec_width": 320_000}
    moved = OcrEngine("ocr", OcrOptions(max_det_pixels=9_000_000, max_crops=50))
    assert {lim.key: lim.value for lim in moved.limits}["options.max_crops"] == 50
    assert moved.check_geometry(30, 400).pixels == 7_230_464  # refused by the default
    with pytest.raises(LimitExceeded):
        engine.check_geometry(30, 400)


def test_a_request_budget_sums_its_files() -> None:
    budget = RequestBudget()
    crops = Limit("options.max_crops", 10, "crops", "crops of one request")
    budget.take(crops, 6)
    budget.take(crops, 4)
    with pytest.raises(LimitExceeded, match="needs 11 crops"):
        budget.take(crops, 1)
    assert budget.used == {"options.max_crops": 10}
