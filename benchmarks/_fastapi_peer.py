"""The plain FastAPI peer for ``goodput.py``: the same ONNX session code Sokuji uses
(``OnnxEncoderRuntime``: the same tokenizer, graph, thread count and padding), served the way
a user typically writes it from FastAPI's tutorial: Pydantic models for the request and the
response, the model loaded at import, one request -> one session call, no batching.

Two ways of calling the session, chosen by ``FASTAPI_PEER_MODE``:
- ``sync`` (default; what FastAPI's documentation recommends for blocking code): a plain
  ``def`` endpoint, which FastAPI runs in its threadpool (AnyIO, 40 threads). ONNX Runtime
  releases the GIL, so concurrent requests run their session calls side by side on the one
  core.
- ``async``: an ``async def`` endpoint calling the session directly, which blocks the event
  loop for the call: requests are computed strictly one at a time.

It speaks KServe V2 JSON (one BYTES input ``text``, one FP32 output ``embedding``), the same
shape Sokuji answers, so one load generator drives both. Configured by environment variables
(not ``SOKUJI_*``, which Sokuji's own config reads): ``FASTAPI_PEER_CACHE_DIR`` (where
``sokuji export minilm`` put the ONNX file) and ``FASTAPI_PEER_MODE``. Run it with uvicorn:
``uvicorn --app-dir benchmarks _fastapi_peer:app``.
"""

from __future__ import annotations

import os
from typing import Literal

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

from sokuji.runtimes.onnx import OnnxEncoderRuntime
from sokuji.weights import minilm

MODE = os.environ.get("FASTAPI_PEER_MODE", "sync")
if MODE not in ("sync", "async"):
    raise SystemExit(f"FASTAPI_PEER_MODE must be sync or async, got {MODE!r}")

runtime = OnnxEncoderRuntime(minilm.ensure_onnx(os.environ["FASTAPI_PEER_CACHE_DIR"]),
                             minilm.tokenizer_path(), intra_op_threads=1,
                             max_sequence_length=minilm.max_sequence_length())
runtime.load()
runtime.warmup()


class InferInput(BaseModel):
    name: str
    datatype: Literal["BYTES"]
    shape: list[int]
    data: list[str]


class InferRequest(BaseModel):
    inputs: list[InferInput]


class InferOutput(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    data: list[float]


class InferResponse(BaseModel):
    model_name: str
    model_version: str
    outputs: list[InferOutput]


app = FastAPI()


def embed(request: InferRequest) -> InferResponse:
    if len(request.inputs) != 1 or request.inputs[0].name != "text":
        raise HTTPException(400, "expected one input named 'text'")
    texts = request.inputs[0].data
    if not texts:
        raise HTTPException(400, "no texts")
    vectors = runtime.run_batch([runtime.preprocess(texts)])[0]
    return InferResponse(model_name="minilm", model_version="1", outputs=[InferOutput(
        name="embedding", datatype="FP32", shape=list(vectors.shape),
        data=vectors.ravel().tolist())])


if MODE == "sync":
    @app.post("/v2/models/minilm/infer")
    def infer_sync(request: InferRequest) -> InferResponse:
        return embed(request)
else:
    @app.post("/v2/models/minilm/infer")
    async def infer_async(request: InferRequest) -> InferResponse:
        return embed(request)


@app.get("/v2/health/ready")
def ready() -> dict[str, bool]:
    return {"ready": True}
