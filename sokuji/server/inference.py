"""The inference endpoints (V2 infer, OpenAI embeddings) as plain functions of (path
parameters, headers, body): decode, the tenant's context, the response cache or the model,
encode. ``app.py`` routes to them and owns the reply; pipelines and media models hand off to
their own modules."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from starlette.types import Receive

from sokuji.config import ServerConfig
from sokuji.core.cache import CacheResult, Entry, ResponseCache, cache_key
from sokuji.core.model import ModelKind, RequestContext
from sokuji.core.request import Stage, Timeline
from sokuji.errors import BadRequest, InvalidInput
from sokuji.models.encoder import EncoderModel
from sokuji.observability.metrics import Metrics
from sokuji.repository.models import Model, ModelRepository
from sokuji.server import media_http, openai_api, scheduling, semantic, v2
from sokuji.server.auth import Authenticator, Tenant
from sokuji.server.http import JSON, Headers, check_content_type, read_body

log = logging.getLogger(__name__)
VARIANT_HEADER = "x-sokuji-variant"


class Inference:
    """The inference endpoints, as plain functions of (path parameters, headers, body)."""

    def __init__(self, config: ServerConfig, repo: ModelRepository, metrics: Metrics,
                 cache: ResponseCache | None = None) -> None:
        self.config = config
        self.repo = repo
        self.metrics = metrics
        self.cache = cache
        self.auth = Authenticator(config.api_keys)
        self.semantic: dict[str, semantic.SemanticLayer] = {}
        """Models with a semantic cache (``semantic.py``), by name."""

    async def _run(self, model: Model, encoder: EncoderModel, texts: list[str],
                   ctx: RequestContext, cache_control: str) -> tuple[np.ndarray, int, Any]:
        """Outputs for ``texts`` (from the cache, or through the ``encoder``), the unpadded
        token count, and for a router the route taken (``routing/attempts.RouteInfo``; None
        for a model, or an answer from the cache)."""
        tl = ctx.timeline
        assert tl is not None
        if self.semantic and model.name in self.semantic:
            return await self._run_semantic(model, encoder, texts, ctx, cache_control)
        variant = model.variant
        if self.cache is None or not model.config.cache:  # the plain path: no closure
            if variant:
                tl.notes[Stage.INFER] = variant
            prepared = await encoder.prepare(texts, ctx)
            tl.mark(Stage.PREPROCESS)
            output = await encoder.submit(prepared, ctx).result()
            tl.mark(Stage.POSTPROCESS)
            return output, prepared.num_tokens, getattr(prepared, "route", None)
        route = None

        async def compute() -> Entry:
            nonlocal route
            tl.mark(Stage.CACHE)
            if variant:
                tl.notes[Stage.INFER] = variant
            prepared = await encoder.prepare(texts, ctx)
            tl.mark(Stage.PREPROCESS)
            output = await encoder.submit(prepared, ctx).result()
            tl.mark(Stage.POSTPROCESS)
            route = getattr(prepared, "route", None)
            return Entry(output, prepared.num_tokens)

        control = cache_control.lower()
        key = cache_key(ctx.tenant, model.name, f"{model.version}:{model.variant}", texts)
        entry, result = await self.cache.get_or_compute(
            model.name, key, compute, read="no-cache" not in control,
            store="no-store" not in control)
        tl.notes[Stage.CACHE] = result.value
        if result in (CacheResult.HIT, CacheResult.COALESCED):
            tl.mark(Stage.CACHE)
        return entry.output, entry.num_tokens, route

    async def _run_semantic(self, model: Model, encoder: EncoderModel, texts: list[str],
                            ctx: RequestContext, cache_control: str
                            ) -> tuple[np.ndarray, int, Any]:
        """``_run`` for a model with a semantic cache: the exact cache first, then the
        semantic one item by item (``semantic.py``), then the model for the rest."""
        tl = ctx.timeline
        assert tl is not None
        layer = self.semantic[model.name]
        route: Any = None
        tokens = 0

        async def infer(sub: list[str], c: RequestContext = ctx) -> np.ndarray:
            nonlocal route, tokens
            prepared = await encoder.prepare(sub, c)
            out = await encoder.submit(prepared, c).result()
            if c is ctx:
                route, tokens = getattr(prepared, "route", None), prepared.num_tokens
            return np.asarray(out)

        async def compute() -> Entry:
            tl.mark(Stage.CACHE)
            output, word = await layer.rows(
                texts, ctx, infer, lambda sub: infer(sub, semantic.prioritised(ctx)))
            tl.notes[Stage.CACHE] = word
            tl.mark(Stage.POSTPROCESS)
            return Entry(output, tokens)

        if self.cache is None or not model.config.cache:
            entry = await compute()
            return entry.output, entry.num_tokens, route
        control = cache_control.lower()
        key = cache_key(ctx.tenant, model.name, f"{model.version}:{model.variant}", texts)
        entry, result = await self.cache.get_or_compute(
            model.name, key, compute, read="no-cache" not in control,
            store="no-store" not in control)
        if result in (CacheResult.HIT, CacheResult.COALESCED):
            tl.notes[Stage.CACHE] = result.value
            tl.mark(Stage.CACHE)
        return entry.output, entry.num_tokens, route

    async def v2_infer(self, params: dict[str, str], headers: Headers, receive: Receive,
                       tl: Timeline, tenant: Tenant) -> tuple[str, bytes, Headers]:
        tenant.check_model(params["model_name"])  # first: 403 tells nothing of other models
        model = self.repo.get_ready(params["model_name"], params.get("version"))
        if model.kind is ModelKind.PIPELINE:
            return await self._pipeline(model, headers, receive, tl, tenant)
        if model.kind is ModelKind.MEDIA:
            return await media_http.infer(self, model, headers, receive, tl, tenant)
        encoder = model.embedder()
        encoder.check_admission()  # refuse before reading the body
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
        ctx = scheduling.context(tenant, headers, req.parameters, tl.start_ns,
                                 model.config.default_timeout_ms, req.request_id, tl)
        output, _, route = await self._run(model, encoder, req.texts, ctx,
                                           headers.get("cache-control", ""))
        payload, out_headers = v2.encode_infer(model.name, model.served_version, req,
                                               [(model.metadata.outputs[0], output)])
        if model.variant:
            out_headers[VARIANT_HEADER] = model.variant
        if model.config.runtime == "router":
            served_by(out_headers, route)
        return model.metric_name, payload, out_headers

    async def _pipeline(self, model: Model, headers: Headers, receive: Receive, tl: Timeline,
                        tenant: Tenant) -> tuple[str, bytes, Headers]:
        from sokuji.server import pipeline_api

        pipe = model.pipeline()
        assert pipe is not None
        pipe.check_admission()
        if headers.get(v2.HEADER_LENGTH) is not None:
            raise BadRequest("pipelines take JSON tensors only, not the binary extension")
        check_content_type(headers, binary_ok=False)
        body = await read_body(receive, headers, self.config.max_request_bytes)

        def ctx_of(request_id: str, parameters: dict[str, Any]) -> RequestContext:
            # No timeline: the steps' models stamp their own; the pipeline's is ``tl``.
            return scheduling.context(tenant, headers, parameters, tl.start_ns,
                                      model.config.default_timeout_ms, request_id)
        payload, out_headers = await pipeline_api.infer(model, pipe, body, headers, ctx_of,
                                                        tl, self.cache)
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
        if model.metadata.platform == "sokuji_classifier":
            raise InvalidInput(f"'{req.model}' is a classifier (scores, not embeddings): use "
                               f"/v2/models/{req.model}/infer", param="model")
        openai_api.check_limits(req, model.config.max_batch_size,
                                model.metadata.outputs[0].shape[-1])
        tl.mark(Stage.DECODE)
        ctx = scheduling.context(tenant, headers, {}, tl.start_ns,
                                 model.config.default_timeout_ms, timeline=tl)
        output, num_tokens, route = await self._run(model, model.embedder(), req.texts, ctx,
                                                    headers.get("cache-control", ""))
        out_headers = {"content-type": JSON}
        if model.variant:
            out_headers[VARIANT_HEADER] = model.variant
        if model.config.runtime == "router":
            served_by(out_headers, route)
        return model.metric_name, openai_api.encode_embeddings(req, output, num_tokens), \
            out_headers


SERVED_BY_HEADER = "x-sokuji-served-by"


def served_by(out_headers: Headers, route: Any) -> None:
    """A router's answer names the target that gave it (``cache`` for the response cache's)
    and, in ``Server-Timing``, why and what was tried."""
    if route is None:
        out_headers[SERVED_BY_HEADER] = "cache"
        return
    from sokuji.core import timing

    out_headers[SERVED_BY_HEADER] = route.served_by
    out_headers["server-timing"] = timing.render([route.timing_entry()])
