"""OcrEngine against rapidocr-onnxruntime 1.4.4 itself (``RapidOCR()(bytes)``, computed here):
the same texts, scores and boxes for every committed image, alone and with crops of several
requests sharing cls/rec batches; and the job contract (deadline, cancel, stop, a stage bug).

The engine's worker callbacks are wrapped (not replaced) where a test needs a known
interleaving: that holds a stage until the test says go, with events, never sleeps."""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sokuji.config import ModelConfig
from sokuji.core.request import Priority
from sokuji.errors import ConfigError, DeadlineExceeded, InvalidInput, ModelNotReady, RuntimeFailed
from sokuji.media.engine import MediaJob, StageClock

pytest.importorskip("rapidocr_onnxruntime")

from rapidocr_onnxruntime import RapidOCR

from sokuji.core.limits import LimitExceeded
from sokuji.vision.ocr import OcrEngine
from sokuji.vision.ocr_options import OcrOptions
from tests.conftest import options_of

IMAGES = Path(__file__).resolve().parent.parent / "data" / "media" / "images"
NAMES = sorted(p.name for p in IMAGES.iterdir())
SMALL = [n for n in NAMES if n != "doc_a4.png"]
WAIT_S = 120.0


class Outcome:
    def __init__(self) -> None:
        self.calls = 0
        self.result: Any = None
        self.error: BaseException | None = None
        self.event = threading.Event()
        self.clock = StageClock()
        self.job: MediaJob | None = None

    def done(self, result: Any, error: BaseException | None) -> None:
        self.calls += 1
        self.result, self.error = result, error
        self.event.set()

    def wait(self) -> Outcome:
        assert self.event.wait(WAIT_S), "the job never finished"
        return self


def submit(engine: OcrEngine, data: bytes, params: Mapping[str, Any] | None = None,
           deadline_ns: int | None = None, cancelled: bool = False) -> Outcome:
    out = Outcome()
    decoded = engine.decode(data, out.clock)
    out.job = MediaJob(decoded, engine.parameters(params or {}), out.clock, deadline_ns,
                       Priority.INTERACTIVE, out.done, cancelled=cancelled)
    engine.enqueue(out.job)
    return out


def as_rapidocr(result: list[Any]) -> list[list[Any]]:
    return [[ln.box.tolist(), ln.text, ln.score] for ln in result]


def assert_same(got: list[Any], expected: list[list[Any]] | None, name: str) -> None:
    expected = expected or []
    mine = as_rapidocr(got)
    assert [g[1] for g in mine] == [e[1] for e in expected], name
    assert [g[0] for g in mine] == [e[0] for e in expected], name
    np.testing.assert_allclose([g[2] for g in mine], [e[2] for e in expected], rtol=0,
                               atol=1e-6, err_msg=name)


def make_engine(**options: Any) -> OcrEngine:
    engine = OcrEngine("ocr", OcrOptions(**options))
    engine.load()
    engine.start()
    return engine


@pytest.fixture(scope="module")
def rapidocr() -> Any:
    """One RapidOCR for the module, called without keyword arguments only (its ``__call__``
    keeps them as state)."""
    return RapidOCR()


@pytest.fixture(scope="module")
def reference(rapidocr: Any) -> dict[str, Any]:
    return {name: rapidocr((IMAGES / name).read_bytes())[0] for name in NAMES}


@pytest.fixture(scope="module")
def engine() -> Iterator[OcrEngine]:
    eng = make_engine()
    eng.warmup()
    yield eng
    eng.stop()
    eng.close()


def hold(engine: OcrEngine, worker: str) -> tuple[threading.Event, threading.Event]:
    """Wrap a stage worker's run: its first call waits for ``go``; ``entered`` is set then."""
    w = engine._det if worker == "det" else engine._cr
    inner: Callable[[Any], None] = w._run
    go, entered = threading.Event(), threading.Event()

    def run(batch: Any) -> None:
        if not entered.is_set():
            entered.set()
            assert go.wait(WAIT_S)
        inner(batch)

    w._run = run
    return go, entered


def test_metadata_and_options(engine: OcrEngine) -> None:
    assert engine.input_name == "image"
    assert [t.name for t in engine.metadata.outputs] == ["text", "boxes", "scores",
                                                         "image_index"]
    for bad in ({"rec_max_batch": 0}, {"cross_request_batching": "yes"}, {"text_score": 2},
                {"nonsense": 1}, {"det_threads": 1.5}):
        with pytest.raises(ConfigError) as err:  # when the config loads, before any build
            options_of(ModelConfig(name="x", runtime="ocr", options=bad))
        assert err.value.param == f"models[0].options.{next(iter(bad))}"
    assert engine.parameters({"text_score": 0.2, "other": 1})["text_score"] == 0.2
    for key, value in (("text_score", "high"), ("box_thresh", 1.5), ("unclip_ratio", 0),
                       ("use_cls", 1)):
        with pytest.raises(InvalidInput, match=key):
            engine.parameters({key: value})


