"""The ASGI application: a direct path for inference, Starlette for the control plane.

Inference (``POST /v2/models/{name}[/versions/{v}]/infer`` and ``POST /v1/embeddings``) is
served by a plain ASGI handler (``inference.py``), the same way for every model that serves
the route: body read (bounded) -> codec decode -> the model's ``prepare`` (tokenise) ->
``submit`` (admission, queue, batcher) -> ``run_batch`` in a worker thread -> codec encode
-> response with ``Server-Timing`` and what the handle's report adds. Generations
(``/v1/chat/completions``, ``/v1/completions``) go to ``llm_api``; a body streamed in to a
model serving ``Api.STREAM`` to ``stream.py``. A request's end is counted in
``accounting.py``. Every such request is authenticated once, here, before its method is
checked (nothing is counted for a model before the caller is known); the tenant then travels
in the request's ``RequestContext``. Starlette's middleware and router cost ~50-80 us a
request on this path, as much as everything else Sokuji does, so only the control plane
(health, metadata, metrics, 404/405) goes through Starlette. The Timeline starts when the
request enters.
Before anything else, a request's ``Host`` must be a name the server answers to (``hosts.py``:
the DNS-rebinding defence; 421 otherwise): one dictionary lookup on this path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

from sokuji.config import ServerConfig
from sokuji.core import timing
from sokuji.core.model import Api, ServedModel
from sokuji.core.request import Stage, Timeline
from sokuji.errors import (
    ConfigError,
    InvalidInput,
    MethodNotAllowed,
    SokujiError,
)
from sokuji.observability import tracing
from sokuji.observability.metrics import Metrics
from sokuji.observability.observers import Observers
from sokuji.repository.control import ModelControl
from sokuji.repository.models import Model, ModelRepository
from sokuji.repository.sources import source_for
from sokuji.server import backends, generate_api, llm_api, predict, scheduling, stream, v2
from sokuji.server.accounting import Accounting
from sokuji.server.auth import Tenant
from sokuji.server.control import ControlPlane
from sokuji.server.failures import ErrorStyle, error_reply, to_error
from sokuji.server.hosts import AllowedHosts, refusal
from sokuji.server.http import (
    ClientGone,
    Headers,
    Reply,
)
from sokuji.server.inference import Answer, Inference
from sokuji.server.jobs import JOBS_PREFIX, JobService

log = logging.getLogger(__name__)
Endpoint = Callable[[dict[str, str], Headers, Receive, Timeline, Tenant], Awaitable[Answer]]
SERVED_BY = "x-sokuji-served-by"


Route = tuple[Endpoint, dict[str, str], ErrorStyle]
"""An inference route: its endpoint, its path parameters, and the error format of the
protocol it speaks. (A plain tuple: built on every request.)"""


class SokujiApp:
    """Outermost ASGI app: inference, generation and jobs directly, everything else to
    Starlette."""

    def __init__(self, inference: Inference, control_plane: ASGIApp,
                 jobs: JobService | None = None, tracer: tracing.Tracer | None = None) -> None:
        self.inference = inference
        self.auth = inference.auth
        self.tracer = tracer
        """Traces (``observability/tracing.py``); None when off: every hook is one test."""
        self.accounting = Accounting(inference.repo, inference.metrics, tracer)
        """Where every request's end is counted (``accounting.py``)."""
        self.generation = llm_api.Generation(inference.config, inference.repo,
                                             self.accounting)
        self.control_plane = control_plane
        self.control: ControlPlane | None = None
        """The control plane's handlers (set by ``create_app``)."""
        self.metrics = inference.metrics
        self.jobs = jobs
        self.hosts = AllowedHosts.of(inference.config)
        """The ``Host`` names answered (``hosts.py``); None: any."""
        self.streams = stream.Streams(inference.config.streams, bool(inference.config.api_keys))
        """Streams in flight and their admission (``stream.py``)."""
        self.generate = generate_api.GenerateApi(self.generation)
        """Triton's generate extension (``/v2/models/{m}/generate[_stream]``)."""
        self.predict = predict.Predict(inference, self.accounting)
        """``Api.PREDICT``: plain JSON, or Server-Sent Events from a streaming model
        (``predict.py``)."""
        self._answer_predict = self.predict.answer  # (one bound method: ``route`` returns it)

    def route(self, path: str) -> Route | None:
        if path == "/v1/embeddings":
            return self.inference.openai_embeddings, {}, ErrorStyle.OPENAI
        if path.startswith("/v2/models/") and path.endswith("/infer"):
            parts = path.split("/")  # '', 'v2', 'models', name, ['versions', v,] 'infer'
            if len(parts) == 5 and parts[3]:
                return self.inference.v2_infer, {"model_name": parts[3]}, ErrorStyle.V2
            if len(parts) == 7 and parts[3] and parts[4] == "versions" and parts[5]:
                return (self.inference.v2_infer,
                        {"model_name": parts[3], "version": parts[5]}, ErrorStyle.V2)
        elif path.endswith("/predict") and (path.startswith("/v2/models/")
                                            or path == predict.ALIAS):
            params = predict.route(path)
            if params is not None:
                return self._answer_predict, params, ErrorStyle.V2
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.control_plane(scope, receive, send)
            return
        t0 = time.perf_counter_ns()
        path, method = scope["path"], scope["method"]
        generation = path in llm_api.PATHS
        triton_generate = not generation and path.endswith(generate_api.SUFFIXES) \
            and generate_api.route(path) is not None
        generation = generation or triton_generate
        is_job = not generation and self.jobs is not None and path.startswith(JOBS_PREFIX)
        route = None if generation or is_job else self.route(path)
        hosts = self.hosts
        if not (generation or is_job or route is not None):
            if hosts is not None and not hosts.allows_raw(scope["headers"]):
                await refusal(path).send(send)
                return
            await self.control_plane(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        if hosts is not None and not hosts.allows(headers.get("host")):
            await refusal(path).send(send)
            return
        allowed = "GET" if is_job else "POST"
        style = ErrorStyle.V2 if triton_generate else ErrorStyle.OPENAI if generation \
            else route[2] if route else ErrorStyle.V2
        # Who is asking, then the method: once per request, before any work. A refusal of
        # the key counts for no model (accounting.py): anyone may send one.
        try:
            tenant = self.auth.authenticate(headers)
        except SokujiError as exc:
            self.accounting.unauthorised(exc)
            await error_reply(to_error(exc, method, path), style).send(send)
            return
        if method != allowed:
            error = MethodNotAllowed(f"{method} is not allowed on {path}; use {allowed}",
                                     allow=(allowed,))
            if route is not None and tenant.may_use(route[1].get("model_name", "")):
                self._failed(route[1], error, t0, tenant)  # (not a model it may not use)
            await error_reply(error, style).send(send)
            return
        if triton_generate:
            await self.generate(path, headers, receive, send, t0, tenant,
                                None if self.tracer is None else self._sample(headers))
            return
        if generation:
            await self.generation(path, headers, receive, send, t0, tenant,
                                  None if self.tracer is None else self._sample(headers))
            return
        if is_job:
            assert self.jobs is not None
            reply: Reply | None = await self.guard(
                method, path, {}, self.jobs.status(path, tenant), style, tenant)
        elif self.jobs is not None and "respond-async" in headers.get("prefer", ""):
            reply = await self.guard(method, path, {}, self.jobs.submit(
                path, headers, receive, tenant), style, tenant)
        elif route is not None and self._streams(route[1], headers):
            reply = await self.guard(method, path, route[1], self.stream(
                route[1], headers, scope.get("query_string", b""), receive, send, t0,
                tenant), style, tenant, t0)
        elif route is not None and route[0] is self._answer_predict \
                and self.predict.streaming(route[1], tenant):
            await self.predict.stream(path, route[1], headers, receive, send, t0, tenant,
                                      None if self.tracer is None else self._sample(headers))
            return
        else:
            reply = await self.respond(method, path, headers, receive, t0, tenant, route,
                                       None if self.tracer is None else self._sample(headers))
        if reply is not None:
            await reply.send(send)

    def _streams(self, params: dict[str, str], headers: Headers) -> bool:
        """A V2 infer request whose body streams in (NDJSON out), to a model serving it."""
        if "model_name" not in params or not stream.wants_stream(headers):
            return False
        model = self.inference.repo.models.get(params["model_name"])
        return model is not None and Api.STREAM in model.apis

    async def stream(self, params: dict[str, str], headers: Headers, query: bytes,
                     receive: Receive, send: Send, t0: int, tenant: Tenant) -> None:
        """A body streamed in, records streamed out (``stream.py``): admitted by the
        tenant's cap, its priority and its deadline, then bounded by the stream timeouts."""
        tenant.check_model(params["model_name"])
        model = self.inference.repo.get_ready(params["model_name"], params.get("version"))
        ctx = scheduling.context(tenant, headers, {}, t0, model.config.default_timeout_ms)
        with self.streams.admit(model.name, model.served, model.config.max_concurrency, ctx):
            await stream.relay(model.served, self.inference.limit(model), headers, query, ctx,
                               receive, send, self.streams.config)
        self.accounting.streamed(model, t0)

    def _sample(self, headers: Headers) -> tracing.Trace | None:
        """Tracing's decision, once, as the request enters; a traced request's ``Trace``
        reaches its ``RequestContext`` through ``tracing.current`` (this request's task)."""
        assert self.tracer is not None
        trace = self.tracer.sample(headers.get(tracing.TRACEPARENT))
        if trace is not None:
            tracing.current.set(trace)
        return trace

    def body_limit(self, path: str) -> int:
        """The request body limit of ``path``: its model's own, else the server's."""
        route = self.route(path)
        model = self.inference.repo.models.get(route[1].get("model_name", "")) \
            if route is not None else None
        return self.inference.limit(model) if model is not None \
            else self.inference.config.max_request_bytes

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
                    work: Awaitable[Reply | None], style: ErrorStyle, tenant: Tenant,
                    t0: int | None = None) -> Reply | None:
        """Await ``work`` for ``tenant`` (authenticated); map any error to a reply in the
        route's format (``failures.py``). An error for a known model counts as a failure in
        its statistics (arrival ``t0`` to now) and in ``tenant``'s SLOs; a 403 (the tenant
        may not use it) counts for no model (``accounting.py``)."""
        try:
            return await work
        except ClientGone:
            return None
        except Exception as exc:  # noqa: BLE001 - every error, SokujiError or a bug: one mapper
            error = to_error(exc, method, path)
            self._failed(params, error, t0, tenant)
            return error_reply(error, style)

    def _failed(self, params: dict[str, str], error: SokujiError, t0: int | None,
                tenant: Tenant) -> None:
        self.accounting.failed(params.get("model_name", ""), params.get("version"), error, t0,
                               tenant.name)

    async def respond(self, method: str, path: str, headers: Headers, receive: Receive,
                      t0: int, tenant: Tenant | SokujiError,
                      route: Route | None = None, trace: tracing.Trace | None = None
                      ) -> Reply | None:
        """The inference path as a function, for a request already authenticated (the
        tenant: from the headers, or the job's key; or the refusal of a job whose key lost
        its rights, answered like any error of the route): the reply, or None if the client
        went away. ``trace``: the request is traced (its spans are made after the reply)."""
        route = route or self.route(path)
        assert route is not None
        endpoint, params, style = route
        tl = Timeline(t0)
        try:  # as ``guard`` does, without another coroutine on the hot path
            if method != "POST":
                raise MethodNotAllowed(f"{method} is not allowed on {path}; use POST")
            if isinstance(tenant, SokujiError):
                raise tenant
            model, body, out_headers, report = await endpoint(params, headers, receive, tl,
                                                              tenant)
        except ClientGone:
            return None
        except Exception as exc:  # noqa: BLE001 - every error, SokujiError or a bug: one mapper
            error = to_error(exc, method, path)
            self.accounting.failed(params.get("model_name", ""), params.get("version"), error,
                                   t0, tenant.name if isinstance(tenant, Tenant) else None,
                                   trace, _operation(style), tl, path, exc)
            return error_reply(error, style)
        tl.mark(Stage.ENCODE)
        out_headers["server-timing"] = tl.server_timing() if not report.timing \
            else f"{tl.server_timing()}, {timing.render(report.timing)}"
        if report.served_by:
            out_headers[SERVED_BY] = report.served_by
        if report.headers:
            out_headers.update(report.headers)
        assert isinstance(tenant, Tenant)
        self.accounting.answered(model, tenant.name, tl, _operation(style),
                                 params["model_name"], path, trace)
        return Reply(200, body, out_headers)


