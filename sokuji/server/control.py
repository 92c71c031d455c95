"""The control plane, through Starlette: health, metadata, Triton's configuration and
statistics extensions, model listing and metrics.

Who may see what, when API keys are configured (with none, everything is open):
- Health (``/v2/health/*``, ``/health``) and server metadata (``/v2``): no key. Probes and
  load generators call them before anything else.
- A model's metadata, readiness and configuration, and ``/v1/models``: with
  ``models_require_key`` (the default) a key is needed, a tenant sees only its own models
  and any other name gets 403, whether or not such a model exists (so the answer does not
  tell). Without it they are open, as in Triton.
- Statistics (``/v2/models/stats``, ``.../{model}[/versions/{v}]/stats``): an ``admin`` key.
  A model's counts and ``last_inference`` are every tenant's traffic together, so a tenant
  that may use a model would learn how much the others use it, and when.
- ``/metrics``: an ``admin`` key, unless ``metrics_require_key = false`` (a scraper on a
  private network): every model's and every SLO tenant's figures are there.
- ``/dashboard``: the page is open (it holds no data); its data follows ``/metrics``' rule.
- The model repository extension (``POST /v2/repository/index``,
  ``/v2/repository/models/{model}/load`` and ``/unload``, ``repository/control.py``): an
  ``admin`` key: it lists, loads and unloads every tenant's models.
Every path also answers only to the ``Host`` names ``allowed_hosts`` allows (``hosts.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sokuji import __version__
from sokuji.config import ServerConfig
from sokuji.errors import Forbidden, InvalidInput, NotFound, PayloadTooLarge, SokujiError
from sokuji.observability.metrics import CONTENT_TYPE, Metrics
from sokuji.repository.control import ModelControl
from sokuji.repository.models import Model, ModelRepository
from sokuji.server import triton, v2_encode
from sokuji.server.auth import Authenticator, Tenant
from sokuji.server.dashboard import Dashboard
from sokuji.server.failures import ErrorStyle, error_body, to_error
from sokuji.server.http import JSON

log = logging.getLogger(__name__)
EXTENSIONS = ("binary_tensor_data", "model_configuration", "statistics", "schedule_policy",
              "model_repository", "generate")
"""Triton protocol extensions Sokuji implements (``schedule_policy``: the ``priority`` and
``timeout`` request parameters; ``generate``: ``generate_api.py``)."""

Handler = Callable[[Request, Exception], Awaitable[Response]]


class ControlPlane:
    def __init__(self, config: ServerConfig, repo: ModelRepository, metrics: Metrics,
                 auth: Authenticator, control: ModelControl | None = None) -> None:
        self.config = config
        self.repo = repo
        self.control = control
        """Load, unload and the index (``repository/control.py``); None: not offered."""
        self.metrics = metrics
        self.auth = auth
        self.dashboard = Dashboard(config, repo, metrics, auth)
        """The live dashboard (``dashboard.py``); its sampler starts with the lifespan."""
        self.cluster_metrics: Callable[[], Awaitable[bytes]] | None = None
        """On Ray Serve: every replica's metrics, labelled by replica
        (``scale/ray_metrics.py``); ``/metrics`` answers with them unless asked for
        ``?scope=replica``."""

    def routes(self) -> list[Route]:
        m, v = "/v2/models/{model_name}", "/v2/models/{model_name}/versions/{version}"
        get = ["GET"]
        return [
            Route("/v2", self.server_metadata, methods=get),
            Route("/v2/health/live", self.live, methods=get),
            Route("/v2/health/ready", self.ready, methods=get),
            Route("/health", self.ready, methods=get),  # vLLM's (guidellm probes it)
            Route("/v2/models/stats", self.stats, methods=get),  # before {model_name}
            Route(m, self.model_metadata, methods=get),
            Route(f"{m}/ready", self.model_ready, methods=get),
            Route(f"{m}/config", self.model_config, methods=get),
            Route(f"{m}/stats", self.stats, methods=get),
            Route(v, self.model_metadata, methods=get),
            Route(f"{v}/ready", self.model_ready, methods=get),
            Route(f"{v}/config", self.model_config, methods=get),
            Route(f"{v}/stats", self.stats, methods=get),
            Route("/v1/models", self.openai_models, methods=get),
            Route("/metrics", self.metrics_endpoint, methods=get),
            Route("/v2/repository/index", self.repository_index, methods=["POST"]),
            Route("/v2/repository/models/{model_name}/load", self.load, methods=["POST"]),
            Route("/v2/repository/models/{model_name}/unload", self.unload, methods=["POST"]),
            *self.dashboard.routes(),  # /dashboard, /dashboard/data (the rule of /metrics)
        ]

    def handlers(self) -> dict[Any, Handler]:
        return {SokujiError: self.on_sokuji_error, HTTPException: self.on_http_error,
                Exception: self.on_unexpected}

    # --- who is asking -------------------------------------------------------------------

    def _guarded(self) -> bool:
        """Model endpoints need a key and are limited to the caller's models."""
        return self.auth.enabled and self.config.models_require_key

    def _model(self, request: Request) -> Model:
        """The model (version) the path names, once the caller may see it."""
        p = request.path_params
        if self._guarded():
            self.auth.authenticate(request.headers).check_model(p["model_name"])
        return self.repo.get(p["model_name"], p.get("version"))

    # --- endpoints ---------------------------------------------------------------------

    async def server_metadata(self, request: Request) -> Response:
        return _json({"name": "sokuji", "version": __version__, "extensions": list(EXTENSIONS)})

    async def live(self, request: Request) -> Response:
        return Response(status_code=200)

    async def ready(self, request: Request) -> Response:
        return Response(status_code=200 if self.repo.ready else 503)

    async def model_metadata(self, request: Request) -> Response:
        model = self._model(request)
        versions = triton.versions(self.repo.models[model.name])
        return _json(v2_encode.model_metadata(model.name, versions, triton.metadata(model)))

    async def model_ready(self, request: Request) -> Response:
        return Response(status_code=200 if self._model(request).ready else 503)

    async def model_config(self, request: Request) -> Response:
        model = self._model(request)
        return _json(triton.model_config(model, self.repo.models[model.name],
                                         self.config.cache.enabled))

    async def stats(self, request: Request) -> Response:
        self.auth.admin(request.headers, "statistics")  # OPEN (admin) with no keys
        p = request.path_params
        name = p.get("model_name")
        if name is None:
            models = list(self.repo.every())
        else:
            version = p.get("version")
            models = [self.repo.get(name, version)] if version else self.repo.get(name).all()
        return _json({"model_stats": [
            triton.model_stats(m, self.metrics.model_stats(m.metric_name)) for m in models]})

    async def openai_models(self, request: Request) -> Response:
        tenant: Tenant | None = None
        if self._guarded():
            tenant = self.auth.authenticate(request.headers)
        return _json({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "sokuji"}
            for name in self.repo.models if tenant is None or tenant.may_use(name)]})

    async def metrics_endpoint(self, request: Request) -> Response:
        if self.config.metrics_require_key:  # (anyone, with no keys configured)
            self.auth.admin(request.headers, "/metrics")
        scope = request.query_params.get("scope", "cluster")
        if scope not in ("cluster", "replica"):
            raise InvalidInput(f"scope must be 'cluster' or 'replica', not {scope[:40]!r}",
                               param="scope")
        body = (await self.cluster_metrics() if self.cluster_metrics is not None
                and scope == "cluster" else self.metrics.render())
        return Response(body, headers={"content-type": CONTENT_TYPE})

    # --- the model repository extension (admin) ----------------------------------------

    def _control(self, request: Request) -> ModelControl:
        return self.model_control(request.headers)

    def model_control(self, headers: Mapping[str, str]) -> ModelControl:
        """The repository's control, for an ``admin`` caller (REST and gRPC alike)."""
        tenant = self.auth.authenticate(headers)
        if not tenant.admin:
            raise Forbidden(f"tenant '{tenant.name}' may not control the model repository: "
                            "it loads and unloads every tenant's models, so it needs an API "
                            "key marked admin")
        if self.control is None:
            raise NotFound("this server does not offer model control")
        return self.control

    async def repository_index(self, request: Request) -> Response:
        control = self._control(request)
        doc = await _body(request)
        return _json(await control.index(ready_only=index_ready(doc.get("ready", False))))

    async def load(self, request: Request) -> Response:
        control = self._control(request)
        override = load_parameters(_parameters(await _body(request)))
        await control.load(request.path_params["model_name"], override)
        return _json({})

    async def unload(self, request: Request) -> Response:
        control = self._control(request)
        dependents = unload_parameters(_parameters(await _body(request)))
        await control.unload(request.path_params["model_name"], dependents)
        return _json({})

    # --- errors --------------------------------------------------------------------------

    @staticmethod
    def _error(request: Request, status: int, code: str, message: str,
               param: str | None = None, headers: dict[str, str] | None = None) -> Response:
        # The error format of the API family the path belongs to: /v1/ is OpenAI's
        # namespace (/v1/models, and any unknown path under it); the rest speaks V2.
        style = ErrorStyle.OPENAI if request.url.path.startswith("/v1/") else ErrorStyle.V2
        return Response(error_body(style, status, code, message, param), status_code=status,
                        headers={"content-type": JSON, **(headers or {})})

    async def on_sokuji_error(self, request: Request, exc: Exception) -> Response:
        error = to_error(exc, request.method, request.url.path)
        return self._error(request, error.status, error.code, error.message, error.param,
                           error.headers)  # e.g. WWW-Authenticate on a 401

    async def on_http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        # Starlette's 405 carries the route's Allow header, which RFC 9110 requires.
        headers = {k.lower(): v for k, v in (exc.headers or {}).items()}
        return self._error(request, exc.status_code, code,
                           f"{exc.detail}: {request.method} {request.url.path}",
                           headers=headers)

    async def on_unexpected(self, request: Request, exc: Exception) -> Response:
        return await self.on_sokuji_error(request, exc)  # (logged there, answered 500)


