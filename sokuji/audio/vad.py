"""Voice activity detection: silero-vad's torch-free sequence ONNX model behind the
``MediaEngine`` contract (``sokuji/media/engine.py``).

- **Model.** ``vad_model``: silero's sequence ONNX model without torch; the segments equal
  silero's ``get_speech_timestamps(x16k, load_silero_vad(onnx=True))`` on the same 16 kHz
  samples (``tests/integration/test_vad_identity.py``).
- **Stages.** ``audio-decode`` and ``resample`` (``decode``, in the media lane); then
  on a worker ``infer-wait`` (queued until a worker took it), ``infer`` (frames to
  probabilities, blocks of <= 512 frames) and ``segments`` (``vad_segments``).
- **Workers.** ``instances`` threads (option, default 1), each with its own session of
  ``threads`` intra-op threads (option; else the model's ``intra_op_threads``; else 1). A free
  worker takes the waiting job that ranks first (``core/policy.rank``: priority with aging,
  then arrival). One request at a time per worker: the sequence model already runs a whole
  file per call, and batching files across requests would only save Python per frame.
- **Cost bound** (``limits``, ``core/limits.py``): a file's seconds, rate and channels
  from its header, before a sample is decoded (``media/audio.py``); its bytes at the source
  rate follow (seconds x rate x 4); its samples after resampling to 16 kHz are checked
  before resampling, and bound the model's frames (one per 512 samples).
- **Deadlines.** A job still waiting at ``deadline_ns`` fails with ``DeadlineExceeded`` (a
  timer thread expires it even while every worker is busy); a cancelled job is answered with
  ``Cancelled`` (499) without running; ``done`` is called exactly once per job.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sokuji.audio.vad_model import (
    MODEL_FILE,
    PARAMETERS,
    RATE_HZ,
    FrameModel,
    check_parameters,
    frames_of,
    new_session,
    segment,
)
from sokuji.audio.vad_options import VadOptions
from sokuji.core import policy
from sokuji.core.limits import Limit
from sokuji.core.model import ModelMetadata, TensorSpec
from sokuji.core.request import Priority
from sokuji.errors import ConfigError, DeadlineExceeded, ModelNotReady, RuntimeFailed, SokujiError
from sokuji.media import audio
from sokuji.media.engine import MediaJob, StageClock

STOP_JOIN_S = 30.0


class Cancelled(SokujiError):
    """The client went away before the job ran (nobody reads the answer)."""

    status = 499
    code = "cancelled"


@dataclass(frozen=True, slots=True)
class VadAudio:
    """What ``decode`` returns: the 16 kHz mono samples the model is fed."""

    samples_16k: np.ndarray
    duration_s: float
    """Of the source file (frames / rate)."""
    source_rate_hz: int


@dataclass(frozen=True, slots=True)
class VadResult:
    segments: list[tuple[int, int]]
    """(start, end) in 16 kHz samples, silero's units."""
    duration_s: float


def limits(lim: audio.AudioLimits) -> tuple[Limit, ...]:
    """Kind vad's cost bound; the last is the samples after resampling."""
    return (
        Limit("options.max_audio_s", lim.max_audio_s, "seconds",
              "length of one audio file, from its header"),
        Limit("options.max_rate_hz", lim.max_rate_hz, "Hz", "sample rate of one audio file"),
        Limit("options.max_channels", lim.max_channels, "channels",
              "channels of one audio file"),
        Limit("source_bytes", lim.max_source_bytes, "bytes",
              "one file's mono float32 samples at its source rate (options.max_audio_s x "
              "options.max_rate_hz x 4)"),
        Limit("samples_16k", int(lim.max_audio_s * RATE_HZ) + 1, "samples",
              "one file's samples after resampling to 16 kHz (options.max_audio_s x 16000)"))


