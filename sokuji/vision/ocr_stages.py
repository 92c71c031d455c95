"""The stages of rapidocr-onnxruntime 1.4.4's pipeline, as plain functions over arrays, so
``ocr.py`` can run them on its own threads with its own ONNX Runtime sessions and batch crops
of many requests, and still give ``RapidOCR()(bytes)``'s texts, scores and boxes exactly.

Reused from the package (never re-implemented; identity depends on them):
- ``RapidOCR.preprocess`` (``reduce_max_side`` / ``increase_min_side``),
  ``maybe_add_letterbox``, ``sorted_boxes``, ``get_crop_img_list`` (perspective crop),
  ``_get_origin_points`` (boxes back to the original pixels): called on an instance made
  without ``__init__`` (no sessions), carrying only the config values they read;
- ``TextDetector.get_preprocess`` -> ``DetPreProcess`` (det resize + normalise) and
  ``filter_tag_det_res``; ``DBPostProcess`` (made per call: its thresholds are per request);
- ``TextClassifier.resize_norm_img`` and ``ClsPostProcess``; ``TextRecognizer
  .resize_norm_img`` and ``CTCLabelDecode`` built from the rec model's own metadata.
The configuration is the package's own ``config.yaml``. What is Sokuji's: the order of the
work, the sessions, ``geometry`` (the sizes ``prepare`` would allocate, by the same
arithmetic from the width and height alone: the cost bound is checked on it before a pixel
is decoded), and ``rec_widths`` (which padded width rapidocr would give each crop:
its per-image sort by width/height in chunks of ``rec_batch_num``, see the research note).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
import onnxruntime as ort
from rapidocr_onnxruntime.ch_ppocr_cls.text_cls import TextClassifier
from rapidocr_onnxruntime.ch_ppocr_cls.utils import ClsPostProcess
from rapidocr_onnxruntime.ch_ppocr_det.text_detect import TextDetector
from rapidocr_onnxruntime.ch_ppocr_det.utils import DBPostProcess
from rapidocr_onnxruntime.ch_ppocr_rec.text_recognize import TextRecognizer
from rapidocr_onnxruntime.ch_ppocr_rec.utils import CTCLabelDecode
from rapidocr_onnxruntime.main import DEFAULT_CFG_PATH, RapidOCR
from rapidocr_onnxruntime.utils import read_yaml
from rapidocr_onnxruntime.utils.process_img import ResizeImgError

from sokuji.errors import InvalidInput

CONFIG: dict[str, dict[str, Any]] = read_yaml(DEFAULT_CFG_PATH)
GLOBAL, DET, CLS, REC = CONFIG["Global"], CONFIG["Det"], CONFIG["Cls"], CONFIG["Rec"]
REC_BATCH_NUM: int = REC["rec_batch_num"]
"""rapidocr's rec chunk: it decides each crop's padded width (``rec_widths``)."""
CLS_BATCH_NUM: int = CLS["cls_batch_num"]
CLS_WIDTH: int = CLS["cls_image_shape"][2]


def _bare(cls: Any, **attrs: Any) -> Any:
    """An instance of one of the package's classes without its ``__init__`` (which would
    load a model), carrying only the attributes its reused methods read."""
    obj = cls.__new__(cls)
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


_OCR = _bare(RapidOCR, max_side_len=GLOBAL["max_side_len"], min_side_len=GLOBAL["min_side_len"],
             min_height=GLOBAL["min_height"], width_height_ratio=GLOBAL["width_height_ratio"])
_DET = _bare(TextDetector, limit_side_len=DET["limit_side_len"], limit_type=DET["limit_type"],
             mean=DET["mean"], std=DET["std"])
_CLS = _bare(TextClassifier, cls_image_shape=CLS["cls_image_shape"])
_CLS_POST = ClsPostProcess(CLS["label_list"])
_REC = _bare(TextRecognizer, rec_image_shape=REC["rec_img_shape"])


def model_paths() -> dict[str, str]:
    """The package's det / cls / rec ONNX files (found without importing anything more)."""
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("rapidocr_onnxruntime is not installed")
    root = next(iter(spec.submodule_search_locations))
    return {k: os.path.join(root, CONFIG[s]["model_path"])
            for k, s in (("det", "Det"), ("cls", "Cls"), ("rec", "Rec"))}


