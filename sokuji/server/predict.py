"""``Api.PREDICT`` over HTTP: plain JSON in, plain JSON out, for a model whose inputs are no
tensors (a Python model's class: ``kinds/python``).

- ``POST /v2/models/{m}/predict`` (and ``/v2/models/{m}/versions/{v}/predict``): the body is
  one JSON object, the request's values (a class with a typed input gets them validated in
  ``prepare``: a 400 naming the field, before anything is queued); the answer is the
  result as JSON (``to_json``), nothing around it. Errors in V2's form (``{"error",
  "code"}``).
- ``POST /predict`` (LitServe's path): the same, for the one model that serves
  ``Api.PREDICT`` (among those the caller may use); with none or several, a 4xx naming them
  and ``/v2/models/{m}/predict``.
- The lifecycle is V2 infer's (``inference.py``): the tenant's check, readiness, the route's
  check (``apis.require``), admission before the body, the body under the model's
  ``max_request_bytes`` (large ones parsed off the loop), the priority and timeout headers
  (``scheduling``), the response cache (form ``predict``) when the model says the input
  identifies its answer; ``app.py`` adds ``Server-Timing`` and counts the request.

**Streaming.** A model whose class streams (a generator ``predict``: ``streams``) answers
Server-Sent Events (``text/event-stream``), each partial as soon as the model yields it::

    data: {"text": "a"}                       one per partial: to_json of the partial

    data: {"text": "ab"}

    : server-timing decode;dur=0.1, ...       an SSE comment (clients skip it)

    event: end                                the last event of a stream that ended well
    data: {"model_name": "m", "model_version": "1", "partials": 2}

Every ``data`` line is one JSON document, so a client written for Triton's
``generate_stream`` (which reads each ``data:`` line as JSON) reads the partials unchanged;
one that knows SSE event types stops at ``end``. A failure after the status was sent (the
model's code raised mid-stream, the client read so slowly that the model got
``STREAM_BUFFER`` partials ahead) is the stream's last event instead, never a hang::

    event: error
    data: {"error": "model 'm': predict raised ValueError (...)", "code": "model_error",
           "status": 502}

The status waits for the first partial, so a request that fails before it (a deadline in
the queue, the model's code raising at once) gets a proper status and body. The client going
away cancels the request (``handle.cancel()``: a model stops a batch whose requests have all
gone); a send the client does not take within ``streams.idle_timeout_s`` ends the stream.
Streams are never cached. V2 infer (and a job) on a streaming model answers its last result.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import numpy as np
import orjson
from starlette.types import Receive, Send

from sokuji.core import offload
from sokuji.core import timing as timing_
from sokuji.core.cache import Entry
from sokuji.core.model import Api, Report, RequestContext, ServedModel
from sokuji.core.request import Stage, Timeline
from sokuji.errors import BadModelOutput, InvalidInput, ModelNotFound, SokujiError
from sokuji.observability import tracing
from sokuji.repository.models import Model
from sokuji.server import apis, llm_api, scheduling, v2
from sokuji.server.accounting import Accounting
from sokuji.server.auth import Tenant
from sokuji.server.failures import ErrorStyle, error_reply, to_error
from sokuji.server.http import JSON, ClientGone, Headers, check_content_type, read_body
from sokuji.server.inference import VARIANT_HEADER, Answer, Inference, call

log = logging.getLogger(__name__)
ALIAS = "/predict"
"""LitServe's path: the one model that serves ``Api.PREDICT``."""
_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


def route(path: str) -> dict[str, str] | None:
    """The path parameters of a predict path (``{}``: the alias); None: not one."""
    if path == ALIAS:
        return {}
    parts = path.split("/")  # '', 'v2', 'models', name, ['versions', v,] 'predict'
    if len(parts) == 5 and parts[3]:
        return {"model_name": parts[3]}
    if len(parts) == 7 and parts[3] and parts[4] == "versions" and parts[5]:
        return {"model_name": parts[3], "version": parts[5]}
    return None