@pytest.mark.parametrize("name", NAMES)
def test_each_image_equals_rapidocr(engine: OcrEngine, reference: dict[str, Any],
                                    name: str) -> None:
    out = submit(engine, (IMAGES / name).read_bytes()).wait()
    assert out.error is None and out.calls == 1
    assert_same(out.result, reference[name], name)
    totals = out.clock.totals_ns()
    for stage in ("image-decode", "resize", "det-wait", "det", "crop", "cls", "rec"):
        assert stage in totals, stage


def test_blank_image_has_no_lines(engine: OcrEngine, rapidocr: Any) -> None:
    import cv2

    ok, png = cv2.imencode(".png", np.full((120, 300, 3), 255, np.uint8))
    assert ok and rapidocr(png.tobytes())[0] is None
    out = submit(engine, png.tobytes()).wait()
    assert out.error is None and out.result == []
    tensors = {name: (dtype, shape) for name, dtype, shape, _ in engine.outputs([[]])}
    assert tensors["boxes"] == ("FP32", [0, 4, 2]) and tensors["text"] == ("BYTES", [0])


def run_concurrently(engine: OcrEngine, names: list[str]) -> list[Outcome]:
    """Hold cls/rec until every image has passed det, so their crops queue together."""
    go, _entered = hold(engine, "cls-rec")
    det_inner = engine._det._run
    dets = {"n": 0}
    all_detected = threading.Event()

    def det_run(batch: Any) -> None:
        det_inner(batch)
        dets["n"] += 1
        if dets["n"] == len(names):
            all_detected.set()

    engine._det._run = det_run
    try:
        outs = [submit(engine, (IMAGES / n).read_bytes()) for n in names]
        assert all_detected.wait(WAIT_S)
        go.set()
        return [o.wait() for o in outs]
    finally:
        go.set()
        engine._det._run = det_inner
        engine._cr._run = engine._run_cls_rec


def test_concurrent_requests_share_batches_and_stay_identical(
        engine: OcrEngine, reference: dict[str, Any]) -> None:
    # (the module's engine, warm: run_concurrently puts its workers back)
    mixed_before = engine.multi_request_batches
    names = ["lines3.png", "lines3.jpg", "eight_lines.png", "photo.jpg", "lines3_upside.png",
             "tiny_la.png"]
    outs = run_concurrently(engine, names)
    for name, out in zip(names, outs, strict=True):
        assert out.error is None and out.calls == 1, name
        assert_same(out.result, reference[name], name)
    assert engine.multi_request_batches > mixed_before
    spans = [s for o in outs for s in o.clock.spans if s.name in ("cls", "rec")]
    assert any(s.requests > 1 for s in spans), spans  # for the operator's metrics
    # what a client is shown counts its own crops only (issue 25)
    assert all(re.fullmatch(r"\d+ crops?", s.note) for s in spans), spans
    assert max(engine.rec_batch_sizes) <= engine.options.rec_max_batch
    # Waits and runs of one job on the cls/rec thread never overlap.
    for out in outs:
        spans = sorted((s.start_ns, s.end_ns) for s in out.clock.spans
                       if s.name in ("cls-wait", "cls", "rec-wait", "rec"))
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


@pytest.mark.parametrize("budget", [2560, 0])  # 0: rapidocr's own chunks, unsplit
def test_cross_request_batching_off_is_identical_and_never_mixes(
        reference: dict[str, Any], budget: int) -> None:
    engine = make_engine(cross_request_batching=False, rec_max_pixels=budget)
    try:
        names = ["lines3.png", "eight_lines.png", "photo.jpg"]
        outs = run_concurrently(engine, names)
        for name, out in zip(names, outs, strict=True):
            assert out.error is None
            assert_same(out.result, reference[name], name)
        assert engine.multi_request_batches == 0
        assert max(engine.rec_batch_sizes) <= 6
    finally:
        engine.stop()
        engine.close()