def session(path: str, threads: int) -> ort.InferenceSession:
    """rapidocr's session options (arena off, all graph optimisations), our thread count."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    opts.enable_cpu_mem_arena = False
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(path, sess_options=opts, providers=["CPUExecutionProvider"])


def ctc_decoder(rec_session: ort.InferenceSession) -> CTCLabelDecode:
    """The rec model's dictionary is in its metadata (as ``TextRecognizer`` reads it)."""
    meta = rec_session.get_modelmeta().custom_metadata_map
    return CTCLabelDecode(character=meta["character"].splitlines())


@dataclass(slots=True)
class Prepared:
    """One image after ``decode``: what det needs, and how to map boxes back."""

    image: np.ndarray
    """The preprocessed, letterboxed BGR image (crops are cut from it)."""
    det_input: np.ndarray | None
    """[1, 3, H, W] float32; None when rapidocr's det resize gives an empty image."""
    op_record: dict[str, Any]
    raw_h: int
    raw_w: int


def _scaled(h: int, w: int, ratio: float) -> tuple[int, int]:
    """rapidocr's resize arithmetic (``reduce_max_side``, ``increase_min_side``,
    ``DetPreProcess.resize``): each side times ``ratio``, truncated, rounded to 32."""
    return int(round(int(h * ratio) / 32) * 32), int(round(int(w * ratio) / 32) * 32)


@dataclass(frozen=True, slots=True)
class Geometry:
    """The sizes one image of ``width`` x ``height`` takes on its way to det, from the header
    alone (``geometry``): what ``prepare`` would allocate, computed before it does."""

    width: int
    height: int
    image: tuple[int, int]
    """(h, w) of the prepared image: after the short-side upscale and the letterbox (crops
    are cut from it)."""
    det: tuple[int, int]
    """(h, w) of the det input: the prepared image after det's resize (0 x 0: none)."""

    @property
    def aspect(self) -> float:
        """The decoded image's long side over its short side."""
        return max(self.width, self.height) / min(self.width, self.height)

    @property
    def pixels(self) -> int:
        """The most pixels one step holds: the prepared image or the det input."""
        return max(self.image[0] * self.image[1], self.det[0] * self.det[1])


def geometry(width: int, height: int) -> Geometry:
    """The sizes ``prepare`` gives a ``width`` x ``height`` image, by the same arithmetic
    (``RapidOCR.preprocess``, ``maybe_add_letterbox``, ``get_preprocess`` + ``DetPreProcess
    .resize``), without touching a pixel. ``InvalidInput`` where rapidocr's own resize would
    refuse (a side rounding to 0 px). Equal to ``prepare``'s shapes (tested)."""
    h, w = height, width
    if max(h, w) > _OCR.max_side_len:
        h, w = _scaled(h, w, float(_OCR.max_side_len) / (h if h > w else w))
        if h <= 0 or w <= 0:
            raise _too_thin(width, height)
    if min(h, w) < _OCR.min_side_len:
        h, w = _scaled(h, w, float(_OCR.min_side_len) / (h if h < w else w))
        if h <= 0 or w <= 0:
            raise _too_thin(width, height)
    ratio = _OCR.width_height_ratio
    if h <= _OCR.min_height or (ratio != -1 and w / h > ratio):
        new_h = max(int(w / ratio), _OCR.min_height) * 2
        h += 2 * int(abs(new_h - h) / 2)
    limit = _DET.get_preprocess(max(h, w)).limit_side_len
    det_ratio = float(limit) / (h if h < w else w) if min(h, w) < limit else 1.0
    dh, dw = _scaled(h, w, det_ratio)
    det = (dh, dw) if dh > 0 and dw > 0 else (0, 0)
    return Geometry(width, height, (h, w), det)


def _too_thin(width: int, height: int) -> InvalidInput:
    # rapidocr's own refusal: a side that rounds to 0 px once the longest side is cut
    # to 2000 (a 1 x 5000 strip). Its input, not our bug: a 400 that says so.
    return InvalidInput(f"image is {width}x{height}: too thin for OCR (a side rounds to 0 px "
                        "once the longest is scaled to 2000 px)", param="image")


