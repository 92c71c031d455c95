"""``OcrEngine``: rapidocr-onnxruntime 1.4.4's OCR (PP-OCRv4 det + rec, v2.0 cls) as a
``MediaEngine`` (``sokuji/media/engine.py``), with Sokuji's own sessions and scheduling.

The way of one image::

    decode (media lane)         image-decode (media/image.py) + resize (ocr_stages.prepare)
    det worker thread           det-wait, det (session + DBPostProcess + sort), crop
    cls/rec worker thread       cls-wait, cls (batched), rec-wait, rec (batched), results

- **Identity.** Texts, scores and boxes equal ``RapidOCR()(bytes)``'s: the stages reuse the
  package's own functions (``ocr_stages``), and a crop is recognised at the padded width
  rapidocr would give it (``W_ref``), so batches only ever join crops of one ``W_ref`` (ONNX
  Runtime's output for a row does not depend on the batch's other rows at equal shape).
- **Cross-request batching.** cls inputs all have one shape (48 x 192): a cls batch takes
  crops of any requests (up to rapidocr's 6). rec batches take crops of any requests with
  the same ``W_ref``, up to ``rec_max_batch`` items and ``rec_max_pixels`` (items x width).
  With ``cross_request_batching = false`` a request's crops are batched only within their
  own rapidocr chunk, still under ``rec_max_pixels``; with ``rec_max_pixels = 0`` too, they
  run in exactly rapidocr's chunks (the benchmark's A/B/C: sharing across requests, the
  width budget, neither). All are work-conserving: nothing waits for company.
- **Threads.** One det thread (its own session, ``det_threads`` intra-op threads) and one
  cls+rec thread (``rec_threads``): on 2 cores, det of one image overlaps cls/rec of
  another. cls is ~1% of the work (a few ms against rec's 100s), so it shares rec's thread
  rather than adding a third thread on two cores.
- **Order.** Each queue serves by ``core/policy.rank`` (priority with aging), then the
  request's arrival: older requests' crops go first.
- **Cost bound** (``limits``, ``core/limits.py``; each an option, ``ocr_options.py``).
  From the header, before a pixel is decoded: ``max_pixels`` and ``max_side`` (the decoded
  image), ``max_aspect_ratio``, ``max_det_pixels`` (the sizes after rapidocr's short-side
  upscale, letterbox and det resize: ``ocr_stages.geometry``). After det, before cls / rec:
  ``max_boxes`` (one image), ``max_crops`` and ``max_rec_width`` (the request's images
  summed, through the job's ``RequestBudget``). Past any: ``LimitExceeded`` (413).
- **Jobs.** ``done`` is called exactly once per job (``_Job.finish``): its result, or
  ``DeadlineExceeded`` (still waiting for det at its deadline), ``ModelNotReady`` (stopped),
  ``RuntimeFailed`` (a bug in a stage), or a ``SokujiError`` "cancelled" for a job whose
  client went away (``job.cancelled``; its remaining work is skipped).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sokuji.core.limits import Limit
from sokuji.core.model import ModelMetadata, TensorSpec
from sokuji.core.policy import aging_ns
from sokuji.errors import RuntimeFailed, SokujiError
from sokuji.media import image as media_image
from sokuji.media.batching import Item, StageWorker
from sokuji.media.engine import MediaJob, StageClock
from sokuji.vision import ocr_stages as st
from sokuji.vision.ocr_options import OcrOptions, request_parameters

log = logging.getLogger(__name__)

STAGES = ("image-decode", "resize", "det-wait", "det", "crop", "cls-wait", "cls", "rec-wait",
          "rec")


@dataclass(slots=True)
class Line:
    text: str
    score: float
    box: np.ndarray
    """[4, 2] float32, original image pixels, rapidocr's point order."""


class _Job:
    """The engine's state of one MediaJob; ``finish`` is its one way out."""

    __slots__ = ("boxes", "cursor_ns", "finished", "job", "left", "lock", "phase", "prepared",
                 "texts")

    def __init__(self, job: MediaJob) -> None:
        self.job = job
        self.prepared: st.Prepared = job.decoded
        self.lock = threading.Lock()
        self.finished = False
        self.phase = "queued"  # queued -> running -> done
        self.boxes: list[np.ndarray] = []
        self.texts: list[tuple[str, float] | None] = []
        self.left = 0
        self.cursor_ns = 0
        """The end of this job's last span on the cls/rec thread (its waits start there)."""


