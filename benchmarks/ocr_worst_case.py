"""The most work one OCR request may cause under kind ocr's default limits (issue 25), run
stage by stage on one thread each, as the engine runs them.

- det at the ``max_det_pixels`` bound: the largest det input an image within the defaults
  gets (736 x 5888, from a 1 x 8 shape), on random pixels;
- rec at the ``max_crops`` / ``max_rec_width`` bounds: a generated dense page whose det finds
  1000 boxes (rapidocr's cap) of the narrowest padded width (320 px): 1000 crops, 320,000 px.

A request's worst is ``max_batch_size`` x the first (every file at the det bound) plus the
second (crops and widths are the request's, summed over its files).

    PYTHONPATH=. python benchmarks/ocr_worst_case.py
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import cv2
import numpy as np

from sokuji.vision import ocr_stages as st
from sokuji.vision.ocr_options import OcrOptions

RESULTS = Path(__file__).parent / "results"


def dense_page(size: int = 1000, step: int = 11, word: int = 4) -> np.ndarray:
    img = np.full((size, size, 3), 255, np.uint8)
    rng = np.random.default_rng(0)
    for y in range(step, size, step):
        x = 2
        while x < size - 30:
            text = "".join(rng.choice(list("abcdefghij0123456789"), word))
            cv2.putText(img, text, (x, y), cv2.FONT_HERSHEY_SIMPLEX, 0.35, (0, 0, 0), 1)
            x += word * 8 + 10
    return img


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=RESULTS / "ocr_worst_case.json",
                    help="raw JSON (default benchmarks/results/; the recorded runs are in "
                         "benchmarks/recorded/)")
    args = ap.parse_args()
    o = OcrOptions()
    paths = st.model_paths()
    sessions = {k: st.session(paths[k], 1) for k in ("det", "cls", "rec")}

    def infer(which: str, x: np.ndarray) -> np.ndarray:
        s = sessions[which]
        return s.run(None, {s.get_inputs()[0].name: x})[0]

    geo = st.geometry(8, 1)
    assert geo.pixels <= o.max_det_pixels
    x = np.random.default_rng(0).random((1, 3, *geo.det), dtype=np.float32)
    t = time.perf_counter()
    infer("det", x)
    det_s = time.perf_counter() - t
    print(f"det at the bound: {geo.det[0]}x{geo.det[1]} ({geo.pixels / 1e6:.2f} Mpx of "
          f"{o.max_det_pixels / 1e6:.1f}): {det_s:.2f} s; peak RSS so far "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB")

    prepared = st.prepare(dense_page())
    assert prepared.det_input is not None
    boxes = st.det_boxes(infer("det", prepared.det_input), prepared.image.shape[:2], 0.5, 1.6)
    crops = st.crops(prepared.image, boxes)
    ratios, widths, _ = st.rec_widths(crops)
    assert len(crops) <= o.max_crops and sum(widths) <= o.max_rec_width
    t = time.perf_counter()
    for i in range(0, len(crops), st.CLS_BATCH_NUM):
        infer("cls", np.stack([st.cls_input(c) for c in crops[i:i + st.CLS_BATCH_NUM]]))
    cls_s = time.perf_counter() - t
    order = np.argsort(widths)
    t = time.perf_counter()
    for i in range(0, len(crops), 6):
        idx = order[i:i + 6]
        infer("rec", np.stack([st.rec_input(crops[j], ratios[j]) for j in idx]))
    rec_s = time.perf_counter() - t
    print(f"dense page: {len(crops)} crops (of {o.max_crops}), rec width {sum(widths)} px "
          f"(of {o.max_rec_width}): cls {cls_s:.1f} s, rec {rec_s:.1f} s "
          f"({rec_s / sum(widths) * 1e6:.0f} us a px)")
    worst_s = 8 * det_s + cls_s + rec_s
    print(f"worst request, 8 files: ~{worst_s:.0f} s of one core")
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "det": {"shape": list(geo.det), "pixels": geo.pixels, "s": det_s},
        "dense_page": {"crops": len(crops), "rec_width_px": int(sum(widths)), "cls_s": cls_s,
                       "rec_s": rec_s},
        "limits": {"max_det_pixels": o.max_det_pixels, "max_crops": o.max_crops,
                   "max_rec_width": o.max_rec_width},
        "worst_request_s": worst_s, "load_avg": os.getloadavg(),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}, indent=1))
    print(f"raw: {out}")


if __name__ == "__main__":
    main()