def _waiting(served: ServedModel) -> Callable[[], float]:
    return lambda: float(served.num_waiting)


def _operation(style: ErrorStyle) -> str:
    """The GenAI operation name of an inference route (``observability/genai.py``)."""
    return "embeddings" if style is ErrorStyle.OPENAI else "infer"


async def _start_grpc(app: SokujiApp, cp: ControlPlane, config: ServerConfig) -> Any:
    """The gRPC server started (``grpc_v2.py``), or None without the ``grpc`` extra."""
    try:
        from sokuji.server import grpc_v2
    except ImportError as exc:
        log.warning("gRPC is off (grpc_port %d): %s; install sokuji[grpc]", config.grpc_port,
                    exc)
        return None
    return await grpc_v2.start(app, cp, config)


def create_app(config: ServerConfig, repo: ModelRepository,
               metrics: Metrics | None = None, grpc: bool = False) -> SokujiApp:
    """The ASGI app over an already-loaded repository; batchers start with the lifespan.
    ``grpc``: the lifespan also serves KServe V2 over gRPC on ``config.grpc_port`` (unless
    0) in the same event loop (``grpc_v2.py``; ``sokuji serve`` asks for it)."""
    metrics = metrics or Metrics()
    tracer = tracing.build(config.tracing)  # None when off (observability/tracing.py)
    slos = {mc.name: mc.slo for mc in config.models if mc.slo is not None}
    metrics.add_slos(slos, config.slos)
    observers = Observers(metrics, tracer)
    cache = backends.build_cache(config, metrics)
    inference = Inference(config, repo, metrics, cache)

    def wire(model: Model) -> None:
        """Connect a model about to serve (at start, or loaded since) to the observers, and
        put its semantic cache in front of it."""
        for m in model.all():
            if metrics.timings(m.metric_name) is None:
                metrics.add_model(m.metric_name, m.served)
            else:  # loaded again: its figures go on; the queue gauge reads the new one
                metrics.queue_depth.labels(m.metric_name).set_function(_waiting(m.served))
            m.served.attach(observers)
            if m.variant and m.primary:
                metrics.variant.labels(m.name, m.variant).set(1)
        mc = model.config
        if mc.semantic_cache:
            from sokuji.routing import semantic

            at = next((f"models[{i}]" for i, c in enumerate(config.models) if c is mc),
                      f"model '{mc.name}'")
            layer = semantic.build(mc.name, mc.version, model.served, dict(mc.semantic_cache),
                                   f"{at}.semantic_cache", repo.models,
                                   config.cache_dir, metrics.routing)
            if layer is not None:  # the model, its semantic cache in front
                model.served = semantic.SemanticModel(model.served, layer)

    for model in list(repo.models.values()):
        wire(model)
    control = ModelControl(config, repo, source_for(config), wire,
                           on_batch=metrics.batch_observer)
    cp = ControlPlane(config, repo, metrics, inference.auth, control)
    control.follow = cp.dashboard.follow
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
        cp.dashboard.start()  # the dashboard's sampler: a point a second (timeseries.py)
        control.start(config.repository_poll_s)  # (0: no polling, explicit loads only)
        grpc_server = await _start_grpc(app_, cp, config) if grpc and config.grpc_port \
            else None
        try:
            yield
        finally:
            if grpc_server is not None:  # (its calls in flight get the grace period)
                await grpc_server.stop(config.shutdown_grace_s or None)
            await cp.dashboard.stop()  # (the dashboard's sampler)
            await control.stop()  # retired versions still draining: stopped now
            if jobs is not None:
                await jobs.stop()
            await repo.stop()
            if cache is not None:
                await cache.close()
            if tracer is not None:  # export the spans still queued
                await asyncio.to_thread(tracer.shutdown)

    control_plane = Starlette(routes=cp.routes(), lifespan=lifespan,
                              exception_handlers=cp.handlers())
    app_ = SokujiApp(inference, control_plane, jobs, tracer)
    app_.control = cp
    if jobs is not None:
        jobs.limit_of = app_.body_limit
    return app_