def test_per_request_parameters_match_rapidocr_kwargs(engine: OcrEngine) -> None:
    ref = RapidOCR()  # its __call__ keeps kwargs as state: a fresh one for this test
    for name, params in (("lines3_upside.png", {"use_cls": False}),
                         ("photo.jpg", {"box_thresh": 0.7, "unclip_ratio": 2.0,
                                        "text_score": 0.9}),
                         ("eight_lines.png", {"text_score": 0.0, "box_thresh": 0.3})):
        kwargs = {"box_thresh": 0.5, "unclip_ratio": 1.6, "text_score": 0.5, **params}
        expected = ref((IMAGES / name).read_bytes(), **kwargs)[0]
        out = submit(engine, (IMAGES / name).read_bytes(), params).wait()
        assert out.error is None
        assert_same(out.result, expected, f"{name} {params}")
        if params.get("use_cls") is False:
            assert "cls" not in out.clock.totals_ns()


def test_outputs_and_plain(engine: OcrEngine, reference: dict[str, Any]) -> None:
    a = submit(engine, (IMAGES / "lines3.png").read_bytes()).wait().result
    b = submit(engine, (IMAGES / "photo.jpg").read_bytes()).wait().result
    tensors = {name: (dtype, shape, data) for name, dtype, shape, data in
               engine.outputs([a, b])}
    n = len(a) + len(b)
    assert tensors["text"][:2] == ("BYTES", [n])
    assert tensors["text"][2] == [ln.text for ln in a + b]
    assert tensors["boxes"][2].shape == (n, 4, 2) and tensors["boxes"][2].dtype == np.float32
    assert tensors["image_index"][2].tolist() == [0] * len(a) + [1] * len(b)
    assert tensors["scores"][2].dtype == np.float32
    plain = engine.plain(a)
    assert [[ln["box"], ln["text"], ln["score"]] for ln in plain["lines"]] == \
        reference["lines3.png"]


def test_deadline_cancel_stop_and_a_stage_bug() -> None:
    engine = make_engine()
    data = (IMAGES / "lines3.png").read_bytes()
    go, entered = hold(engine, "det")
    try:
        running = submit(engine, data)
        assert entered.wait(WAIT_S)  # det holds the first job: the next ones wait
        import time

        late = submit(engine, data, deadline_ns=time.perf_counter_ns() + 20_000_000)
        assert late.wait().error is not None  # failed at its deadline, det still held
        assert isinstance(late.error, DeadlineExceeded) and "det" not in late.clock.totals_ns()
        cancelled = submit(engine, data)
        assert cancelled.job is not None
        cancelled.job.cancelled = True
        waiting = submit(engine, data)
        assert engine.num_queued == 3 and engine.num_running == 0
        go.set()
        assert running.wait().error is None and running.result
        assert cancelled.wait().error is not None and "det" not in cancelled.clock.totals_ns()
        assert waiting.wait().error is None
        assert engine.num_queued == 0 and engine.num_running == 0

        # stop: waiting jobs fail with ModelNotReady, the running one finishes.
        go2, entered2 = hold(engine, "det")
        first = submit(engine, data)
        assert entered2.wait(WAIT_S)
        queued = submit(engine, data)
        stopper = threading.Thread(target=engine.stop)
        stopper.start()
        assert isinstance(queued.wait().error, ModelNotReady)
        go2.set()
        stopper.join(WAIT_S)
        assert first.wait().error is None and first.result
        for out in (running, late, cancelled, waiting, first, queued):
            assert out.calls == 1
    finally:
        go.set()
        engine.stop()
        engine.close()

    broken = make_engine()
    try:
        def bug(preds: Any) -> Any:
            raise IndexError("a bug in decoding")

        broken._ctc = bug
        out = submit(broken, data).wait()
        assert isinstance(out.error, RuntimeFailed) and out.calls == 1
        assert broken.alive and broken.num_running == 0
    finally:
        broken.stop()
        broken.close()


def test_recognition_work_is_refused_past_the_rec_width_before_rec() -> None:
    """Issue 25 finding 4: nothing bounded a request's recognition work. The padded widths
    of its crops are summed (over its files, through the request's budget) before cls/rec."""
    eng = make_engine(max_rec_width=900)
    try:
        out = submit(eng, (IMAGES / "lines3.png").read_bytes()).wait()
        assert isinstance(out.error, LimitExceeded), out.error
        assert out.error.param == "options.max_rec_width"
        assert out.error.need > 900 and "crops, summed" in str(out.error)
        assert out.calls == 1
        assert eng.rec_batch_sizes == {}  # rec never ran
        assert not any(s.name in ("cls", "rec") for s in out.clock.spans)
    finally:
        eng.stop()
        eng.close()
