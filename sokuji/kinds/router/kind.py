"""Kind ``router``: a ``RouterModel`` over the models it names, built after them. Its
targets' breakers are shared by every router of the repository (``BuildEnv.shared``)."""

from __future__ import annotations

from typing import Any

from sokuji.config import ModelConfig, ServerConfig
from sokuji.kinds.kind import BuildEnv, Built, Kind


class RouterKind(Kind):
    phase = 1  # after the models it routes to

    def parse(self, model: ModelConfig, at: str) -> Any:
        return model.options  # the targets are checked with the whole config (``check``)

    def check(self, model: ModelConfig, options: Any, at: str, config: ServerConfig) -> None:
        from sokuji.routing.config import parse_router

        super().check(model, options, at, config)
        parse_router(options, f"{at}.options", {m.name: m.runtime for m in config.models})

    def build(self, model: ModelConfig, options: Any, env: BuildEnv) -> Built:
        from sokuji.routing.load import RoutingHooks, load_router

        hooks = env.shared.setdefault("hooks", RoutingHooks())
        return Built(load_router(model, env.at, env.server, env.models, hooks))


KIND = RouterKind()
