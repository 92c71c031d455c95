"""The live dashboard: one static page (HTML, JS, CSS from ``static/``, no build step, nothing
from another origin) and the JSON it polls.

- ``GET /dashboard``: the page. It holds no data, so it needs no key; it is sent with a
  Content-Security-Policy that allows scripts, styles, images and requests from this origin
  only (no inline script at all), ``nosniff``, no framing, no referrer.
- ``GET /dashboard/{dashboard.js,charts.js,dashboard.css,favicon.svg}``: its files (the
  scripts are ES modules).
- ``GET /dashboard/data?since=<seq>``: the sampler's points after ``seq``, at most 128 KB
  of them an answer (``observability/timeseries.py``: ``upto``, ``more``). It shows every
  model's figures, so it follows the rule of ``/metrics``: with keys configured an ``admin``
  key (unless ``metrics_require_key = false``), as ``Authorization: Bearer``; 401 without
  one, 403 for a tenant's. The page asks for a key
  when it gets either, keeps it in ``sessionStorage`` and sends it as that header.
"""

from __future__ import annotations

from importlib import resources

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sokuji.config import ServerConfig
from sokuji.errors import InvalidInput
from sokuji.observability.metrics import Metrics
from sokuji.observability.timeseries import Sampler
from sokuji.repository.models import Model, ModelRepository
from sokuji.server.auth import Authenticator
from sokuji.server.http import JSON

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")
SECURITY = {"content-security-policy": CSP, "x-content-type-options": "nosniff",
            "x-frame-options": "DENY", "referrer-policy": "no-referrer",
            "cache-control": "no-cache"}
FILES = {"dashboard.js": "text/javascript; charset=utf-8",
         "charts.js": "text/javascript; charset=utf-8",
         "dashboard.css": "text/css; charset=utf-8",
         "favicon.svg": "image/svg+xml"}
PAGE = "dashboard.html"


def _read(name: str) -> bytes:
    return (resources.files("sokuji.server") / "static" / name).read_bytes()


class Dashboard:
    def __init__(self, config: ServerConfig, repo: ModelRepository, metrics: Metrics,
                 auth: Authenticator) -> None:
        self.config = config
        self.auth = auth
        self.sampler = Sampler(metrics, repo.every())
        self.enabled = bool(getattr(config, "dashboard", True))
        """``dashboard = false``: no sampler, and the routes answer 404."""
        self._files: dict[str, bytes] = {}

    def start(self) -> None:
        """On the event loop, with the app's lifespan."""
        if self.enabled:
            self.sampler.start()

    async def stop(self) -> None:
        await self.sampler.stop()

    def follow(self, name: str, model: Model | None) -> None:
        """``name`` is served by ``model`` now (loaded again), or no longer (None)."""
        self.sampler.follow(name, model)

    def routes(self) -> list[Route]:
        if not self.enabled:
            return []
        get = ["GET"]
        return [Route("/dashboard", self.page, methods=get),
                Route("/dashboard/data", self.data, methods=get),  # before {name}
                Route("/dashboard/{name}", self.file, methods=get)]

    def _file(self, name: str) -> bytes:
        data = self._files.get(name)
        if data is None:
            data = self._files[name] = _read(name)
        return data

    async def page(self, request: Request) -> Response:
        return Response(self._file(PAGE), headers={
            "content-type": "text/html; charset=utf-8", **SECURITY})

    async def file(self, request: Request) -> Response:
        name = request.path_params["name"]
        kind = FILES.get(name)
        if kind is None:
            raise HTTPException(404, "no such dashboard file")
        return Response(self._file(name), headers={"content-type": kind, **SECURITY})

    async def data(self, request: Request) -> Response:
        if self.config.metrics_require_key:  # (anyone, with no keys configured)
            self.auth.admin(request.headers, "the dashboard's data")
        raw = request.query_params.get("since")
        since: int | None = None
        if raw is not None:
            if not (raw.isascii() and raw.isdigit()) or len(raw) > 15:
                raise InvalidInput("since must be a whole number (the seq of the last point "
                                   "the page holds), 0 or more", param="since")
            since = int(raw)
        return Response(self.sampler.since(since), headers={
            "content-type": JSON, "cache-control": "no-store",
            "x-content-type-options": "nosniff"})
