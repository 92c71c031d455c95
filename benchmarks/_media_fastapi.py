"""The FastAPI peer of ``media.py``: the packages' own pipelines behind FastAPI, written the way
a user typically would: one uvicorn process, a plain ``def`` endpoint (FastAPI runs it in its
threadpool, 40 threads, as its documentation recommends for blocking code) that takes the
file as the raw request body (``bytes = Body()``: FastAPI reads a non-JSON body as bytes)
and answers JSON.

- ``POST /ocr``: ``RapidOCR()(body)`` on one engine shared by the threadpool; answers
  ``{"lines": [{"text", "score", "box"}]}`` (the shape of Sokuji's raw-file answer).
- ``POST /vad``: silero's ``get_speech_timestamps`` with ``load_silero_vad(onnx=True)`` on the
  WAV's samples (``MEDIA_PEER_VAD=sequence``: its ``get_speech_timestamps_sequence`` with
  ``load_silero_vad(sequence=True)``, the model Sokuji serves); a model per call from a pool
  (silero's wrapper holds the stream's state, so one shared model would mix requests);
  answers ``{"segments": [{"start", "end"}], "duration_s"}`` in samples at 16 kHz.

Configured by environment variables: ``MEDIA_PEER_KIND`` (ocr | vad: only that model is
loaded, so the OCR peer never imports torch), ``MEDIA_PEER_THREADS`` (RapidOCR's intra-op
threads; unset: its default), ``MEDIA_PEER_MODELS`` (VAD models in the pool, default 4) and
``MEDIA_PEER_VAD`` (stock | sequence).
Run it with uvicorn: ``uvicorn --app-dir benchmarks _media_fastapi:app``.
"""

from __future__ import annotations

import os
import queue
from typing import Any

from _media_peer import pcm16_mono
from fastapi import Body, FastAPI, HTTPException

KIND = os.environ.get("MEDIA_PEER_KIND", "ocr")
app = FastAPI()

if KIND == "ocr":
    from rapidocr_onnxruntime import RapidOCR

    threads = os.environ.get("MEDIA_PEER_THREADS")
    engine = RapidOCR(**({} if not threads else {"intra_op_num_threads": int(threads),
                                                 "inter_op_num_threads": 1}))

    @app.post("/ocr")
    def ocr(data: bytes = Body()) -> dict[str, Any]:
        try:
            result, _ = engine(data)
        except Exception as e:  # a user's app would answer 400 for a file it cannot read
            raise HTTPException(400, f"cannot read the image: {e}") from e
        return {"lines": [{"text": r[1], "score": float(r[2]),
                           "box": [[float(x), float(y)] for x, y in r[0]]}
                          for r in (result or [])]}
elif KIND == "vad":
    import torch
    from silero_vad import get_speech_timestamps, load_silero_vad
    from silero_vad.sequence_vad import get_speech_timestamps_sequence

    SEQUENCE = os.environ.get("MEDIA_PEER_VAD", "stock") == "sequence"
    pool: queue.SimpleQueue[Any] = queue.SimpleQueue()
    for _ in range(int(os.environ.get("MEDIA_PEER_MODELS", "4"))):
        pool.put(load_silero_vad(sequence=True) if SEQUENCE else load_silero_vad(onnx=True))
    timestamps = get_speech_timestamps_sequence if SEQUENCE else get_speech_timestamps

    @app.post("/vad")
    def vad(data: bytes = Body()) -> dict[str, Any]:
        try:
            x = pcm16_mono(data)
        except Exception as e:
            raise HTTPException(400, f"cannot read the audio: {e}") from e
        model = pool.get()
        try:
            segs = timestamps(torch.from_numpy(x), model, sampling_rate=16000)
        finally:
            pool.put(model)
        return {"segments": [{"start": int(s["start"]), "end": int(s["end"])} for s in segs],
                "duration_s": len(x) / 16000}
else:
    raise SystemExit(f"MEDIA_PEER_KIND must be ocr or vad, got {KIND!r}")


@app.get("/health")
def health() -> dict[str, bool]:
    return {"ready": True}