class Predict:
    """The predict endpoints: ``answer`` (one JSON answer, an ``app.py`` endpoint) and
    ``stream`` (Server-Sent Events, for a model that streams)."""

    def __init__(self, inference: Inference, accounting: Accounting) -> None:
        self.inference = inference
        self.repo = inference.repo
        self.accounting = accounting
        self.send_timeout_s = inference.config.streams.idle_timeout_s

    # -- which model --------------------------------------------------------------------
    def resolve(self, params: dict[str, str], tenant: Tenant) -> str:
        """The model a request names; for the alias, the one model serving ``Api.PREDICT``
        that ``tenant`` may use (put in ``params``), else a 4xx naming them."""
        name = params.get("model_name")
        if name is not None:
            return name
        names = sorted(n for n, m in self.repo.models.items()
                       if Api.PREDICT in m.apis and tenant.may_use(n))
        if len(names) == 1:
            params["model_name"] = names[0]
            return names[0]
        if not names:
            raise ModelNotFound(f"no model serves {ALIAS} (it answers for the one model that "
                                "serves /v2/models/{m}/predict)", param="model")
        raise InvalidInput(f"{ALIAS} answers for the one model that serves predict; "
                           f"{len(names)} do ({', '.join(names)}): use "
                           "/v2/models/{m}/predict", param="model")

    def streaming(self, params: dict[str, str], tenant: Tenant) -> bool:
        """Whether the request's model streams (the alias resolved where it can be); never
        raises: a request it cannot judge goes to ``answer``, which says why."""
        try:
            name = self.resolve(params, tenant)
        except SokujiError:
            return False
        model = self.repo.models.get(name)
        return model is not None and Api.PREDICT in model.apis \
            and bool(getattr(model.served, "streams", False))

    async def _begin(self, path: str, params: dict[str, str], headers: Headers,
                     receive: Receive, tl: Timeline, tenant: Tenant
                     ) -> tuple[Model, ServedModel, dict[str, Any], RequestContext]:
        """Everything before ``prepare``: the model, its admission, the body's values and
        the request's context."""
        name = self.resolve(params, tenant)
        tenant.check_model(name)  # first: 403 tells nothing of other models
        model = self.repo.get_ready(name, params.get("version"))
        if Api.PREDICT not in model.apis:
            apis.require(model, Api.PREDICT, path)
        served = model.served
        served.check_admission()  # refuse before reading the body
        check_content_type(headers, binary_ok=False)
        body = await read_body(receive, headers, self.inference.limit(model),
                               self.inference.body_timeout)
        values = await offload.run(_values, body) if len(body) > v2.INLINE_MAX_BYTES \
            else _values(body)
        tl.mark(Stage.DECODE)
        ctx = scheduling.context(tenant, headers, {}, tl.start_ns,
                                 model.config.default_timeout_ms, timeline=tl)
        return model, served, values, ctx

    # -- one JSON answer ------------------------------------------------------------------
    async def answer(self, params: dict[str, str], headers: Headers, receive: Receive,
                     tl: Timeline, tenant: Tenant) -> Answer:
        path = _path(params)
        model, served, values, ctx = await self._begin(path, params, headers, receive, tl,
                                                       tenant)
        inference = self.inference
        parts = served.identity(values) if inference.cache is not None and \
            model.config.cache and not getattr(served, "streams", False) else None
        if parts is None:
            result, report = await call(model, served, values, ctx)
            body = _json(model, served.to_json(result))
        else:
            async def compute() -> tuple[Entry, Report]:
                result, report = await call(model, served, values, ctx)
                doc = _json(model, served.to_json(result))
                return Entry(np.frombuffer(doc, dtype=np.uint8), 0), report

            entry, report = await inference._cached(model, ctx, parts, compute,
                                                    headers.get("cache-control", ""),
                                                    "predict")
            body = entry.output.tobytes()
        out_headers = {"content-type": JSON}
        if model.variant:
            out_headers[VARIANT_HEADER] = model.variant
        return model, body, out_headers, report

    # -- Server-Sent Events ---------------------------------------------------------------
    async def stream(self, path: str, params: dict[str, str], headers: Headers,
                     receive: Receive, send: Send, t0: int, tenant: Tenant,
                     trace: tracing.Trace | None) -> None:
        """Answer a streaming model's request with its partials as events (the method and
        the caller checked by the app); counted here, as ``app.respond`` counts."""
        tl = Timeline(t0)
        try:
            model, served, values, ctx = await self._begin(path, params, headers, receive,
                                                           tl, tenant)
            if model.variant:
                tl.notes[Stage.INFER] = model.variant
            prepared = await served.prepare(values, ctx)
            tl.mark(Stage.PREPROCESS)
            handle = served.submit(prepared, ctx)
        except ClientGone:
            return
        except Exception as exc:  # noqa: BLE001 - refused before submission: one mapper
            await self._refuse(exc, path, params, t0, tenant, trace, tl, send)
            return
        watcher = asyncio.create_task(llm_api.cancel_on_disconnect(receive, handle))
        events = handle.events()
        started = False
        count = 0
        try:
            async for partial in events:
                chunk = b"data: " + _json(model, served.to_json(partial)) + b"\n\n"
                if not started:
                    await self._send(send, _start(model, handle))
                    started = True
                await self._send(send, {"type": "http.response.body", "body": chunk,
                                        "more_body": True})
                count += 1
            if not started:
                await self._send(send, _start(model, handle))
                started = True
            tl.mark(Stage.ENCODE)
            report = handle.report
            timing = tl.server_timing() if not report.timing else \
                f"{tl.server_timing()}, {timing_.render(report.timing)}"
            end = orjson.dumps({"model_name": model.name,
                                "model_version": model.served_version, "partials": count})
            await self._send(send, {"type": "http.response.body", "more_body": False,
                                    "body": f": server-timing {timing}\n\n".encode()
                                    + b"event: end\ndata: " + end + b"\n\n"})
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the server's own cancellation, not the request's
            self.accounting.left(model.name)
            return  # the client went away while the request waited: cancelled
        except _Unread:
            log.info("a stream of model '%s' ended: its client took nothing for %g s",
                     model.name, self.send_timeout_s)
            self.accounting.left(model.name)
            return
        except Exception as exc:  # noqa: BLE001 - the model's failure or a bug: one mapper
            if watcher.done():
                self.accounting.left(model.name)
                return  # the client is gone: whatever failed since, nobody reads it
            if not started:
                await self._refuse(exc, path, params, t0, tenant, trace, tl, send)
                return
            error = to_error(exc, "POST", path)
            self.accounting.failed(model.name, params.get("version"), error, t0,
                                   tenant.name, trace, "infer", tl, path, exc)
            last = orjson.dumps({"error": error.message, "code": error.code,
                                 "status": error.status})
            with contextlib.suppress(_Unread, OSError):
                await self._send(send, {"type": "http.response.body", "more_body": False,
                                        "body": b"event: error\ndata: " + last + b"\n\n"})
            return
        finally:
            handle.cancel()  # a no-op once finished; the model stops if we got here early
            watcher.cancel()
            await events.aclose()  # type: ignore[attr-defined]
        self.accounting.answered(model, tenant.name, tl, "infer", params["model_name"], path,
                                 trace)

    async def _send(self, send: Send, message: dict[str, Any]) -> None:
        """``send``, bounded: a client that takes nothing for ``streams.idle_timeout_s``
        ends its stream (it holds the request's connection, never the model)."""
        try:
            async with asyncio.timeout(self.send_timeout_s):
                await send(message)
        except TimeoutError:
            raise _Unread from None

    async def _refuse(self, exc: BaseException, path: str, params: dict[str, str], t0: int,
                      tenant: Tenant, trace: tracing.Trace | None, tl: Timeline,
                      send: Send) -> None:
        """An error before the status: its reply, counted as ``app.respond`` counts."""
        error = to_error(exc, "POST", path)
        self.accounting.failed(params.get("model_name", ""), params.get("version"), error,
                               t0, tenant.name, trace, "infer", tl, path, exc)
        with contextlib.suppress(OSError):
            await error_reply(error, ErrorStyle.V2).send(send)