@dataclass(slots=True)
class _Crop:
    job: _Job
    index: int
    crop: np.ndarray
    max_wh_ratio: float
    width: int
    """``W_ref``: the padded width rapidocr gives this crop (the rec batch key)."""
    chunk: int
    """Its rapidocr chunk (the batch key when cross-request batching is off)."""


def limits(o: OcrOptions) -> tuple[Limit, ...]:
    """Kind ocr's cost bound, from its options (each key is ``options.<name>``)."""
    return (
        Limit("options.max_pixels", o.max_pixels, "pixels", "pixels of one decoded image"),
        Limit("options.max_side", o.max_side, "px", "the longest side of one decoded image"),
        Limit("options.max_aspect_ratio", o.max_aspect_ratio, "long/short",
              "one image's long side over its short side"),
        Limit("options.max_det_pixels", o.max_det_pixels, "pixels",
              "pixels of one image after every resize and pad (the letterboxed image or "
              "det's input, the larger)"),
        Limit("options.max_boxes", o.max_boxes, "boxes", "text boxes det finds in one image"),
        Limit("options.max_crops", o.max_crops, "crops",
              "crops recognised for one request, over its images"),
        Limit("options.max_rec_width", o.max_rec_width, "px",
              "rec's padded widths of one request's crops, summed"))