MAX_CONTROL_BODY = 1 << 20
"""A control call's body (an index filter, a load's config override): at most 1 MiB."""


async def _body(request: Request) -> dict[str, Any]:
    """The JSON object a control call sends (an empty body: ``{}``), bounded in bytes."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_CONTROL_BODY:
            raise PayloadTooLarge(f"the request body is over {MAX_CONTROL_BODY} bytes")
    if not raw.strip():
        return {}
    try:
        doc = orjson.loads(bytes(raw))
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidInput("the body must be a JSON object")
    return doc


def _parameters(doc: dict[str, Any]) -> dict[str, Any]:
    params = doc.get("parameters", {})
    if not isinstance(params, dict):
        raise InvalidInput("'parameters' must be an object", param="parameters")
    return dict(params)


def index_ready(ready: Any) -> bool:
    """An index request's ``ready`` (only the models ready), checked."""
    if not isinstance(ready, bool):
        raise InvalidInput("'ready' must be true or false", param="ready")
    return ready


def load_parameters(params: dict[str, Any]) -> str | dict[str, Any] | None:
    """A load's parameters (REST's JSON ``parameters``, gRPC's ``ModelRepositoryParameter``s
    as plain values) as its config override: ``config``, the JSON of a Triton model
    configuration; any other parameter is refused."""
    params = dict(params)
    override = params.pop("config", None)
    if override is not None and not isinstance(override, (str, dict)):
        raise InvalidInput("parameters.config must be a string: the JSON of a Triton "
                           "model configuration", param="parameters.config")
    for key in params:
        raise InvalidInput(f"parameters.{key[:64]}: not a load parameter Sokuji takes (it "
                           "takes 'config'; model files come from the repository)",
                           param=f"parameters.{key[:64]}")
    return override


def unload_parameters(params: dict[str, Any]) -> bool:
    """An unload's parameters as ``unload_dependents``; any other parameter is refused."""
    params = dict(params)
    dependents = params.pop("unload_dependents", False)
    if not isinstance(dependents, bool):
        raise InvalidInput("parameters.unload_dependents must be true or false",
                           param="parameters.unload_dependents")
    for key in params:
        raise InvalidInput(f"parameters.{key[:64]}: not an unload parameter Sokuji takes "
                           "(it takes 'unload_dependents')", param=f"parameters.{key[:64]}")
    return dependents


def _json(doc: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status_code=status, headers={"content-type": JSON})