class VadEngine:
    """The ``MediaEngine`` of runtime ``vad``: one V2 input ``audio`` (WAV/FLAC bytes), the
    segments out. Options: ``VadOptions`` (``vad_options.py``, checked when the config
    loads): ``instances``, ``threads``, ``max_audio_s``, ``priority_aging_ms`` and the
    defaults of the per-request parameters (``PARAMETERS``)."""

    input_name = "audio"
    stage_names = ("audio-decode", "resample", "infer-wait", "infer", "segments")
    streams = True
    metadata = ModelMetadata(
        platform="onnxruntime_onnx",
        inputs=(TensorSpec("audio", "BYTES", (-1,), media_types=audio.MEDIA_TYPES),),
        outputs=(TensorSpec("segments", "FP32", (-1, 2)),
                 TensorSpec("segments_samples", "INT64", (-1, 2)),
                 TensorSpec("audio_index", "INT32", (-1,)),
                 TensorSpec("duration_s", "FP32", (-1,))))

    def __init__(self, name: str, options: VadOptions) -> None:
        self.name = name
        self.instances = options.instances
        self.threads = options.threads or 1
        self.audio_limits = lim = audio.AudioLimits(
            max_audio_s=options.max_audio_s, max_rate_hz=options.max_rate_hz,
            max_channels=options.max_channels)
        self.limits = limits(lim)
        self._samples = self.limits[-1]
        self.aging_ns = policy.aging_ns(options.priority_aging_ms)
        self.defaults = {k: getattr(options, k) for k in PARAMETERS}
        self._sessions: list[Any] = []
        self._cond = threading.Condition()
        self._waiting: dict[Priority, deque[MediaJob]] = {p: deque() for p in Priority}
        self._running = 0
        self._threads: list[threading.Thread] = []
        self._accepting = False
        self._stopping = False

    # -- loading ---------------------------------------------------------------------------

    def load(self) -> None:
        try:
            self._sessions = [new_session(self.threads) for _ in range(self.instances)]
        except SokujiError:
            raise
        except Exception as exc:
            raise ConfigError.for_key("runtime", "vad", f"cannot load {MODEL_FILE}: "
                                      f"{exc}") from exc

    def warmup(self) -> None:
        """Every session once (ONNX Runtime plans its kernels on the first run), and the
        decode path once (soxr's import and plan)."""
        rng = np.random.default_rng(0)
        t = np.arange(22050, dtype=np.float32) / 22050
        tone = (0.3 * np.sin(2 * np.pi * 220 * t) + rng.normal(0, 0.01, t.size)).astype(
            np.float32)
        decoded = self.decode(audio.pack_wav(tone, 22050), StageClock())
        for session in self._sessions:
            FrameModel(session).run(frames_of(decoded.samples_16k))

    def close(self) -> None:
        self._sessions = []

    # -- the media lane (core/offload.media_lane) ---------------------------------------

    def decode(self, data: bytes, clock: StageClock) -> VadAudio:
        t0 = time.perf_counter_ns()
        x, info = audio.decode(data, self.audio_limits)
        t1 = time.perf_counter_ns()
        clock.add("audio-decode", t0, t1, f"{info.format} {info.sample_rate} Hz "
                                          f"x{info.channels}")
        self._samples.check(audio.samples_at(len(x), info.sample_rate, RATE_HZ), "the audio")
        x16k = audio.resample(x, info.sample_rate, RATE_HZ)
        clock.add("resample", t1, time.perf_counter_ns())
        assert info.duration_s is not None
        return VadAudio(x16k, info.duration_s, info.sample_rate)

    def parameters(self, raw: Mapping[str, Any]) -> Mapping[str, Any]:
        return check_parameters(raw, self.defaults)

    # -- the workers ------------------------------------------------------------------------

    def start(self) -> None:
        if not self._sessions:
            raise ModelNotReady(f"model '{self.name}' is not loaded")
        with self._cond:
            self._accepting, self._stopping = True, False
        self._threads = [threading.Thread(target=self._work, args=(s,), daemon=True,
                                          name=f"sokuji-{self.name}-{i}")
                         for i, s in enumerate(self._sessions)]
        self._threads.append(threading.Thread(target=self._expire, daemon=True,
                                              name=f"sokuji-{self.name}-deadlines"))
        for thread in self._threads:
            thread.start()

    @property
    def alive(self) -> bool:
        return bool(self._threads) and self._accepting and all(
            t.is_alive() for t in self._threads)

    @property
    def stream_session(self) -> Any:
        """A session for ``vad_stream.VadStream`` (ONNX Runtime sessions run concurrently)."""
        if not self._sessions:
            raise ModelNotReady(f"model '{self.name}' is not loaded")
        return self._sessions[0]

    def open_stream(self, content_type: str, params: Mapping[str, str]) -> Any:
        """A WAV streamed in, its segments out as they are final (``vad_stream.py``)."""
        from sokuji.audio.vad_stream import VadRecords

        return VadRecords(self, content_type, params)

    @property
    def num_queued(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    @property
    def num_running(self) -> int:
        return self._running

    def enqueue(self, job: MediaJob) -> None:
        if not job.enqueued_ns:
            job.enqueued_ns = time.perf_counter_ns()
        with self._cond:
            if self._accepting:
                self._waiting[job.priority].append(job)
                self._cond.notify_all()
                return
        _finish(job, None, ModelNotReady(f"model '{self.name}' is stopping"))

    def stop(self) -> None:
        with self._cond:
            self._accepting, self._stopping = False, True
            left = [j for q in self._waiting.values() for j in q]
            for q in self._waiting.values():
                q.clear()
            self._cond.notify_all()
        for job in left:
            _finish(job, None, ModelNotReady(f"model '{self.name}' stopped"))
        deadline = time.monotonic() + STOP_JOIN_S
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads = []

    def _next(self, now_ns: int) -> MediaJob | None:
        """The waiting job that goes first (under the lock): best rank, then oldest."""
        best: tuple[int, int] | None = None
        chosen: deque[MediaJob] | None = None
        for q in self._waiting.values():
            if q:
                head = q[0]
                key = (policy.rank(head.priority, now_ns - head.enqueued_ns, self.aging_ns),
                       head.enqueued_ns)
                if best is None or key < best:
                    best, chosen = key, q
        return chosen.popleft() if chosen is not None else None

    def _work(self, session: Any) -> None:
        while True:
            with self._cond:
                job = self._next(time.perf_counter_ns())
                while job is None:
                    if self._stopping:
                        return
                    self._cond.wait()
                    job = self._next(time.perf_counter_ns())
                self._running += 1
            try:
                self._run(job, session)
            finally:
                with self._cond:
                    self._running -= 1

    def _run(self, job: MediaJob, session: Any) -> None:
        start = time.perf_counter_ns()
        job.clock.add("infer-wait", job.enqueued_ns, start)
        if job.cancelled:
            _finish(job, None, Cancelled("cancelled: the client went away"))
            return
        if job.deadline_ns is not None and start >= job.deadline_ns:
            _finish(job, None, _late(job))
            return
        try:
            x16k = job.decoded.samples_16k
            probs = FrameModel(session).run(frames_of(x16k))
            t1 = time.perf_counter_ns()
            job.clock.add("infer", start, t1, f"{len(probs)} frames")
            segments = segment(probs, len(x16k), job.params)
            job.clock.add("segments", t1, time.perf_counter_ns())
            result = VadResult(segments, job.decoded.duration_s)
        except Exception as exc:  # noqa: BLE001 - the runtime failed: this job's 500; the worker lives on
            _finish(job, None, RuntimeFailed(f"model '{self.name}' failed: {exc}"))
            return
        _finish(job, result, None)

    def _expire(self) -> None:
        """Fail waiting jobs whose deadline passed, even while every worker is busy."""
        while True:
            late: list[MediaJob] = []
            with self._cond:
                if self._stopping:
                    return
                now = time.perf_counter_ns()
                nearest: int | None = None
                for q in self._waiting.values():
                    for job in list(q):
                        if job.deadline_ns is None:
                            continue
                        if job.deadline_ns <= now:
                            q.remove(job)
                            late.append(job)
                        elif nearest is None or job.deadline_ns < nearest:
                            nearest = job.deadline_ns
                if not late:
                    self._cond.wait(None if nearest is None else (nearest - now) / 1e9)
            for job in late:
                job.clock.add("infer-wait", job.enqueued_ns, time.perf_counter_ns())
                _finish(job, None, _late(job))

    # -- answers ----------------------------------------------------------------------------

    def outputs(self, results: list[Any]) -> list[tuple[str, str, list[int], Any]]:
        samples = [s for r in results for s in r.segments]
        index = [i for i, r in enumerate(results) for _ in r.segments]
        seg = np.asarray(samples, np.int64).reshape(-1, 2)
        return [("segments", "FP32", [len(seg), 2], (seg / RATE_HZ).astype(np.float32)),
                ("segments_samples", "INT64", [len(seg), 2], seg),
                ("audio_index", "INT32", [len(seg)], np.asarray(index, np.int32)),
                ("duration_s", "FP32", [len(results)],
                 np.asarray([r.duration_s for r in results], np.float32))]

    def plain(self, result: Any) -> dict[str, Any]:
        return {"segments": [{"start": s / RATE_HZ, "end": e / RATE_HZ,
                              "start_sample": s, "end_sample": e}
                             for s, e in result.segments],
                "duration_s": result.duration_s}


def _late(job: MediaJob) -> DeadlineExceeded:
    assert job.deadline_ns is not None
    waited_ms = (time.perf_counter_ns() - job.enqueued_ns) / 1e6
    return DeadlineExceeded(f"could not start before its deadline (waited {waited_ms:.0f} ms "
                            f"for a worker)")


def _finish(job: MediaJob, result: Any, error: BaseException | None) -> None:
    """``done`` once; a failing callback (a serving-layer bug) must not kill the worker."""
    if job.extra.get("done"):
        return
    job.extra["done"] = True
    try:
        job.done(result, error)
    except Exception:  # logged, not raised: the worker serves the next job
        import logging

        logging.getLogger(__name__).exception("done() raised for a vad job")