class OcrEngine:
    input_name = "image"
    stage_names = STAGES
    streams = False

    def __init__(self, name: str, options: OcrOptions) -> None:
        self.name = name
        self.options = o = options
        self.image_limits = media_image.ImageLimits(max_pixels=o.max_pixels,
                                                    max_side=o.max_side)
        self.limits = limits(o)
        self._lim = {limit.key.removeprefix("options."): limit for limit in self.limits}
        self.metadata = ModelMetadata(
            platform="onnxruntime_ocr",
            inputs=(TensorSpec("image", "BYTES", (-1,), media_types=media_image.MEDIA_TYPES),),
            outputs=(TensorSpec("text", "BYTES", (-1,)), TensorSpec("boxes", "FP32", (-1, 4, 2)),
                     TensorSpec("scores", "FP32", (-1,)),
                     TensorSpec("image_index", "INT32", (-1,))))
        self._sessions: dict[str, Any] = {}
        self._ctc: Any = None
        aging = aging_ns(o.priority_aging_ms)
        self._det = StageWorker(f"{name}-det", self._run_det, self._fail, max_items=1,
                                aging_ns=aging)
        self._cr = StageWorker(f"{name}-cls-rec", self._run_cls_rec, self._fail, max_items=1,
                               aging_ns=aging, limits=self._limits)
        self._lock = threading.Lock()
        self._queued = 0
        self._running = 0
        self._started = False
        self.rec_batch_sizes: collections.Counter[int] = collections.Counter()
        """rec batch size -> batches run (observability, tests)."""
        self.multi_request_batches = 0
        """cls or rec batches that held crops of more than one request."""

    # -- lifecycle ----------------------------------------------------------------------
    def load(self) -> None:
        paths = st.model_paths()
        o = self.options
        self._sessions = {"det": st.session(paths["det"], o.det_threads),
                          "cls": st.session(paths["cls"], o.rec_threads),
                          "rec": st.session(paths["rec"], o.rec_threads)}
        self._ctc = st.ctc_decoder(self._sessions["rec"])

    def warmup(self) -> None:
        """Each session once, on a generated image with one line of text."""
        img = np.full((64, 256, 3), 255, np.uint8)
        img[24:40, 16:240] = 0
        prepared = st.prepare(img)
        assert prepared.det_input is not None
        self._infer("det", prepared.det_input)
        crop = img[16:48, :]
        self._infer("cls", st.cls_input(crop)[None])
        self._infer("rec", st.rec_input(crop, 320 / 48)[None])

    def start(self) -> None:
        if not self._sessions:
            self.load()
        self._det.start()
        self._cr.start()
        self._started = True

    def stop(self) -> None:
        """Jobs waiting for det fail (``ModelNotReady``); those past det finish (cls/rec
        drains, bounded)."""
        self._det.stop()
        self._cr.stop(drain=True)

    def close(self) -> None:
        self._sessions = {}

    @property
    def alive(self) -> bool:
        return self._started and self._det.alive and self._cr.alive

    @property
    def num_queued(self) -> int:
        return self._queued

    @property
    def num_running(self) -> int:
        return self._running

    # -- the media lane (core/offload.media_lane) ----------------------------------------
    def decode(self, data: bytes, clock: StageClock) -> st.Prepared:
        t0 = time.perf_counter_ns()
        info = media_image.probe(data, self.image_limits)
        self.check_geometry(info.width, info.height)
        img = media_image.decode(data, self.image_limits)
        t1 = time.perf_counter_ns()
        clock.add("image-decode", t0, t1)
        prepared = st.prepare(img)
        clock.add("resize", t1, time.perf_counter_ns())
        return prepared

    def check_geometry(self, width: int, height: int) -> st.Geometry:
        """The sizes a ``width`` x ``height`` image would take, checked against
        ``max_aspect_ratio`` and ``max_det_pixels`` before any of them is allocated."""
        geo = st.geometry(width, height)
        subject = f"a {width}x{height} image"
        self._lim["max_aspect_ratio"].check(geo.aspect, subject)
        self._lim["max_det_pixels"].check(geo.pixels, subject)
        return geo

    def parameters(self, raw: Mapping[str, Any]) -> Mapping[str, Any]:
        return request_parameters(raw, self.options)

    def enqueue(self, job: MediaJob) -> None:
        if not job.enqueued_ns:
            job.enqueued_ns = time.perf_counter_ns()
        state = _Job(job)
        job.extra["ocr"] = state
        with self._lock:
            self._queued += 1
        shape = None if state.prepared.det_input is None else state.prepared.det_input.shape
        self._det.put(Item(key=shape, width=1, payload=state, priority=job.priority,
                           arrival_ns=job.enqueued_ns, deadline_ns=job.deadline_ns))

    # -- results ------------------------------------------------------------------------
    def outputs(self, results: list[Any]) -> list[tuple[str, str, list[int], Any]]:
        lines = [(i, ln) for i, res in enumerate(results) for ln in res]
        n = len(lines)
        boxes = (np.stack([ln.box for _, ln in lines]).astype(np.float32) if n
                 else np.zeros((0, 4, 2), np.float32))
        return [("text", "BYTES", [n], [ln.text for _, ln in lines]),
                ("boxes", "FP32", [n, 4, 2], boxes),
                ("scores", "FP32", [n], np.array([ln.score for _, ln in lines], np.float32)),
                ("image_index", "INT32", [n], np.array([i for i, _ in lines], np.int32))]

    def open_stream(self, content_type: str, params: Mapping[str, str]) -> Any:
        raise NotImplementedError("an image is decoded whole")

    def plain(self, result: Any) -> dict[str, Any]:
        return {"lines": [{"text": ln.text, "score": ln.score, "box": ln.box.tolist()}
                          for ln in result]}

    # -- engine threads -----------------------------------------------------------------
    def _infer(self, which: str, x: np.ndarray) -> np.ndarray:
        sess = self._sessions[which]
        return sess.run(None, {sess.get_inputs()[0].name: x})[0]

    def _limits(self, key: Any) -> tuple[int, int | None]:
        o = self.options
        if key[0] == "cls":
            return st.CLS_BATCH_NUM, None
        budget = o.rec_max_pixels or None  # 0: none (rapidocr's chunks, when not shared)
        if not o.cross_request_batching:
            return st.REC_BATCH_NUM, budget  # within one rapidocr chunk
        return o.rec_max_batch, budget

    def _finish(self, state: _Job, result: Any, error: BaseException | None) -> None:
        with state.lock:
            if state.finished:
                return
            state.finished = True
        with self._lock:
            if state.phase == "queued":
                self._queued -= 1
            elif state.phase == "running":
                self._running -= 1
            state.phase = "done"
        if error is not None and not isinstance(error, SokujiError):
            error = RuntimeFailed(f"OCR failed: {type(error).__name__}: {error}")
        try:
            state.job.done(None if error is not None else result, error)
        except Exception:
            log.exception("done callback of an OCR job raised")

    def _fail(self, items: Sequence[Item], error: BaseException) -> None:
        for item in items:
            payload = item.payload
            self._finish(payload if isinstance(payload, _Job) else payload.job, None, error)

    def _cancelled(self, state: _Job) -> bool:
        if state.job.cancelled:
            self._finish(state, None, SokujiError("cancelled: the client went away"))
        return state.finished

    def _run_det(self, batch: list[Item]) -> None:
        (item,) = batch
        state: _Job = item.payload
        t0 = time.perf_counter_ns()
        if self._cancelled(state):
            return
        with self._lock:
            self._queued -= 1
            self._running += 1
            state.phase = "running"
        job, prepared = state.job, state.prepared
        job.clock.add("det-wait", item.queued_ns, t0)
        boxes: list[np.ndarray] = []
        if prepared.det_input is not None:
            pred = self._infer("det", prepared.det_input)
            boxes = st.det_boxes(pred, prepared.image.shape[:2], job.params["box_thresh"],
                                 job.params["unclip_ratio"])
        t1 = time.perf_counter_ns()
        job.clock.add("det", t0, t1)
        if not boxes:
            self._finish(state, [], None)
            return
        try:
            self._lim["max_boxes"].check(len(boxes), "an image")
            job.budget.take(self._lim["max_crops"], len(boxes))
            crop_list = st.crops(prepared.image, boxes)
            max_ratio, widths, chunks = st.rec_widths(crop_list)
            job.budget.take(self._lim["max_rec_width"], sum(widths))
        except SokujiError as exc:
            self._finish(state, None, exc)
            return
        state.boxes = boxes
        state.texts = [None] * len(crop_list)
        state.left = len(crop_list)
        t2 = time.perf_counter_ns()
        job.clock.add("crop", t1, t2)
        state.cursor_ns = t2
        crops_ = [_Crop(state, i, crop, max_ratio[i], widths[i], chunks[i])
                  for i, crop in enumerate(crop_list)]
        if job.params["use_cls"]:
            cross = self.options.cross_request_batching
            self._cr.put_many([Item(("cls",) if cross else ("cls", id(state), c.chunk),
                                    st.CLS_WIDTH, c, job.priority, job.enqueued_ns)
                               for c in crops_])
        else:
            self._put_rec(crops_)

    def _put_rec(self, crops_: list[_Crop]) -> None:
        cross = self.options.cross_request_batching
        self._cr.put_many([Item(("rec", c.width) if cross else ("rec", id(c.job), c.chunk),
                                c.width, c, c.job.job.priority, c.job.job.enqueued_ns)
                           for c in crops_])

    def _run_cls_rec(self, batch: list[Item]) -> None:
        crops_ = [it.payload for it in batch if not self._cancelled(it.payload.job)]
        if not crops_:
            return
        key: Any = batch[0].key
        stage = key[0]
        t0 = time.perf_counter_ns()
        self._waits(crops_, f"{stage}-wait", t0)
        if stage == "cls":
            probs = self._infer("cls", np.stack([st.cls_input(c.crop) for c in crops_]))
            for c, turned in zip(crops_, st.cls_apply(probs, [c.crop for c in crops_]),
                                 strict=True):
                c.crop = turned
        else:
            x = np.stack([st.rec_input(c.crop, c.max_wh_ratio) for c in crops_])
            texts = self._ctc(self._infer("rec", x.astype(np.float32)))
            self.rec_batch_sizes[len(crops_)] += 1
        t1 = time.perf_counter_ns()
        jobs = {id(c.job): c.job for c in crops_}
        if len(jobs) > 1:
            self.multi_request_batches += 1
        mine = collections.Counter(id(c.job) for c in crops_)
        for key_, state in jobs.items():
            # The job's own crops only: the batch's other requests are none of its business.
            n = mine[key_]
            state.job.clock.add(stage, t0, t1, f"{n} crop{'s' if n != 1 else ''}", len(jobs))
            state.cursor_ns = t1
        if stage == "cls":
            self._put_rec(crops_)
            return
        for c, (text, score) in zip(crops_, texts, strict=True):
            c.job.texts[c.index] = (text, score)
            c.job.left -= 1
            if c.job.left == 0:
                self._complete(c.job)

    def _waits(self, crops_: list[_Crop], name: str, start_ns: int) -> None:
        """One ``<stage>-wait`` span per job, from its last span on this thread: the job's
        spans on this thread never overlap, so their sum is its time here."""
        for state in {id(c.job): c.job for c in crops_}.values():
            if start_ns > state.cursor_ns:
                state.job.clock.add(name, state.cursor_ns, start_ns)

    def _complete(self, state: _Job) -> None:
        boxes = st.origin_boxes(state.boxes, state.prepared)
        threshold = state.job.params["text_score"]
        lines = []
        for box, res in zip(boxes, state.texts, strict=True):
            assert res is not None
            if float(res[1]) >= threshold:
                lines.append(Line(res[0], float(res[1]), box))
        self._finish(state, lines, None)
