"""The ASGI application: routes, the shared inference path, and the error mapping.

A request's way through: body read (bounded) -> codec decode -> runtime ``preprocess``
(tokenise) -> model queue -> batcher -> ``run_batch`` in a worker thread -> codec encode ->
response with ``Server-Timing``. The Timeline starts when the request enters the application.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from sokuji import __version__
from sokuji.config import ServerConfig
from sokuji.core.request import InferenceRequest, Stage, Timeline
from sokuji.errors import (
    BadRequest,
    PayloadTooLarge,
    SokujiError,
    UnsupportedMediaType,
)
from sokuji.models.repository import Model, ModelRepository
from sokuji.observability.metrics import CONTENT_TYPE, Metrics
from sokuji.server import openai_api, v2

log = logging.getLogger(__name__)
JSON = "application/json"


class _StampArrival:
    """Outermost ASGI layer: records when the request entered, before routing."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["t0_ns"] = time.perf_counter_ns()
        await self.app(scope, receive, send)


def _timeline(request: Request) -> Timeline:
    return Timeline(request.scope.get("state", {}).get("t0_ns"))


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing more than ``limit`` bytes before reading them where possible."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise BadRequest(f"Content-Length {declared!r} is not an integer") from None
        if size > limit:
            raise PayloadTooLarge(f"request body of {size} bytes exceeds the limit of "
                                  f"{limit} bytes")
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding != "identity":
        raise UnsupportedMediaType(f"Content-Encoding {encoding!r} is not supported; "
                                   "send the body uncompressed")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _check_content_type(request: Request, binary_ok: bool) -> None:
    ctype = request.headers.get("content-type")
    if ctype is None:
        return
    base = ctype.split(";", 1)[0].strip().lower()
    if base == JSON or (binary_ok and base == "application/octet-stream"):
        return
    accepted = "application/json" + (
        " or application/octet-stream (with Inference-Header-Content-Length)"
        if binary_ok else "")
    raise UnsupportedMediaType(f"Content-Type {ctype!r} is not supported; send {accepted}")


