"""Kind ``router``: a ``RouterModel`` over the models it names, built after them. Its
options (``routing/config.py``'s ``RouterOptions``) are checked when the config loads, its
targets against the other models' names (``check``). Its targets' breakers are shared by
every router of the repository (``BuildEnv.shared``)."""

from __future__ import annotations

import math

from sokuji.config import ModelConfig, ServerConfig
from sokuji.errors import ConfigError
from sokuji.kinds.kind import BuildEnv, Built, Kind
from sokuji.routing.config import RouterOptions


class RouterKind(Kind):
    options = RouterOptions
    phase = 1  # after the models it routes to

    def check(self, model: ModelConfig, options: RouterOptions, at: str,
              config: ServerConfig) -> None:
        super().check(model, options, at, config)
        at = f"{at}.options"
        if options.kind == "cascade" and len(options.targets) != 2:
            raise ConfigError.for_key(f"{at}.targets", list(options.targets),
                                      "a cascade has two targets [small, large]")
        if options.kind == "rules" and not options.rules and not options.default:
            raise ConfigError.for_key(f"{at}.rules", [],
                                      "a rules router needs rules or a default")
        if options.kind == "canary" and options.canary is None:
            raise ConfigError.for_key(f"{at}.canary", None,
                                      "a canary router needs a canary table")
        if isinstance(options.threshold, float) and not math.isfinite(options.threshold):
            raise ConfigError.for_key(f"{at}.threshold", options.threshold, "must be finite")
        kinds = {m.name: m.runtime for m in config.models}
        for key, name in options.named_targets():
            if name not in kinds:
                raise ConfigError.for_key(f"{at}.{key}", name, "no such model")
            if kinds[name] == model.runtime:
                raise ConfigError.for_key(f"{at}.{key}", name,
                                          "a router (routers do not nest)")

    def build(self, model: ModelConfig, options: RouterOptions, env: BuildEnv) -> Built:
        from sokuji.routing.load import RoutingHooks, load_router

        hooks = env.shared.setdefault("hooks", RoutingHooks())
        return Built(load_router(model, options, env.at, env.server, env.models, hooks))


KIND = RouterKind()
