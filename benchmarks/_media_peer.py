"""The in-process peers of ``media.py``: the packages called directly, as a user's own script
would, in a child process that ``media.py`` pins (taskset) to the server cores.

    python benchmarks/_media_peer.py SPEC_JSON     (then JSON lines on stdin; see ``main``)

SPEC: ``kind`` ("ocr" | "vad"), ``files`` (paths), ``max_concurrency`` (VAD: models to
create), ``threads`` (ORT intra-op threads of RapidOCR's sessions; null: RapidOCR's default,
i.e. ORT's own default), ``variant`` (VAD: "stock" or "sequence", see ``vad_runner``). Each
run: an ``order`` (indices into ``files``) by ``concurrency`` Python threads.

- ocr: ``RapidOCR()(bytes)`` (rapidocr-onnxruntime), one engine shared by the threads (its
  sessions are thread-safe; its per-call state is set to the same value by every call).
- vad: ``get_speech_timestamps(tensor, load_silero_vad(onnx=True))`` (or silero's sequence
  path) on the WAV's samples (16-bit PCM read with ``wave``, /32768 as silero's own reader
  gives); silero's ONNX wrapper keeps the stream's state in the object, so each call borrows
  one of ``max_concurrency`` models from a queue (sharing one gives wrong segments). The
  wrappers fix ORT at 1 intra-op and 1 inter-op thread.

Every file is run once untimed first (warm-up; its output is the reference the parent checks
everything against). A run's results: per call the file index, ms, and output (OCR: texts and
scores, and rapidocr's own [det, cls, rec] times; VAD: segments in samples, and the times of
reading the WAV and of the timestamps call), the wall time, and the process's CPU seconds.
"""

from __future__ import annotations

import io
import json
import sys
import threading
import time
import wave
from pathlib import Path
from typing import Any


def ocr_runner(threads: int | None) -> Any:
    from rapidocr_onnxruntime import RapidOCR

    kw = {} if threads is None else {"intra_op_num_threads": threads,
                                     "inter_op_num_threads": 1}
    engine = RapidOCR(**kw)

    def call(data: bytes) -> dict[str, Any]:
        result, elapse = engine(data)
        lines = result or []
        return {"texts": [r[1] for r in lines], "scores": [float(r[2]) for r in lines],
                "stages_ms": dict(zip(("det", "cls", "rec"),
                                      [e * 1e3 for e in (elapse or [0, 0, 0])], strict=False))}
    return lambda: call


def pcm16_mono(data: bytes) -> Any:
    import numpy as np

    with wave.open(io.BytesIO(data)) as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1 or w.getframerate() != 16000:
            raise ValueError("the benchmark's audio is 16 kHz mono 16-bit PCM")
        frames = w.readframes(w.getnframes())
    return np.frombuffer(frames, "<i2").astype(np.float32) / 32768.0


def vad_runner(models: int, variant: str) -> Any:
    """``stock``: ``get_speech_timestamps`` with ``load_silero_vad(onnx=True)`` (one ORT call
    per 512-sample frame); ``sequence``: silero's ``get_speech_timestamps_sequence`` with
    ``load_silero_vad(sequence=True)`` (the model Sokuji serves, up to 512 frames a call)."""
    import queue

    import torch
    from silero_vad import get_speech_timestamps, load_silero_vad
    from silero_vad.sequence_vad import get_speech_timestamps_sequence

    free: queue.SimpleQueue[Any] = queue.SimpleQueue()
    for _ in range(models):  # one per thread: the wrapper holds the stream's state
        free.put(load_silero_vad(onnx=True) if variant == "stock"
                 else load_silero_vad(sequence=True))
    timestamps = get_speech_timestamps if variant == "stock" else get_speech_timestamps_sequence

    def call(data: bytes) -> dict[str, Any]:
        model = free.get()
        try:
            t0 = time.perf_counter()
            x = torch.from_numpy(pcm16_mono(data))
            t1 = time.perf_counter()
            segs = timestamps(x, model, sampling_rate=16000)
            t2 = time.perf_counter()
        finally:
            free.put(model)
        return {"segments": [[int(s["start"]), int(s["end"])] for s in segs],
                "stages_ms": {"audio-decode": (t1 - t0) * 1e3, "timestamps": (t2 - t1) * 1e3}}
    return lambda: call


def run(call: Any, blobs: list[bytes], order: list[int], concurrency: int) -> dict[str, Any]:
    """``order`` through ``call`` by ``concurrency`` threads, each taking the next file when
    its last call returned."""
    cursor = iter(range(len(order)))
    lock = threading.Lock()
    calls: list[dict[str, Any]] = []

    def worker() -> None:
        while True:
            with lock:
                k = next(cursor, None)
            if k is None:
                return
            i = order[k]
            t0 = time.perf_counter()
            out = call(blobs[i])
            ms = (time.perf_counter() - t0) * 1e3
            with lock:
                calls.append({"file": i, "ms": ms, "end_s": time.perf_counter() - begin,
                              **out})

    cpu0 = time.process_time()
    begin = time.perf_counter()
    pool = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return {"wall_s": time.perf_counter() - begin, "cpu_s": time.process_time() - cpu0,
            "calls": calls}


def main() -> None:
    """Loads, runs every file once (the reference, written as the first line of stdout), then
    answers each request line on stdin (``{"order": [...], "concurrency": c}``) with a line of
    results, until stdin closes. The process stays up between runs, so runs of different
    contenders can alternate without reloading or re-warming."""
    out, sys.stdout = sys.stdout, sys.stderr  # stdout carries the results only
    spec = json.loads(sys.argv[1])
    blobs = [Path(f).read_bytes() for f in spec["files"]]
    t_load = time.perf_counter()
    make = (ocr_runner(spec.get("threads")) if spec["kind"] == "ocr"
            else vad_runner(spec["max_concurrency"], spec.get("variant", "stock")))
    call = make()
    load_s = time.perf_counter() - t_load
    reference = [call(b) for b in blobs]  # warm-up, and the reference outputs
    for _ in range(spec["max_concurrency"] - 1):  # every VAD model once (SimpleQueue is FIFO)
        call(blobs[0])
    print(json.dumps({"load_s": load_s, "reference": reference}), file=out, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        print(json.dumps(run(call, blobs, request["order"], request["concurrency"])), file=out,
              flush=True)


if __name__ == "__main__":
    main()
