"""The peers of ``tensor_serving.py``, over one model code (``PeerModel``): the same ONNX file,
the same session options as Sokuji's tensor runtime (1 intra-op thread, spinning off, every
graph optimisation), the input's raw bytes in, the outputs' raw bytes out.

- ``fastapi``: plain FastAPI under uvicorn (uvloop, httptools), a ``def`` endpoint (FastAPI's
  threadpool, what its documentation recommends for blocking code), one request -> one
  session call, no batching: ``uvicorn --factory _tensor_peers:fastapi_app``.
- ``litserve``: ``litserve.LitAPI`` with ``max_batch_size`` / ``batch_timeout`` on the same
  code, ``batch`` concatenating the rows and ``unbatch`` splitting them back
  (``_tensor_litserve.py``).
- ``floor``: the HTTP floor, no model: a raw ASGI app under the same uvicorn that reads the
  body and answers ``TENSOR_FLOOR_BYTES`` prebuilt bytes (``--factory _tensor_peers:floor``).

Configured by environment: ``TENSOR_PEER_MODEL`` (tabular, ocr), ``TENSOR_PEER_CACHE_DIR``.
(No ``from __future__ import annotations`` here: LitServe and FastAPI read the endpoint's
annotations at run time.)
"""

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tensor_models import spec

RAW = "application/octet-stream"


class PeerModel:
    """One ONNX session: raw input bytes -> array -> outputs -> raw bytes."""

    def __init__(self) -> None:
        from sokuji.runtimes.tensor import Options, TensorRuntime

        self.spec = spec(os.environ["TENSOR_PEER_MODEL"], os.environ["TENSOR_PEER_CACHE_DIR"])
        rt = TensorRuntime(self.spec.path, Options(intra_op_threads=1))
        rt.load()
        self.session = rt._session
        self.row_bytes = 4 * int(np.prod(self.spec.row_shape))

    def decode(self, body: bytes) -> np.ndarray:
        if not body or len(body) % self.row_bytes:
            raise ValueError(f"the body must be rows of {self.row_bytes} bytes")
        return np.frombuffer(body, dtype=np.float32).reshape(-1, *self.spec.row_shape)

    def predict(self, x: np.ndarray) -> list[np.ndarray]:
        return list(self.session.run(list(self.spec.outputs), {self.spec.input_name: x}))

    @staticmethod
    def encode(outputs: list[np.ndarray]) -> bytes:
        return b"".join(np.ascontiguousarray(o).tobytes() for o in outputs)


def fastapi_app() -> Any:
    from fastapi import Body, FastAPI, HTTPException, Response

    model = PeerModel()
    model.predict(model.decode(bytes(model.row_bytes)))  # warm
    app = FastAPI()

    @app.post("/infer")
    def infer(body: Annotated[bytes, Body(media_type=RAW)]) -> Response:
        try:
            x = model.decode(body)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        return Response(model.encode(model.predict(x)), media_type=RAW)

    @app.get("/health")
    def health() -> dict[str, bool]:
        return {"ok": True}

    return app


def floor() -> Any:
    size = int(os.environ.get("TENSOR_FLOOR_BYTES", "16"))
    body = bytes(size)
    start = {"type": "http.response.start", "status": 200,
             "headers": [(b"content-type", RAW.encode()),
                         (b"content-length", str(size).encode())]}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                while (await receive())["type"] != "lifespan.shutdown":
                    await send({"type": "lifespan.startup.complete"})
                await send({"type": "lifespan.shutdown.complete"})
            return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        await send(start)
        await send({"type": "http.response.body", "body": body})

    return app