class _Unread(Exception):
    """A send the client did not take in time."""


def _values(body: bytes) -> dict[str, Any]:
    """The body as one request's values: a JSON object."""
    doc = v2.parse_json(body)
    if not isinstance(doc, dict):
        raise InvalidInput(f"the predict body must be a JSON object (the request's values), "
                           f"not {_kind(doc)}")
    return doc


def _kind(doc: Any) -> str:
    return {list: "an array", str: "a string", type(None): "null", bool: "a boolean"}.get(
        type(doc), "a number")


def _json(model: Model, value: Any) -> bytes:
    """A result's JSON value as bytes; what is no JSON is the model's bad output (502)."""
    try:
        return orjson.dumps(value, option=_OPTIONS)
    except TypeError as exc:
        raise BadModelOutput(f"model '{model.name}': its result is not JSON ({exc})") from None


def _start(model: Model, handle: Any) -> dict[str, Any]:
    headers = list(llm_api.SSE_HEADERS)
    report = handle.report
    if report.served_by:
        headers.append((llm_api.SERVED_BY.encode("latin-1"),
                        report.served_by.encode("latin-1")))
    if model.variant:
        headers.append((VARIANT_HEADER.encode(), model.variant.encode("latin-1")))
    return {"type": "http.response.start", "status": 200, "headers": headers}


def _path(params: dict[str, str]) -> str:
    """The path a request came on (for messages), from its parameters."""
    if "model_name" not in params:
        return ALIAS
    version = params.get("version")
    name = params["model_name"]
    return f"/v2/models/{name}/versions/{version}/predict" if version \
        else f"/v2/models/{name}/predict"