def prepare(img: np.ndarray) -> Prepared:
    """``RapidOCR.preprocess`` + ``maybe_add_letterbox`` + det's resize and normalise."""
    raw_h, raw_w = img.shape[:2]
    try:
        img, ratio_h, ratio_w = _OCR.preprocess(img)
    except ResizeImgError:
        raise _too_thin(raw_w, raw_h) from None
    op_record: dict[str, Any] = {"preprocess": {"ratio_h": ratio_h, "ratio_w": ratio_w}}
    img, op_record = _OCR.maybe_add_letterbox(img, op_record)
    det_input = _DET.get_preprocess(max(img.shape[0], img.shape[1]))(img)
    return Prepared(img, det_input, op_record, raw_h, raw_w)


def det_boxes(pred: np.ndarray, image_shape: tuple[int, int], box_thresh: float,
              unclip_ratio: float) -> list[np.ndarray]:
    """The det map -> sorted text boxes in the prepared image's pixels (``TextDetector``'s
    and ``RapidOCR.auto_text_det``'s post-processing)."""
    post = DBPostProcess(thresh=DET["thresh"], box_thresh=box_thresh,
                         max_candidates=DET["max_candidates"], unclip_ratio=unclip_ratio,
                         score_mode=DET["score_mode"], use_dilation=DET["use_dilation"])
    boxes, _ = post(pred, image_shape)
    boxes = _DET.filter_tag_det_res(boxes, image_shape)
    if boxes is None or len(boxes) < 1:
        return []
    return list(RapidOCR.sorted_boxes(boxes))


def crops(image: np.ndarray, boxes: list[np.ndarray]) -> list[np.ndarray]:
    return list(_OCR.get_crop_img_list(image, boxes))


def rec_widths(crop_list: list[np.ndarray]) -> tuple[list[float], list[int], list[int]]:
    """Per crop: rapidocr's ``max_wh_ratio`` for it, the padded width ``W_ref`` it gets
    (``int(48 * max_wh_ratio)``), and its chunk number. rapidocr sorts one image's crops by
    width/height and runs chunks of ``rec_batch_num``; a chunk's width is its widest ratio
    (at least 320/48). Batching only equal ``W_ref`` reproduces its texts and scores."""
    _c, img_h, img_w = REC["rec_img_shape"]
    ratios = [c.shape[1] / float(c.shape[0]) for c in crop_list]
    order = np.argsort(np.array(ratios))  # the same call as TextRecognizer's
    max_ratio = [0.0] * len(crop_list)
    chunk_of = [0] * len(crop_list)
    for chunk, begin in enumerate(range(0, len(crop_list), REC_BATCH_NUM)):
        members = order[begin:begin + REC_BATCH_NUM]
        m = img_w / img_h
        for i in members:
            m = max(m, ratios[i])
        for i in members:
            max_ratio[i] = m
            chunk_of[i] = chunk
    return max_ratio, [int(img_h * m) for m in max_ratio], chunk_of


def cls_input(crop: np.ndarray) -> np.ndarray:
    return _CLS.resize_norm_img(crop)


def cls_apply(probs: np.ndarray, crop_list: list[np.ndarray]) -> list[np.ndarray]:
    """Turn the crops that cls reads as upside down (label 180 above ``cls_thresh``)."""
    out = []
    for (label, score), crop in zip(_CLS_POST(probs), crop_list, strict=True):
        out.append(cv2.rotate(crop, 1) if "180" in label and score > CLS["cls_thresh"]
                   else crop)
    return out


def rec_input(crop: np.ndarray, max_wh_ratio: float) -> np.ndarray:
    return _REC.resize_norm_img(crop, max_wh_ratio)


def origin_boxes(boxes: list[np.ndarray], prepared: Prepared) -> np.ndarray:
    """[N, 4, 2] float32 in the original image's pixels (``RapidOCR._get_origin_points``)."""
    return _OCR._get_origin_points(boxes, prepared.op_record, prepared.raw_h, prepared.raw_w)
