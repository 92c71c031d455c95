"""The VAD engine against silero-vad itself: its segments equal silero's
``get_speech_timestamps`` with ``load_silero_vad(onnx=True)`` on the same 16 kHz samples
(exactly), and are within one frame of the TorchScript model; the per-request parameters act
as silero's arguments do; and the engine's contract: deadlines, cancel, stop, priority,
failures, exactly one ``done`` per job. silero_vad (and torch) are imported only here."""

from __future__ import annotations

import math
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sokuji.audio.vad import Cancelled, VadAudio, VadEngine
from sokuji.audio.vad_options import VadOptions
from sokuji.audio.vad_segments import get_speech_timestamps_from_probs
from sokuji.config import ModelConfig
from sokuji.core.request import Priority
from sokuji.errors import (
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    ModelNotReady,
    RuntimeFailed,
)
from sokuji.media.engine import MediaJob, StageClock
from tests.conftest import options_of

DATA = Path(__file__).resolve().parent.parent / "data" / "media" / "audio"
FIXTURES = sorted(p.name for p in DATA.iterdir() if p.suffix in (".wav", ".flac"))
WAIT_S = 30.0
"""Bound on every wait for a thread (never reached when the engine works)."""


@pytest.fixture(scope="module")
def silero() -> Any:
    pytest.importorskip("torch")
    import silero_vad

    return silero_vad


@pytest.fixture(scope="module")
def engine() -> Iterator[VadEngine]:
    eng = VadEngine("vad", VadOptions())
    eng.load()
    eng.warmup()
    eng.start()
    yield eng
    eng.stop()
    eng.close()


class Done:
    """A job's ``done``: records each call; ``hold`` blocks the calling worker until
    ``release`` (how a test keeps a worker busy without sleeping)."""

    def __init__(self, hold: bool = False) -> None:
        self.calls: list[tuple[Any, BaseException | None]] = []
        self.called = threading.Event()
        self._release = threading.Event()
        if not hold:
            self._release.set()
        self.order: list[Any] | None = None
        self.tag: Any = None

    def __call__(self, result: Any, error: BaseException | None) -> None:
        self.calls.append((result, error))
        if self.order is not None:
            self.order.append(self.tag)
        self.called.set()
        assert self._release.wait(WAIT_S)

    def release(self) -> None:
        self._release.set()

    def get(self) -> tuple[Any, BaseException | None]:
        assert self.called.wait(WAIT_S), "done was not called"
        assert len(self.calls) == 1
        return self.calls[0]


def job(eng: VadEngine, decoded: Any, params: dict[str, Any] | None = None,
        deadline_ns: int | None = None, priority: Priority = Priority.INTERACTIVE,
        done: Done | None = None) -> MediaJob:
    return MediaJob(decoded, eng.parameters(params or {}), StageClock(), deadline_ns, priority,
                    done or Done())


def run(eng: VadEngine, data: bytes, params: dict[str, Any] | None = None) -> tuple[Any, Any]:
    clock = StageClock()
    decoded = eng.decode(data, clock)
    j = MediaJob(decoded, eng.parameters(params or {}), clock, None, Priority.INTERACTIVE,
                 Done())
    eng.enqueue(j)
    result, error = j.done.get()  # type: ignore[attr-defined]
    assert error is None
    return decoded, result


def silero_segments(silero: Any, x16k: np.ndarray, model: Any,
                    **kwargs: Any) -> list[tuple[int, int]]:
    import torch

    ts = silero.get_speech_timestamps(torch.from_numpy(x16k), model, **kwargs)
    return [(t["start"], t["end"]) for t in ts]


@pytest.mark.parametrize("name", FIXTURES)
def test_segments_equal_silero_onnx_and_within_a_frame_of_jit(
        engine: VadEngine, silero: Any, name: str) -> None:
    decoded, result = run(engine, (DATA / name).read_bytes())
    ref = silero_segments(silero, decoded.samples_16k, silero.load_silero_vad(onnx=True))
    assert result.segments == ref
    jit = silero_segments(silero, decoded.samples_16k, silero.load_silero_vad())
    assert len(jit) == len(ref)
    for (s, e), (js, je) in zip(result.segments, jit, strict=True):
        assert abs(s - js) <= 512 and abs(e - je) <= 512
    if name != "silence.wav":
        assert result.segments, "speech fixtures have speech"
    else:
        assert result.segments == []