class Handlers:
    def __init__(self, config: ServerConfig, repo: ModelRepository, metrics: Metrics) -> None:
        self.config = config
        self.repo = repo
        self.metrics = metrics

    async def _infer(self, model: Model, texts: list[str], tl: Timeline,
                     request_id: str = "") -> tuple[np.ndarray, int]:
        """Run texts through the model's queue; returns (outputs, unpadded token count)."""
        prepared = model.runtime.preprocess(texts)
        tl.mark(Stage.PREPROCESS)
        output = await model.batcher.submit(InferenceRequest(
            model=model.name, payload=prepared, num_items=prepared.num_items,
            length=prepared.length, timeline=tl, request_id=request_id))
        tl.mark(Stage.POSTPROCESS)
        return output, prepared.num_tokens

    def _respond(self, model: str, tl: Timeline, body: bytes,
                 headers: dict[str, str]) -> Response:
        tl.mark(Stage.ENCODE)
        headers["server-timing"] = tl.server_timing()
        self.metrics.observe_request(model, tl, 200)
        return Response(body, headers=headers)

    # --- KServe V2 ---------------------------------------------------------------------
    async def v2_infer(self, request: Request) -> Response:
        tl = _timeline(request)
        params = request.path_params
        model = self.repo.get_ready(params["model_name"], params.get("version"))
        header_len = request.headers.get(v2.HEADER_LENGTH)
        _check_content_type(request, binary_ok=header_len is not None)
        body = await read_body(request, self.config.max_request_bytes)
        try:
            length = int(header_len) if header_len is not None else None
        except ValueError:
            raise BadRequest(f"Inference-Header-Content-Length {header_len!r} is not an "
                             "integer") from None
        req = v2.decode_infer(body, length, model.metadata, model.config.max_batch_size)
        tl.mark(Stage.DECODE)
        output, _ = await self._infer(model, req.texts, tl, req.request_id)
        payload, headers = v2.encode_infer(model.name, model.version, req,
                                           [(model.metadata.outputs[0], output)])
        return self._respond(model.name, tl, payload, headers)

    async def v2_server_metadata(self, request: Request) -> Response:
        return _json({"name": "sokuji", "version": __version__,
                      "extensions": ["binary_tensor_data"]})

    async def v2_live(self, request: Request) -> Response:
        return Response(status_code=200)

    async def v2_ready(self, request: Request) -> Response:
        return Response(status_code=200 if self.repo.ready else 503)

    async def v2_model_metadata(self, request: Request) -> Response:
        p = request.path_params
        model = self.repo.get(p["model_name"], p.get("version"))
        return _json(v2.model_metadata(model.name, model.version, model.metadata))

    async def v2_model_ready(self, request: Request) -> Response:
        p = request.path_params
        model = self.repo.get(p["model_name"], p.get("version"))
        return Response(status_code=200 if model.ready else 503)

    # --- OpenAI-compatible ---------------------------------------------------------------
    async def openai_embeddings(self, request: Request) -> Response:
        tl = _timeline(request)
        _check_content_type(request, binary_ok=False)
        body = await read_body(request, self.config.max_request_bytes)
        req = openai_api.decode_embeddings(body)
        model = self.repo.get_ready(req.model)
        request.state.model = model.name
        dim = model.metadata.outputs[0].shape[-1]
        openai_api.check_limits(req, model.config.max_batch_size, dim)
        tl.mark(Stage.DECODE)
        output, num_tokens = await self._infer(model, req.texts, tl)
        payload = openai_api.encode_embeddings(req, output, num_tokens)
        return self._respond(model.name, tl, payload, {"content-type": JSON})

    async def openai_models(self, request: Request) -> Response:
        return _json({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "sokuji"}
            for name in self.repo.models]})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), headers={"content-type": CONTENT_TYPE})

    # --- errors --------------------------------------------------------------------------
    def error_response(self, request: Request, status: int, code: str, message: str,
                       param: str | None = None) -> Response:
        model = request.path_params.get("model_name") or getattr(request.state, "model", "")
        if model in self.repo.models:
            self.metrics.requests.labels(model, str(status)).inc()
        if request.url.path.startswith("/v1/"):
            body = openai_api.error_body(status, code, message, param)
        else:
            body = orjson.dumps({"error": message, "code": code})
        return Response(body, status_code=status, headers={"content-type": JSON})

    async def on_sokuji_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, SokujiError)
        if exc.status >= 500:
            log.error("%s %s: %s", request.method, request.url.path, exc.message)
        return self.error_response(request, exc.status, exc.code, exc.message, exc.param)

    async def on_http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return self.error_response(request, exc.status_code, code, message)

    async def on_unexpected(self, request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return self.error_response(request, 500, "internal_error",
                                   f"internal error: {type(exc).__name__}")


def _json(doc: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status_code=status, headers={"content-type": JSON})


def create_app(config: ServerConfig, repo: ModelRepository,
               metrics: Metrics | None = None) -> ASGIApp:
    """The ASGI app over an already-loaded repository; batchers start with the lifespan."""
    metrics = metrics or Metrics()
    for name, model in repo.models.items():
        metrics.add_model(name, model.batcher)
    h = Handlers(config, repo, metrics)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        repo.start()
        try:
            yield
        finally:
            await repo.stop()

    routes = [
        Route("/v2", h.v2_server_metadata, methods=["GET"]),
        Route("/v2/health/live", h.v2_live, methods=["GET"]),
        Route("/v2/health/ready", h.v2_ready, methods=["GET"]),
        Route("/v2/models/{model_name}", h.v2_model_metadata, methods=["GET"]),
        Route("/v2/models/{model_name}/ready", h.v2_model_ready, methods=["GET"]),
        Route("/v2/models/{model_name}/infer", h.v2_infer, methods=["POST"]),
        Route("/v2/models/{model_name}/versions/{version}", h.v2_model_metadata,
              methods=["GET"]),
        Route("/v2/models/{model_name}/versions/{version}/ready", h.v2_model_ready,
              methods=["GET"]),
        Route("/v2/models/{model_name}/versions/{version}/infer", h.v2_infer,
              methods=["POST"]),
        Route("/v1/embeddings", h.openai_embeddings, methods=["POST"]),
        Route("/v1/models", h.openai_models, methods=["GET"]),
        Route("/metrics", h.metrics_endpoint, methods=["GET"]),
    ]
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        SokujiError: h.on_sokuji_error,
        HTTPException: h.on_http_error,
        Exception: h.on_unexpected,
    }
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers=handlers)
    app.state.metrics = metrics
    app.state.repo = repo
    return _StampArrival(app)
