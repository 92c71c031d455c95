"""KServe V2 over gRPC: ``inference.GRPCInferenceService`` from the stubs tritonclient ships
(``tritonclient.grpc.service_pb2`` / ``service_pb2_grpc``, ``model_config_pb2``), served by
``grpc.aio`` on ``grpc_port`` in the HTTP app's process and event loop.

It is a second binding of the same path, not a second pipeline: a ``ModelInferRequest`` is
decoded into the ``InferRequest`` of named ``Tensor``s REST decodes to (``grpc_codec.py``),
the model adapts it (``from_tensors``), and ``Inference.infer_tensors`` runs it: the
tenant, admission, the response cache, the same batcher (gRPC and REST requests share
batches). The request's end is counted by ``accounting.py`` as a REST request's is.
- Parameters: ``priority`` and ``timeout`` (microseconds) as REST's; the gRPC deadline bounds
  the request too (the sooner of the two is its deadline).
- Metadata: ``authorization: Bearer <key>`` or ``x-api-key`` (the same keys and tenants),
  ``x-sokuji-priority``, ``x-sokuji-timeout-ms``, ``traceparent``. Trailing metadata:
  ``server-timing`` (the REST header's stages), ``x-sokuji-served-by``, ``retry-after`` on
  RESOURCE_EXHAUSTED (429).
- Messages larger than the largest ``max_request_bytes`` (the server's, any model's) are
  refused by gRPC before they are parsed (RESOURCE_EXHAUSTED); one over its own model's limit
  is refused before it is decoded.
- Who may see what follows the control plane (``control.py``): liveness, readiness and server
  metadata are open; a model's metadata, readiness and configuration need a key that may use
  it when ``models_require_key``; statistics and the repository RPCs (index, load, unload,
  with ``control.py``'s parameter rules) need an ``admin`` key.

Errors map to gRPC status codes as Triton's gRPC server maps them (``STATUS``)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from sokuji import __version__
from sokuji.core import offload
from sokuji.core.model import Api
from sokuji.core.request import Stage, Timeline
from sokuji.core.tensor import InferRequest
from sokuji.errors import PayloadTooLarge, SokujiError
from sokuji.server import apis, grpc_generate, scheduling, triton, v2, v2_encode
from sokuji.server.control import load_parameters, unload_parameters
from sokuji.server.failures import to_error
from sokuji.server.grpc_arrivals import Arrivals
from sokuji.server.grpc_codec import decode_inputs, encode, metadata_response, parameters
from sokuji.server.http import ClientGone

if TYPE_CHECKING:
    from sokuji.config import ServerConfig
    from sokuji.server.control import ControlPlane

log = logging.getLogger(__name__)
SERVICE = "/inference.GRPCInferenceService"
STATUS: Mapping[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED, 408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.ALREADY_EXISTS, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT, 422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED, 500: grpc.StatusCode.INTERNAL,
    501: grpc.StatusCode.UNIMPLEMENTED, 502: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
"""The HTTP status of an error -> its gRPC status code (Triton's mapping where it has one;
any other 4xx: INVALID_ARGUMENT, 5xx: INTERNAL)."""
_TRAILING = ("retry-after", "www-authenticate")
"""An error's headers that go back as trailing metadata."""
T = TypeVar("T")


def status_of(error: SokujiError) -> grpc.StatusCode:
    code = STATUS.get(error.status)
    if code is not None:
        return code
    return grpc.StatusCode.INVALID_ARGUMENT if error.status < 500 else grpc.StatusCode.INTERNAL


def message_limit(config: ServerConfig) -> int:
    """The largest message gRPC takes: the largest request body limit of any model."""
    return max([config.max_request_bytes,
                *(m.max_request_bytes or 0 for m in config.models)])


# -- the service ---------------------------------------------------------------------------