def test_the_wav_and_flac_of_the_talk_agree(engine: VadEngine) -> None:
    _, wav = run(engine, (DATA / "talk16k.wav").read_bytes())
    _, flac = run(engine, (DATA / "talk16k.flac").read_bytes())
    assert wav.segments == flac.segments and len(wav.segments) == 3


PARAMS = [
    {"threshold": 0.3},
    {"threshold": 0.8},
    {"min_speech_duration_ms": 2000},
    {"min_silence_duration_ms": 20, "speech_pad_ms": 0},
    {"speech_pad_ms": 200},
    {"max_speech_duration_s": 1.0},
    {"max_speech_duration_s": 2.5, "speech_pad_ms": 60, "threshold": 0.4},
]


@pytest.mark.parametrize("params", PARAMS)
def test_parameters_act_as_silero_arguments(engine: VadEngine, silero: Any,
                                            params: dict[str, Any]) -> None:
    data = (DATA / "talk16k.wav").read_bytes()
    decoded, result = run(engine, data, params)
    ref = silero_segments(silero, decoded.samples_16k, silero.load_silero_vad(onnx=True),
                          **params)
    assert result.segments == ref
    _, default = run(engine, data)
    assert result.segments != default.segments, "each parameter set changes this file's result"


def test_ported_segmenter_equals_silero_on_random_probabilities(silero: Any) -> None:
    from silero_vad.utils_vad import get_speech_timestamps_from_probs as theirs

    rng = random.Random(14)
    for _ in range(1500):
        probs, level = [], rng.random()
        for _ in range(rng.randint(0, 300)):
            if rng.random() < 0.1:
                level = rng.random()
            probs.append(min(1.0, max(0.0, level + rng.gauss(0, 0.05))))
        kwargs: dict[str, Any] = {"threshold": rng.choice([0.3, 0.5, 0.7]),
                  "min_speech_duration_ms": rng.choice([0, 100, 250, 500]),
                  "max_speech_duration_s": rng.choice([math.inf, 0.5, 1, 2]),
                  "min_silence_duration_ms": rng.choice([0, 50, 100, 300]),
                  "speech_pad_ms": rng.choice([0, 30, 100, 200]),
                  "use_max_poss_sil_at_max_speech": rng.random() < 0.7,
                  "return_seconds": rng.random() < 0.2}
        length = max(0, len(probs) * 512 - rng.randint(0, 511))
        assert get_speech_timestamps_from_probs(list(probs), audio_length_samples=length,
                                                **kwargs) == theirs(
            list(probs), audio_length_samples=length, **kwargs)


def test_outputs_and_plain(engine: VadEngine) -> None:
    _, a = run(engine, (DATA / "talk16k.wav").read_bytes())
    _, b = run(engine, (DATA / "silence.wav").read_bytes())
    _, c = run(engine, (DATA / "talk22k_cut.wav").read_bytes())
    out = {name: (dtype, shape, data) for name, dtype, shape, data in engine.outputs([a, b, c])}
    n = len(a.segments) + len(c.segments)
    assert out["segments_samples"][:2] == ("INT64", [n, 2])
    assert out["segments_samples"][2].tolist() == [list(s) for s in a.segments + c.segments]
    assert out["segments"][:2] == ("FP32", [n, 2])
    assert np.array_equal(out["segments"][2], (out["segments_samples"][2] / 16000).astype(
        np.float32))
    assert out["audio_index"][2].tolist() == [0] * len(a.segments) + [2] * len(c.segments)
    assert out["duration_s"][:2] == ("FP32", [3])
    assert out["duration_s"][2].tolist() == pytest.approx([9.585, 1.2, c.duration_s])
    plain = engine.plain(a)
    assert plain["duration_s"] == 9.585
    assert plain["segments"][0] == {"start": a.segments[0][0] / 16000,
                                    "end": a.segments[0][1] / 16000,
                                    "start_sample": a.segments[0][0],
                                    "end_sample": a.segments[0][1]}


