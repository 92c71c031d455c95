"""The HTTP side of media models (OCR, VAD): which body it is, read under the model's own
limit, decoded (``media_api``), answered; and the streaming VAD request (``media_stream``).
Called by the app for a model of kind ``media``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.types import Receive, Send

from sokuji.core import offload
from sokuji.core.model import ModelKind, RequestContext
from sokuji.core.request import Stage, Timeline
from sokuji.errors import BadRequest
from sokuji.repository.models import Model, ModelRepository
from sokuji.server import media_api, media_stream, scheduling, v2
from sokuji.server.auth import Tenant
from sokuji.server.http import Headers, read_body

if TYPE_CHECKING:
    from sokuji.server.inference import Inference


def streams(repo: ModelRepository, params: dict[str, str], headers: Headers) -> bool:
    """A V2 infer request whose input streams in (NDJSON out): a media model's."""
    if "model_name" not in params or not media_stream.wants_stream(headers):
        return False
    model = repo.models.get(params["model_name"])
    return model is not None and model.kind is ModelKind.MEDIA


async def infer(inference: Inference, model: Model, headers: Headers, receive: Receive,
                tl: Timeline, tenant: Tenant) -> tuple[str, bytes, Headers]:
    """``POST /v2/models/{m}/infer`` on a media model: V2, the file itself, or multipart."""
    media = model.media()
    assert media is not None
    media.check_admission()  # refuse before reading the body
    kind = media_api.body_kind(headers)
    limit = model.config.max_request_bytes or inference.config.max_request_bytes
    body = await read_body(receive, headers, limit)
    wanted: dict[str, bool] | None = None
    if kind == "v2":
        header_len = headers.get(v2.HEADER_LENGTH)
        try:
            length = int(header_len) if header_len is not None else None
        except ValueError:
            raise BadRequest(f"Inference-Header-Content-Length {header_len!r} is not an "
                             "integer") from None
        decode = media_api.decode_v2
        args = (body, length, media.input_name, model.config.max_batch_size)
        # A large JSON body (base64 files) takes milliseconds to parse and decode: off the
        # event loop, so other requests' replies do not wait for it.
        files, request_id, parameters, wanted = await offload.run(decode, *args) \
            if len(body) > media_api.INLINE_MAX_BYTES else decode(*args)
    else:
        if kind == "multipart":
            body = await media_api.multipart_file(body, headers, limit)
        media_api.check_count(media.input_name, 1 if body else 0, 1)
        files, request_id, parameters = [body], headers.get("x-request-id", ""), {}
    tl.mark(Stage.DECODE)

    def ctx_of(request_id: str, parameters: dict[str, Any]) -> RequestContext:
        return scheduling.context(tenant, headers, parameters, tl.start_ns,
                                  model.config.default_timeout_ms, request_id, tl)
    payload, out_headers = await media_api.infer(
        model, media, files, request_id, parameters, wanted, ctx_of, tl, inference.cache,
        headers.get("cache-control", ""), inference.metrics.observe_media)
    return model.metric_name, payload, out_headers


async def stream(inference: Inference, params: dict[str, str], headers: Headers,
                 query: bytes, receive: Receive, send: Send, t0: int, tenant: Tenant) -> None:
    """A WAV streamed in, segments streamed out (``media_stream``)."""
    tenant.check_model(params["model_name"])
    model = inference.repo.get_ready(params["model_name"], params.get("version"))
    media = model.media()
    assert media is not None
    limit = model.config.max_request_bytes or inference.config.max_request_bytes
    await media_stream.stream_vad(media, limit, headers, query, receive, send)
    tl = Timeline(t0)
    tl.mark(Stage.INFER)
    inference.metrics.observe_request(model.metric_name, tl, 200)
