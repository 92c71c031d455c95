"""The inference endpoints (V2 infer, OpenAI embeddings) as plain functions of (path
parameters, headers, body), one way for every model that serves them: the tenant's check,
the model's readiness and admission (before the body), the body under the model's own
limit, decoded by the one codec (``v2.py``; large bodies off the loop) and adapted by the
model (``from_tensors``), the request's context, then the response cache or the model
through the contract (``prepare`` -> ``submit`` -> ``result()``), and the answer encoded
(``to_tensors`` / ``to_plain``). ``app.py`` routes to them and owns the reply."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import orjson
from starlette.types import Receive

from sokuji.config import ServerConfig
from sokuji.core import offload
from sokuji.core.cache import CacheResult, Entry, ResponseCache, cache_key
from sokuji.core.model import (
    Api,
    ModelMetadata,
    Report,
    RequestContext,
    ServedModel,
)
from sokuji.core.request import Stage, Timeline
from sokuji.core.tensor import InferRequest, Tensor
from sokuji.observability.metrics import Metrics
from sokuji.repository.models import Model, ModelRepository
from sokuji.server import apis, cache_entries, openai_api, scheduling, uploads, v2, v2_encode
from sokuji.server.auth import Authenticator, Tenant
from sokuji.server.http import JSON, BodyTimeout, Headers, check_content_type, read_body

log = logging.getLogger(__name__)
VARIANT_HEADER = "x-sokuji-variant"
CACHED = Report(served_by="cache", cached=True)
"""The report of an answer the response cache gave (computed for another request)."""
Answer = tuple[Model, bytes, Headers, Report]
"""What an endpoint answers: the model (version) that served, the body, its headers, and
the handle's report (``app.py`` adds the timing and the report's headers)."""


class Inference:
    """The inference endpoints, as plain functions of (path parameters, headers, body)."""

    def __init__(self, config: ServerConfig, repo: ModelRepository, metrics: Metrics,
                 cache: ResponseCache | None = None) -> None:
        self.config = config
        self.repo = repo
        self.metrics = metrics
        self.cache = cache
        self.auth = Authenticator(config.api_keys)
        self.body_timeout = BodyTimeout.of(config)

    def limit(self, model: Model) -> int:
        """The request body limit of ``model``: its own, else the server's."""
        return model.config.max_request_bytes or self.config.max_request_bytes

    async def v2_infer(self, params: dict[str, str], headers: Headers, receive: Receive,
                       tl: Timeline, tenant: Tenant) -> Answer:
        name = params["model_name"]
        tenant.check_model(name)  # first: 403 tells nothing of other models
        model = self.repo.get_ready(name, params.get("version"))
        if Api.INFER not in model.apis:
            apis.require(model, Api.INFER, f"/v2/models/{name}/infer")
        served = model.served
        served.check_admission()  # refuse before reading the body
        meta = model.metadata
        form = uploads.form(headers, meta)
        limit = self.limit(model)
        body = await read_body(receive, headers, limit, self.body_timeout)
        if form == uploads.V2:
            length = v2.header_length(headers)
            # A large body (base64 files) takes milliseconds to parse and decode: off the
            # event loop, so other requests' replies do not wait for it.
            request, inputs = await offload.run(_decode, served, body, length, meta) \
                if len(body) > v2.INLINE_MAX_BYTES else _decode(served, body, length, meta)
        else:
            if form == uploads.FORM:
                body = await uploads.multipart_file(body, headers, limit)
            request = uploads.request(meta, body, headers)
            inputs = served.from_tensors(request)
        tl.mark(Stage.DECODE)
        if form == uploads.V2:
            outputs, report = await self.infer_tensors(model, request, inputs, headers, tl,
                                                       tenant)
        else:
            return await self._infer_plain(model, request, inputs, headers, tl, tenant)
        payload, out_headers = v2_encode.encode_infer(model.name, model.served_version,
                                               request.request_id, outputs, request.outputs)
        if model.variant:
            out_headers[VARIANT_HEADER] = model.variant
        return model, payload, out_headers, report

    async def infer_tensors(self, model: Model, request: InferRequest, inputs: Any,
                            headers: Headers, tl: Timeline, tenant: Tenant
                            ) -> tuple[Sequence[Tensor], Report]:
        """A decoded V2 request (``inputs``: the model's ``from_tensors`` of it) through
        the contract: the request's context (priority, deadline, tenant), then the response
        cache or the model (``prepare`` -> ``submit`` -> ``result()``): the output tensors
        and the report. Every V2 infer goes through here whatever its binding (REST in
        ``v2_infer``, gRPC in ``grpc_v2.py``), so both share admission, cache and batches."""
        served = model.served
        ctx = scheduling.context(tenant, headers, request.parameters, tl.start_ns,
                                 model.config.default_timeout_ms, request.request_id, tl)
        parts = served.identity(inputs) if self.cache is not None and model.config.cache \
            else None
        if parts is None:  # the plain path: no closure, no coroutine of its own
            if model.variant:
                tl.notes[Stage.INFER] = model.variant
            prepared = await served.prepare(inputs, ctx)
            tl.mark(Stage.PREPROCESS)
            handle = served.submit(prepared, ctx)
            result = await handle.result()
            tl.mark(Stage.POSTPROCESS)
            report = handle.report
            return served.to_tensors(result, report), report
        meta = model.metadata

        async def tensors() -> tuple[Entry, Report]:
            result, report = await call(model, served, inputs, ctx)
            return cache_entries.entry(served.to_tensors(result, report), meta,
                                        report.input_tokens), report

        entry, report = await self._cached(model, ctx, parts, tensors,
                                           headers.get("cache-control", ""))
        return cache_entries.tensors(entry, meta), report

    async def _infer_plain(self, model: Model, request: InferRequest, inputs: Any,
                           headers: Headers, tl: Timeline, tenant: Tenant) -> Answer:
        """A plain upload (a file, a form) answered with the model's plain JSON."""
        served = model.served
        ctx = scheduling.context(tenant, headers, request.parameters, tl.start_ns,
                                 model.config.default_timeout_ms, request.request_id, tl)
        parts = served.identity(inputs) if self.cache is not None and model.config.cache \
            else None
        if parts is None:
            result, report = await call(model, served, inputs, ctx)
            return model, _plain(model, served.to_plain(result)), {"content-type": JSON}, \
                report

        async def plain() -> tuple[Entry, Report]:
            result, report = await call(model, served, inputs, ctx)
            doc = _plain(model, served.to_plain(result))
            return Entry(np.frombuffer(doc, dtype=np.uint8), 0), report

        entry, report = await self._cached(model, ctx, parts, plain,
                                           headers.get("cache-control", ""), "plain")
        return model, entry.output.tobytes(), {"content-type": JSON}, report

    async def openai_embeddings(self, params: dict[str, str], headers: Headers,
                                receive: Receive, tl: Timeline, tenant: Tenant) -> Answer:
        check_content_type(headers, binary_ok=False)
        body = await read_body(receive, headers, self.config.max_request_bytes,
                               self.body_timeout)
        req = openai_api.decode_embeddings(body)
        params["model_name"] = req.model
        tenant.check_model(req.model)
        model = self.repo.get_ready(req.model)
        if Api.EMBED not in model.apis:
            apis.require(model, Api.EMBED, "/v1/embeddings")
        served = model.served
        served.check_admission()  # (the body names the model: admitted once it is read)
        openai_api.check_limits(req, model.config.max_batch_size,
                                model.metadata.outputs[0].shape[-1])
        tl.mark(Stage.DECODE)
        ctx = scheduling.context(tenant, headers, {}, tl.start_ns,
                                 model.config.default_timeout_ms, timeline=tl)
        texts = req.texts
        parts = served.identity(texts) if self.cache is not None and model.config.cache \
            else None
        if parts is None:  # the plain path: no closure, no coroutine of its own
            if model.variant:
                tl.notes[Stage.INFER] = model.variant
            prepared = await served.prepare(texts, ctx)
            tl.mark(Stage.PREPROCESS)
            handle = served.submit(prepared, ctx)
            output = await handle.result()
            tl.mark(Stage.POSTPROCESS)
            report = handle.report
            tokens = report.input_tokens
        else:
            async def rows() -> tuple[Entry, Report]:
                result, report = await call(model, served, texts, ctx)
                return Entry(np.asarray(result), report.input_tokens), report

            entry, report = await self._cached(model, ctx, parts, rows,
                                               headers.get("cache-control", ""))
            output, tokens = entry.output, entry.num_tokens
        out_headers = {"content-type": JSON}
        if model.variant:
            out_headers[VARIANT_HEADER] = model.variant
        return model, openai_api.encode_embeddings(req, output, tokens), out_headers, report

    async def _cached(self, model: Model, ctx: RequestContext, parts: Sequence[str],
                      compute: Callable[[], Awaitable[tuple[Entry, Report]]],
                      cache_control: str, form: str = "") -> tuple[Entry, Report]:
        """The one response cache of every cached request: key (keys configured, tenant,
        model, version:variant, ``form``, what the model says identifies the input),
        ``Cache-Control``'s no-cache / no-store, the Timeline's ``cache`` stage and its
        note."""
        assert self.cache is not None and ctx.timeline is not None
        tl = ctx.timeline
        report = CACHED

        async def run() -> Entry:
            nonlocal report
            tl.mark(Stage.CACHE)
            entry, report = await compute()
            return entry

        control = cache_control.lower()
        key = cache_key(ctx.tenant, model.name, model.cache_version, parts,
                        keyed=self.auth.enabled, form=form)
        entry, result = await self.cache.get_or_compute(
            model.name, key, run, read="no-cache" not in control,
            store="no-store" not in control)
        tl.notes.setdefault(Stage.CACHE, result.value)  # (a semantic cache's word first)
        if result in (CacheResult.HIT, CacheResult.COALESCED):
            tl.mark(Stage.CACHE)
        return entry, report


def _decode(served: ServedModel, body: bytes, length: int | None, meta: ModelMetadata
            ) -> tuple[InferRequest, Any]:
    """The body as a V2 request and as the model's inputs (on any thread)."""
    request = v2.decode(body, length, meta)
    return request, served.from_tensors(request)


async def call(model: Model, served: ServedModel, inputs: Any, ctx: RequestContext
               ) -> tuple[Any, Report]:
    """One request through the contract, its Timeline stamped: the result and the report."""
    tl = ctx.timeline
    assert tl is not None
    if model.variant:
        tl.notes[Stage.INFER] = model.variant
    prepared = await served.prepare(inputs, ctx)
    tl.mark(Stage.PREPROCESS)
    handle = served.submit(prepared, ctx)
    result = await handle.result()
    tl.mark(Stage.POSTPROCESS)
    return result, handle.report


def _plain(model: Model, doc: dict[str, Any]) -> bytes:
    return orjson.dumps({"model_name": model.name, "model_version": model.served_version,
                         **doc}, option=orjson.OPT_SERIALIZE_NUMPY)