def test_stages_are_recorded(engine: VadEngine) -> None:
    clock = StageClock()
    decoded = engine.decode((DATA / "talk44k_stereo_cut.wav").read_bytes(), clock)
    j = MediaJob(decoded, engine.parameters({}), clock, None, Priority.INTERACTIVE, Done())
    engine.enqueue(j)
    j.done.get()  # type: ignore[attr-defined]
    assert list(clock.totals_ns()) == list(engine.stage_names)


@pytest.fixture
def busy() -> Iterator[tuple[VadEngine, Done]]:
    """A one-worker engine whose worker is held inside a job's ``done``."""
    eng = VadEngine("vad", VadOptions(priority_aging_ms=60_000))
    eng.load()
    eng.start()
    holder = Done(hold=True)
    eng.enqueue(job(eng, eng.decode((DATA / "silence.wav").read_bytes(), StageClock()),
                    done=holder))
    assert holder.called.wait(WAIT_S)
    yield eng, holder
    holder.release()
    eng.stop()
    eng.close()


def small(eng: VadEngine) -> VadAudio:
    return eng.decode((DATA / "silence.wav").read_bytes(), StageClock())


def test_deadline_fails_a_waiting_job_while_the_worker_is_busy(
        busy: tuple[VadEngine, Done]) -> None:
    import time

    eng, holder = busy
    j = job(eng, small(eng), deadline_ns=time.perf_counter_ns() + 20_000_000)
    eng.enqueue(j)
    result, error = j.done.get()  # type: ignore[attr-defined]
    assert result is None and isinstance(error, DeadlineExceeded)
    assert not holder._release.is_set(), "expired while the worker was still busy"
    assert "infer" not in j.clock.totals_ns()
    assert eng.num_queued == 0


def test_cancelled_job_is_answered_without_running(busy: tuple[VadEngine, Done]) -> None:
    eng, holder = busy
    j = job(eng, small(eng))
    j.cancelled = True
    eng.enqueue(j)
    holder.release()
    result, error = j.done.get()  # type: ignore[attr-defined]
    assert result is None and isinstance(error, Cancelled)
    assert "infer" not in j.clock.totals_ns()


def test_priority_then_arrival(busy: tuple[VadEngine, Done]) -> None:
    eng, holder = busy
    order: list[str] = []
    jobs = []
    for tag, priority in (("batch-1", Priority.BATCH), ("batch-2", Priority.BATCH),
                          ("inter-1", Priority.INTERACTIVE), ("inter-2", Priority.INTERACTIVE)):
        d = Done()
        d.order, d.tag = order, tag
        jobs.append(job(eng, small(eng), priority=priority, done=d))
    for j in jobs:
        eng.enqueue(j)
    assert eng.num_queued == 4 and eng.num_running == 1
    holder.release()
    for j in jobs:
        assert j.done.get()[1] is None  # type: ignore[attr-defined]
    assert order == ["inter-1", "inter-2", "batch-1", "batch-2"]


def test_aged_batch_job_goes_in_arrival_order() -> None:
    eng = VadEngine("vad", VadOptions(priority_aging_ms=0))
    eng.load()
    eng.start()
    try:
        holder = Done(hold=True)
        eng.enqueue(job(eng, small(eng), done=holder))
        assert holder.called.wait(WAIT_S)
        order: list[str] = []
        jobs = []
        for tag, priority in (("batch", Priority.BATCH), ("inter", Priority.INTERACTIVE)):
            d = Done()
            d.order, d.tag = order, tag
            jobs.append(job(eng, small(eng), priority=priority, done=d))
            eng.enqueue(jobs[-1])
        holder.release()
        for j in jobs:
            j.done.get()  # type: ignore[attr-defined]
        assert order == ["batch", "inter"]
    finally:
        eng.stop()


def test_stop_fails_waiting_jobs_lets_the_running_one_finish(
        busy: tuple[VadEngine, Done]) -> None:
    eng, holder = busy
    waiting = job(eng, small(eng))
    eng.enqueue(waiting)
    stopper = threading.Thread(target=eng.stop)
    stopper.start()
    _, error = waiting.done.get()  # type: ignore[attr-defined]
    assert isinstance(error, ModelNotReady)
    holder.release()
    stopper.join(WAIT_S)
    assert not stopper.is_alive() and not eng.alive
    assert holder.calls[0][1] is None and holder.calls[0][0] is not None
    late = job(eng, small(eng))
    eng.enqueue(late)
    assert isinstance(late.done.get()[1], ModelNotReady)  # type: ignore[attr-defined]