def _headers(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """The call's metadata as REST's headers are seen (``-bin`` keys left out)."""
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


def _ascii(value: str) -> str:
    return value.encode("ascii", "replace").decode("ascii")


class Service(service_pb2_grpc.GRPCInferenceServiceServicer):
    """``inference.GRPCInferenceService`` over the HTTP app's own objects."""

    def __init__(self, app: Any, control: ControlPlane,
                 arrivals: Arrivals | None = None) -> None:
        self.app = app
        self.control = control
        self.arrivals = arrivals
        """ModelInfer calls on their way to their handler (``grpc_arrivals.py``); None: not
        counted (every call may run on the loop when its model is idle)."""
        self.inference = app.inference
        self.repo = app.inference.repo
        self.config = app.inference.config

    async def _answer(self, context: grpc.aio.ServicerContext, work: Callable[[], Awaitable[T]],
                      failed: Callable[[SokujiError], None] | None = None,
                      method: str = "") -> T:
        """``work()``, or the call aborted with its error's status, message and headers."""
        try:
            return await work()
        except (ClientGone, grpc.aio.AbortError, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - every error, SokujiError or a bug: one mapper
            error = to_error(exc, "gRPC", f"{SERVICE}/{method}")
            if failed is not None:
                failed(error)
        trailing = tuple((k, _ascii(v)) for k, v in error.headers.items() if k in _TRAILING)
        await context.abort(status_of(error), error.message, trailing_metadata=trailing)
        raise AssertionError("unreachable")  # (abort raises)

    def _model(self, headers: Mapping[str, str], name: str, version: str) -> Any:
        """The model (version) named, once the caller may see it (``control.py``'s rule)."""
        if self.control._guarded():
            self.inference.auth.authenticate(headers).check_model(name)
        return self.repo.get(name, version or None)

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.repo.ready)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        from sokuji.server.control import EXTENSIONS

        return service_pb2.ServerMetadataResponse(name="sokuji", version=__version__,
                                                  extensions=list(EXTENSIONS))

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            model = self._model(_headers(context), request.name, request.version)
            return service_pb2.ModelReadyResponse(ready=model.ready)

        return await self._answer(context, work, method="ModelReady")

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            model = self._model(_headers(context), request.name, request.version)
            versions = triton.versions(self.repo.models[model.name])
            return metadata_response(v2_encode.model_metadata(model.name, versions,
                                                              triton.metadata(model)))

        return await self._answer(context, work, method="ModelMetadata")

    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            model = self._model(_headers(context), request.name, request.version)
            doc = triton.model_config(model, self.repo.models[model.name],
                                      self.config.cache.enabled)
            config = json_format.ParseDict(doc, model_config_pb2.ModelConfig(),
                                           ignore_unknown_fields=True)
            return service_pb2.ModelConfigResponse(config=config)

        return await self._answer(context, work, method="ModelConfig")

    async def ModelStatistics(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            self.inference.auth.admin(_headers(context), "statistics")
            if not request.name:
                models = list(self.repo.every())
            elif request.version:
                models = [self.repo.get(request.name, request.version)]
            else:
                models = self.repo.get(request.name).all()
            metrics = self.inference.metrics
            doc = {"model_stats": [triton.model_stats(m, metrics.model_stats(m.metric_name))
                                   for m in models]}
            return json_format.ParseDict(doc, service_pb2.ModelStatisticsResponse(),
                                         ignore_unknown_fields=True)

        return await self._answer(context, work, method="ModelStatistics")

    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Triton's repository index (an ``admin`` key, as ``POST /v2/repository/index``);
        ``repository_name`` is ignored: Sokuji serves one repository."""
        async def work() -> Any:
            control = self.control.model_control(_headers(context))
            doc = {"models": await control.index(ready_only=request.ready)}
            return json_format.ParseDict(doc, service_pb2.RepositoryIndexResponse(),
                                         ignore_unknown_fields=True)

        return await self._answer(context, work, method="RepositoryIndex")

    async def RepositoryModelLoad(self, request: Any,
                                  context: grpc.aio.ServicerContext) -> Any:
        """A load, as ``POST /v2/repository/models/{model}/load``: ``parameters["config"]``
        (a string: the JSON of a Triton model configuration) overrides the configuration."""
        async def work() -> Any:
            control = self.control.model_control(_headers(context))
            override = load_parameters(parameters(request.parameters))
            await control.load(request.model_name, override)
            return service_pb2.RepositoryModelLoadResponse()

        return await self._answer(context, work, method="RepositoryModelLoad")

    async def RepositoryModelUnload(self, request: Any,
                                    context: grpc.aio.ServicerContext) -> Any:
        """An unload, as ``POST /v2/repository/models/{model}/unload``:
        ``parameters["unload_dependents"]`` (a bool) unloads the models built over it."""
        async def work() -> Any:
            control = self.control.model_control(_headers(context))
            dependents = unload_parameters(parameters(request.parameters))
            await control.unload(request.model_name, dependents)
            return service_pb2.RepositoryModelUnloadResponse()

        return await self._answer(context, work, method="RepositoryModelUnload")

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """One infer through the REST path's own steps (``SokujiApp.respond`` and
        ``Inference.v2_infer``, with the message in place of the body)."""
        trailing: tuple[tuple[str, str], ...] = ()
        try:
            if grpc_generate.serves(self.repo, request.model_name):
                headers = _headers(context)
                _deadline_header(headers, context.time_remaining())
                response, trailing = await grpc_generate.infer(self.app, request, headers)
            else:
                response, trailing = await self.infer(request, _headers(context),
                                                      context.time_remaining())
        except SokujiError as error:
            trailing = tuple((k, _ascii(v)) for k, v in error.headers.items()
                             if k in _TRAILING)
            await context.abort(status_of(error), error.message, trailing_metadata=trailing)
            raise
        finally:
            if self.arrivals is not None:
                self.arrivals.leave()
        context.set_trailing_metadata(trailing)
        return response

    async def ModelStreamInfer(self, requests: AsyncIterator[Any],
                               context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """A stream of infer requests, each answered as ``ModelInfer`` answers it, as soon as
        it is done (requests of one stream run concurrently: they batch together); an
        error is that request's ``error_message``, in the stream, which goes on. A
        generator's request is answered by a response per token chunk, the last one flagged
        ``triton_final_response`` (``grpc_generate.py``)."""
        headers = _headers(context)
        timed = dict(headers)
        _deadline_header(timed, context.time_remaining())
        answers: asyncio.Queue[Any] = asyncio.Queue()
        pending: set[asyncio.Task[None]] = set()

        async def one(request: Any) -> None:
            if grpc_generate.serves(self.repo, request.model_name):  # a stream of its own
                async for answer in grpc_generate.stream(self.app, request, timed):
                    answers.put_nowait(answer)
                return
            try:
                response, _ = await self.infer(request, headers, context.time_remaining())
                answers.put_nowait(service_pb2.ModelStreamInferResponse(
                    infer_response=response))
            except SokujiError as error:
                answers.put_nowait(service_pb2.ModelStreamInferResponse(
                    error_message=error.message, infer_response=service_pb2.ModelInferResponse(
                        model_name=request.model_name, id=request.id)))

        async def read() -> None:
            async for request in requests:
                task = asyncio.create_task(one(request))
                pending.add(task)
                task.add_done_callback(pending.discard)
            while pending:  # (the client half-closed: answer what it sent)
                await asyncio.wait(set(pending))
            answers.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (answer := await answers.get()) is not None:
                yield answer
            await reader
        finally:  # cancelled (the client went away): nothing it sent goes on running
            for task in (reader, *pending):
                task.cancel()

    async def infer(self, request: Any, headers: dict[str, str], remaining_s: float | None
                    ) -> tuple[Any, tuple[tuple[str, str], ...]]:
        """One ``ModelInferRequest``: its response and trailing metadata, counted as a REST
        request is (``accounting.py``); a ``SokujiError`` (counted) if it fails."""
        app = self.app
        tl = Timeline()
        t0 = tl.start_ns
        name, version = request.model_name, request.model_version or None
        path = f"/v2/models/{name}/infer"
        trace = None if app.tracer is None else app._sample(headers)
        try:
            tenant = self.inference.auth.authenticate(headers)
        except SokujiError as exc:
            app.accounting.unauthorised(exc)
            raise
        try:
            tenant.check_model(name)  # first: 403 tells nothing of other models
            model = self.repo.get_ready(name, version)
            if Api.INFER not in model.apis:
                apis.require(model, Api.INFER, path)
            served = model.served
            served.check_admission()
            size = request.ByteSize()
            limit = self.inference.limit(model)
            if size > limit:
                raise PayloadTooLarge(f"request of {size} bytes is over model '{name}''s "
                                      f"limit of {limit} bytes (max_request_bytes)")
            meta = model.metadata
            decoded, inputs = await offload.run(decode_inputs, served, request, meta) \
                if size > v2.INLINE_MAX_BYTES else decode_inputs(served, request, meta)
            tl.mark(Stage.DECODE)
            _deadline(decoded, headers, remaining_s)
            if self.arrivals is not None:  # (this task's own: read as its context is built)
                scheduling.company.set(self.arrivals.company())
            outputs, report = await self.inference.infer_tensors(model, decoded, inputs,
                                                                 headers, tl, tenant)
            response = encode(model.name, model.served_version, decoded.request_id, outputs,
                              decoded.outputs)
        except ClientGone:
            raise
        except asyncio.CancelledError:  # the call's deadline passed or its client went away:
            if name in self.repo.models:  # (a queued request is dropped, never run)
                app.accounting.left(name)  # 499, as a stream whose client left
            raise
        except Exception as exc:  # noqa: BLE001 - every error, SokujiError or a bug: one mapper
            error = to_error(exc, "gRPC", f"{SERVICE}/ModelInfer")
            app.accounting.failed(name, version, error, t0, tenant.name, trace, "infer", tl,
                                  path, exc)
            raise error from None
        tl.mark(Stage.ENCODE)
        timing = tl.server_timing() if not report.timing \
            else f"{tl.server_timing()}, {_render(report.timing)}"
        trailing = [("server-timing", _ascii(timing))]
        if report.served_by:
            trailing.append(("x-sokuji-served-by", _ascii(report.served_by)))
        if model.variant:
            trailing.append(("x-sokuji-variant", _ascii(model.variant)))
        for key, value in (report.headers or {}).items():
            trailing.append((key.lower(), _ascii(str(value))))
        app.accounting.answered(model, tenant.name, tl, "infer", name, path, trace)
        return response, tuple(trailing)


def _render(timing: Any) -> str:
    from sokuji.core import timing as timings

    return timings.render(timing)


def _deadline_header(headers: dict[str, str], remaining_s: float | None) -> None:
    """The gRPC deadline as ``x-sokuji-timeout-ms`` (a generator's request has no V2
    ``timeout`` parameter to carry it), unless the metadata already sets one."""
    if remaining_s is not None and scheduling.TIMEOUT_HEADER not in headers:
        headers[scheduling.TIMEOUT_HEADER] = str(max(remaining_s, 1e-6) * 1e3)


def _deadline(request: InferRequest, headers: Mapping[str, str],
              remaining_s: float | None) -> None:
    """The gRPC deadline as the request's ``timeout`` parameter (microseconds), where it is
    sooner than the one asked for; ``x-sokuji-timeout-ms`` metadata, if sent, rules as on
    REST."""
    if remaining_s is None or scheduling.TIMEOUT_HEADER in headers:
        return
    micros = max(remaining_s, 1e-6) * 1e6
    asked = request.parameters.get("timeout")
    if asked is None or (isinstance(asked, (int, float)) and not isinstance(asked, bool)
                         and math.isfinite(asked) and asked > micros):
        request.parameters["timeout"] = micros


async def start(app: Any, control: ControlPlane, config: ServerConfig) -> grpc.aio.Server:
    """The gRPC server on ``config.grpc_port``, started (in the running event loop)."""
    limit = message_limit(config)
    arrivals = Arrivals(frozenset({f"{SERVICE}/ModelInfer"}))
    server = grpc.aio.server(interceptors=[arrivals], options=[
        ("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 0)])  # (a port already taken: an error, not a shared port)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Service(app, control, arrivals),
                                                           server)
    host = f"[{config.host}]" if ":" in config.host else config.host  # (IPv6)
    address = f"{host}:{config.grpc_port}"
    cause = ""
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        port, cause = 0, f": {exc}"
    if not port:
        from sokuji.errors import ConfigError

        raise ConfigError.for_key("grpc_port", config.grpc_port,
                                  f"cannot listen on {address} (in use?){cause}")
    await server.start()
    log.info("KServe V2 over gRPC on %s", address)
    return server
