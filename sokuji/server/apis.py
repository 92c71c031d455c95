"""Which routes serve which ``Api``, and the one refusal for a route a model does not serve:
a 400 built from the model's own ``apis``, whatever the model is."""

from __future__ import annotations

from sokuji.core.model import Api
from sokuji.errors import InvalidInput
from sokuji.repository.models import Model


def routes(api: Api, model: str) -> tuple[str, ...]:
    """The paths that answer ``api`` for ``model``."""
    if api is Api.INFER:
        return (f"/v2/models/{model}/infer",)
    if api is Api.EMBED:
        return ("/v1/embeddings",)
    if api is Api.GENERATE:
        return ("/v1/chat/completions", "/v1/completions", f"/v2/models/{model}/generate",
                f"/v2/models/{model}/generate_stream")
    if api is Api.PREDICT:
        return (f"/v2/models/{model}/predict",)
    return (f"/v2/models/{model}/infer (Accept: application/x-ndjson)",)


def require(model: Model, api: Api, route: str) -> None:
    """400 unless ``model`` serves ``api``; ``route``: the path the request came on."""
    if api in model.apis:
        return
    served = [r for a in Api if a in model.apis and a is not Api.STREAM
              for r in routes(a, model.name)]
    raise InvalidInput(f"model '{model.name}' does not serve {route}; it serves "
                       f"{', '.join(served) or 'nothing'}", param="model")
