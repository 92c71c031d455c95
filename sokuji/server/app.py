"""The ASGI application: a direct path for inference, Starlette for the control plane.

Inference (``POST /v2/models/{name}[/versions/{v}]/infer`` and ``POST /v1/embeddings``) is
served by a plain ASGI handler: body read (bounded) -> codec decode -> runtime ``preprocess``
(tokenise) -> model queue -> batcher -> ``run_batch`` in a worker thread -> codec encode ->
response with ``Server-Timing``. Starlette's middleware and router cost ~50-80 us a request on
this path, as much as everything else Sokuji does, so only the control plane (health,
metadata, metrics, 404/405) goes through Starlette. The Timeline starts when the request enters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

from sokuji.config import ServerConfig
from sokuji.core import offload
from sokuji.core.cache import CacheResult, Entry, ResponseCache, cache_key
from sokuji.core.request import InferenceRequest, Stage, Timeline
from sokuji.errors import (
    BadRequest,
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    MethodNotAllowed,
    ModelNotFound,
    ModelNotReady,
    SokujiError,
)
from sokuji.models.repository import Model, ModelRepository
from sokuji.observability.metrics import Metrics
from sokuji.server import backends, llm_api, openai_api, scheduling, v2
from sokuji.server.auth import Authenticator, Tenant
from sokuji.server.control import ControlPlane
from sokuji.server.http import (
    JSON,
    ClientGone,
    Headers,
    Reply,
    check_content_type,
    error_reply,
    read_body,
)
from sokuji.server.jobs import JOBS_PREFIX, JobService

log = logging.getLogger(__name__)
VARIANT_HEADER = "x-sokuji-variant"
INLINE_MAX_CHARS = 4096
"""Requests whose texts total up to this many characters are tokenised on the event loop
(MiniLM: ~0.3 ms for 1 KiB, ~1.1 ms for 4 KiB; the hop to a worker thread costs ~40 us);
longer ones in the ``sokuji-prep`` pool (``core/offload.py``), so a long text never holds
up other requests. Each text's own cost is bounded by the runtime, which reads a text only
as far as its model does (``runtimes/onnx.py``)."""


class Inference:
    """The inference endpoints, as plain functions of (path parameters, headers, body)."""

    def __init__(self, config: ServerConfig, repo: ModelRepository, metrics: Metrics,
                 cache: ResponseCache | None = None) -> None:
        self.config = config
        self.repo = repo
        self.metrics = metrics
        self.cache = cache
        self.auth = Authenticator(config.api_keys)

    async def _run(self, model: Model, texts: list[str], tl: Timeline, headers: Headers,
                   parameters: dict[str, Any], tenant: Tenant,
                   request_id: str = "") -> tuple[np.ndarray, int]:
        """Outputs for ``texts`` (from the cache, or through the model's queue), and the
        unpadded token count."""
        prio = scheduling.priority(headers, parameters, tenant.priority, tenant.max_priority)
        deadline = scheduling.deadline_ns(headers, parameters, tl.start_ns,
                                          model.config.default_timeout_ms)

        async def compute() -> Entry:
            if self.cache is not None and model.config.cache:
                tl.mark(Stage.CACHE)
            if model.variant:
                tl.notes[Stage.INFER] = model.variant
            if sum(map(len, texts)) > INLINE_MAX_CHARS:
                prepared = await offload.run(model.runtime.preprocess, texts)
            else:
                prepared = model.runtime.preprocess(texts)
            tl.mark(Stage.PREPROCESS)
            output = await model.embedder().submit(InferenceRequest(
                model=model.name, payload=prepared, num_items=prepared.num_items,
                length=prepared.length, timeline=tl, request_id=request_id, priority=prio,
                deadline_ns=deadline))
            tl.mark(Stage.POSTPROCESS)
            return Entry(output, prepared.num_tokens)

        if self.cache is None or not model.config.cache:
            entry = await compute()
            return entry.output, entry.num_tokens
        control = headers.get("cache-control", "").lower()
        key = cache_key(tenant.name, model.name, f"{model.version}:{model.variant}", texts)
        entry, result = await self.cache.get_or_compute(
            model.name, key, compute, read="no-cache" not in control,
            store="no-store" not in control)
        tl.notes[Stage.CACHE] = result.value
        if result in (CacheResult.HIT, CacheResult.COALESCED):
            tl.mark(Stage.CACHE)
        return entry.output, entry.num_tokens

    async def v2_infer(self, params: dict[str, str], headers: Headers, receive: Receive,
                       tl: Timeline, tenant: Tenant) -> tuple[str, bytes, Headers]:
        tenant.check_model(params["model_name"])  # first: 403 tells nothing of other models
        model = self.repo.get_ready(params["model_name"], params.get("version"))
        model.embedder().check_capacity()  # refuse before reading the body
        header_len = headers.get(v2.HEADER_LENGTH)
        check_content_type(headers, binary_ok=header_len is not None)
        body = await read_body(receive, headers, self.config.max_request_bytes)
        try:
            length = int(header_len) if header_len is not None else None
        except ValueError:
            raise BadRequest(f"Inference-Header-Content-Length {header_len!r} is not an "
                             "integer") from None
        req = v2.decode_infer(body, length, model.metadata, model.config.max_batch_size)
        tl.mark(Stage.DECODE)
        output, _ = await self._run(model, req.texts, tl, headers, req.parameters, tenant,
                                    req.request_id)
        payload, out_headers = v2.encode_infer(model.name, model.served_version, req,
                                               [(model.metadata.outputs[0], output)])
        if model.variant:
            out_headers[VARIANT_HEADER] = model.variant
        return model.metric_name, payload, out_headers

    async def openai_embeddings(self, params: dict[str, str], headers: Headers,
                                receive: Receive, tl: Timeline, tenant: Tenant
                                ) -> tuple[str, bytes, Headers]:
        check_content_type(headers, binary_ok=False)
        body = await read_body(receive, headers, self.config.max_request_bytes)
        req = openai_api.decode_embeddings(body)
        params["model_name"] = req.model
        tenant.check_model(req.model)
        model = self.repo.get_ready(req.model)
        openai_api.check_limits(req, model.config.max_batch_size,
                                model.metadata.outputs[0].shape[-1])
        tl.mark(Stage.DECODE)
        output, num_tokens = await self._run(model, req.texts, tl, headers, {}, tenant)
        out_headers = {"content-type": JSON}
        if model.variant:
            out_headers[VARIANT_HEADER] = model.variant
        return model.metric_name, openai_api.encode_embeddings(req, output, num_tokens), \
            out_headers


Endpoint = Callable[[dict[str, str], Headers, Receive, Timeline, Tenant],
                    Awaitable[tuple[str, bytes, Headers]]]


class SokujiApp:
    """Outermost ASGI app: inference (and jobs) directly, everything else to Starlette."""

    def __init__(self, inference: Inference, control_plane: ASGIApp,
                 jobs: JobService | None = None) -> None:
        self.inference = inference
        self.generation = llm_api.Generation(inference.config, inference.repo,
                                             inference.metrics, inference.auth)
        self.control_plane = control_plane
        self.metrics = inference.metrics
        self.jobs = jobs

    def route(self, path: str) -> tuple[Endpoint, dict[str, str]] | None:
        if path == "/v1/embeddings":
            return self.inference.openai_embeddings, {}
        if path.startswith("/v2/models/") and path.endswith("/infer"):
            parts = path.split("/")  # '', 'v2', 'models', name, ['versions', v,] 'infer'
            if len(parts) == 5 and parts[3]:
                return self.inference.v2_infer, {"model_name": parts[3]}
            if len(parts) == 7 and parts[3] and parts[4] == "versions" and parts[5]:
                return self.inference.v2_infer, {"model_name": parts[3], "version": parts[5]}
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.control_plane(scope, receive, send)
            return
        t0 = time.perf_counter_ns()
        path, method = scope["path"], scope["method"]
        if path in llm_api.PATHS:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            await self.generation(path, method, headers, receive, send, t0)
            return
        is_job = self.jobs is not None and path.startswith(JOBS_PREFIX)
        route = None if is_job else self.route(path)
        if not is_job and route is None:
            await self.control_plane(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        if is_job:
            assert self.jobs is not None
            reply: Reply | None = await self.guard(method, path, {}, self.jobs.status(
                method, path, headers))
        elif self.jobs is not None and "respond-async" in headers.get("prefer", ""):
            reply = await self.guard(method, path, {},
                                     self.jobs.submit(method, path, headers, receive))
        else:
            reply = await self.respond(method, path, headers, receive, t0, route=route)
        if reply is not None:
            await reply.send(send)

    def check_job(self, path: str, body: bytes, tenant: Tenant) -> None:
        """What is known before a job is accepted: its model exists and the tenant may use it.
        (A job that fails later records its 4xx as its result.)"""
        route = self.route(path)
        assert route is not None
        params = route[1]
        name, version = params.get("model_name"), params.get("version")
        if name is None:  # OpenAI: the model is named in the body
            doc = v2.parse_json(body)
            name = doc.get("model") if isinstance(doc, dict) else None
            if not isinstance(name, str):
                raise InvalidInput("'model' is required and must be a string", param="model")
        tenant.check_model(name)
        self.inference.repo.get(name, version)

    async def guard(self, method: str, path: str, params: dict[str, str],
                    work: Awaitable[Reply | None], t0: int | None = None) -> Reply | None:
        """Await ``work``; map the error tree to replies (headers included: ``Allow`` on a
        405, ``Retry-After`` on a 429 ...), and anything else to a logged 500. An error for a
        known model counts as a failure in its statistics (arrival ``t0`` to now)."""
        try:
            return await work
        except ClientGone:
            return None
        except SokujiError as exc:
            if exc.status >= 500 and not isinstance(exc, (DeadlineExceeded, ModelNotReady)):
                log.error("%s %s: %s", method, path, exc.message)  # load shedding is not
            model = params.get("model_name", "")
            if model in self.inference.repo.models:
                self.metrics.requests.labels(model, str(exc.status)).inc()
                self._count_failure(params, t0)
            return error_reply(path, exc.status, exc.code, exc.message, exc.param, exc.headers)
        except Exception as exc:  # the one outermost catch-all: a 500 is a bug, logged
            log.exception("unhandled error on %s %s", method, path)
            if params.get("model_name", "") in self.inference.repo.models:
                self._count_failure(params, t0)
            return error_reply(path, 500, "internal_error",
                               f"internal error: {type(exc).__name__}")

    def _count_failure(self, params: dict[str, str], t0: int | None) -> None:
        try:
            model = self.inference.repo.get(params["model_name"], params.get("version"))
        except ModelNotFound:  # an unknown version: no statistics to count it in
            return
        elapsed_ns = time.perf_counter_ns() - t0 if t0 is not None else 0
        self.metrics.observe_failure(model.metric_name, elapsed_ns)

    async def respond(self, method: str, path: str, headers: Headers, receive: Receive,
                      t0: int, tenant: Tenant | None = None,
                      route: tuple[Endpoint, dict[str, str]] | None = None) -> Reply | None:
        """The inference path as a function: the reply, or None if the client went away.
        ``tenant`` is given for work already authorised (jobs); else the headers decide."""
        route = route or self.route(path)
        assert route is not None
        endpoint, params = route
        tl = Timeline(t0)

        async def run() -> Reply:
            if method != "POST":
                raise MethodNotAllowed(f"{method} is not allowed on {path}; use POST")
            who = tenant or self.inference.auth.authenticate(headers)
            model, body, out_headers = await endpoint(params, headers, receive, tl, who)
            tl.mark(Stage.ENCODE)
            out_headers["server-timing"] = tl.server_timing()
            # Published after the response is written, off the request's own latency.
            asyncio.get_running_loop().call_soon(self.metrics.observe_request, model, tl, 200)
            return Reply(200, body, out_headers)

        return await self.guard(method, path, params, run(), t0)


def create_app(config: ServerConfig, repo: ModelRepository,
               metrics: Metrics | None = None) -> SokujiApp:
    """The ASGI app over an already-loaded repository; batchers start with the lifespan."""
    metrics = metrics or Metrics()
    for model in repo.every():
        metrics.add_model(model.metric_name, model.scheduler)
        if model.variant and model.primary:
            metrics.variant.labels(model.name, model.variant).set(1)
    for name, model in repo.models.items():
        if model.engine is not None:
            metrics.llm.add_engine(name, model.engine)
    cache = backends.build_cache(config, metrics)
    inference = Inference(config, repo, metrics, cache)
    cp = ControlPlane(config, repo, metrics, inference.auth)
    jobs = None
    if config.jobs.enabled:
        jobs = JobService(backends.job_store(config), inference.auth, config)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if cache is not None and hasattr(cache.backend, "ping"):
            from sokuji.core.cache import BackendUnavailable

            # Unreachable at start is a config error (refuse to start); later, an outage
            # only turns lookups into misses. The URL's password never reaches the message.
            try:
                await cache.backend.ping()
            except BackendUnavailable as exc:
                raise ConfigError.for_key("cache.redis_url",
                                          backends.redact_url(config.cache.redis_url),
                                          f"cannot reach Redis: {exc}") from None
        repo.start()
        if jobs is not None:
            jobs.start(app_.respond, app_.check_job)
        try:
            yield
        finally:
            if jobs is not None:
                await jobs.stop()
            await repo.stop()
            if cache is not None:
                await cache.close()

    control_plane = Starlette(routes=cp.routes(), lifespan=lifespan,
                              exception_handlers=cp.handlers())
    app_ = SokujiApp(inference, control_plane, jobs)
    return app_