def test_a_failing_job_is_a_runtime_failure_and_the_worker_lives(engine: VadEngine) -> None:
    bad = job(engine, VadAudio(np.zeros((2, 2, 2), np.float32), 1.0, 16000))
    engine.enqueue(bad)
    result, error = bad.done.get()  # type: ignore[attr-defined]
    assert result is None and isinstance(error, RuntimeFailed)
    assert engine.alive
    good = job(engine, small(engine))
    engine.enqueue(good)
    assert good.done.get()[1] is None  # type: ignore[attr-defined]


def test_two_instances_give_the_same_segments() -> None:
    eng = VadEngine("vad2", VadOptions(instances=2, threads=1))
    eng.load()
    eng.start()
    try:
        data = (DATA / "talk16k.wav").read_bytes()
        jobs = [job(eng, eng.decode(data, StageClock())) for _ in range(6)]
        for j in jobs:
            eng.enqueue(j)
        results = [j.done.get()[0].segments for j in jobs]  # type: ignore[attr-defined]
        assert all(r == results[0] for r in results) and len(results[0]) == 3
        assert len([t for t in threading.enumerate() if t.name.startswith("sokuji-vad2-")]) == 3
    finally:
        eng.stop()


@pytest.mark.parametrize(("options", "key"), [
    ({"instances": 0}, "instances"), ({"instances": 1.5}, "instances"),
    ({"threads": "2"}, "threads"), ({"max_audio_s": -1}, "max_audio_s"),
    ({"threshold": 1.0}, "threshold"), ({"threshold": 0}, "threshold"),
    ({"speech_pad_ms": -5}, "speech_pad_ms"),
    ({"min_silence_duration_ms": True}, "min_silence_duration_ms"),
    ({"min_speech_duration_ms": float("nan")}, "min_speech_duration_ms"),
    ({"treshold": 0.5}, "treshold")])
def test_options_are_checked_when_the_config_loads(options: dict[str, Any], key: str) -> None:
    key = f"models[0].options.{key}"
    with pytest.raises(ConfigError) as info:  # before any build
        options_of(ModelConfig(name="vad", runtime="vad", options=options))
    assert info.value.param == key and f"'{key}'" in info.value.message


def test_option_defaults_are_the_request_defaults() -> None:
    eng = VadEngine("vad", VadOptions(threshold=0.8, max_audio_s=5))
    assert eng.parameters({})["threshold"] == 0.8
    assert eng.parameters({"threshold": 0.3})["threshold"] == 0.3
    assert eng.audio_limits.max_audio_s == 5


@pytest.mark.parametrize(("raw", "key"), [
    ({"threshold": 0}, "threshold"), ({"threshold": 1}, "threshold"),
    ({"threshold": "0.5"}, "threshold"), ({"threshold": True}, "threshold"),
    ({"min_speech_duration_ms": -1}, "min_speech_duration_ms"),
    ({"min_silence_duration_ms": None}, "min_silence_duration_ms"),
    ({"speech_pad_ms": -1}, "speech_pad_ms"),
    ({"max_speech_duration_s": 0}, "max_speech_duration_s")])
def test_bad_parameters_are_400_naming_the_key(engine: VadEngine, raw: dict[str, Any],
                                              key: str) -> None:
    with pytest.raises(InvalidInput) as info:
        engine.parameters(raw)
    assert info.value.param == key and f"'{key}'" in info.value.message


def test_unknown_parameters_are_ignored(engine: VadEngine) -> None:
    assert engine.parameters({"binary_data_output": True}) == engine.parameters({})


def test_serving_imports_neither_torch_nor_silero_vad() -> None:
    code = ("import sys; from sokuji.audio.vad import VadEngine; "
            "from sokuji.audio.vad_options import VadOptions; e = VadEngine('v', VadOptions()); "
            "e.load(); e.warmup(); "
            "assert 'torch' not in sys.modules and 'silero_vad' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith(('torch', 'silero')))")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
