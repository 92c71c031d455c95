"""Routers are built after every other model (they hold their targets): targets wrapped
with one circuit breaker per model, shared by every router that uses it; a cascade's
threshold (a number, or the calibrated one from the cache); a canary's controller; a shadow.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from sokuji.config import ModelConfig, ServerConfig
from sokuji.core.model import ServedModel
from sokuji.errors import ConfigError
from sokuji.routing.attempts import Target
from sokuji.routing.breaker import Breaker, BreakerState
from sokuji.routing.config import BreakerOptions, RouterOptions
from sokuji.routing.router import RouterModel, read_threshold
from sokuji.routing.shadow import OnShadow, Shadow


@dataclass
class RoutingHooks:
    """Where routing's events go (``observability/routing.py`` fills these)."""

    on_route: Callable[[str, str, str], None] | None = None
    on_breaker: Callable[[str, BreakerState], None] | None = None
    on_canary: Callable[[Any], None] | None = None
    on_shadow: OnShadow | None = None
    breakers: dict[str, Breaker] = field(default_factory=dict)
    routers: dict[str, RouterModel] = field(default_factory=dict)

    def breaker(self, name: str, opts: BreakerOptions, at: str) -> Breaker:
        """The target's one breaker, shared by every router that uses it: routers that set
        its options must agree (one that leaves them at the defaults takes the others')."""
        existing = self.breakers.get(name)
        if existing is None or (existing.opts == BreakerOptions() and opts != existing.opts):
            self.breakers[name] = Breaker(name, opts, on_transition=self._transition)
        elif opts != existing.opts and opts != BreakerOptions():
            raise ConfigError.for_key(f"{at}.breaker", msgspec.to_builtins(opts),
                                      f"target '{name}' already has a breaker with other "
                                      "options (one breaker per target, shared by every "
                                      "router): give the routers the same breaker table")
        return self.breakers[name]

    def _transition(self, name: str, state: BreakerState) -> None:
        if self.on_breaker is not None:
            self.on_breaker(name, state)


def load_router(mc: ModelConfig, opts: RouterOptions, at: str, config: ServerConfig,
                served: Mapping[str, ServedModel], hooks: RoutingHooks) -> RouterModel:
    """The router ``mc`` over the models ``served``; ``opts``: its options, as its kind
    checked them when the config loaded."""
    targets = {name: Target(name, served[name],
                            hooks.breaker(name, opts.breaker, f"{at}.options"))
               for name in opts.all_targets()}
    threshold: float | None = None
    if opts.kind == "cascade":
        threshold = opts.threshold if isinstance(opts.threshold, float) else \
            read_threshold(config.cache_dir, mc.name, f"{at}.options")
    router = RouterModel(mc, opts, targets, threshold, at)
    router.on_route = lambda r, t, why: hooks.on_route(r, t, why) if hooks.on_route else None
    if opts.canary is not None:
        from sokuji.routing.canary import CanaryController

        c = opts.canary
        rng = random.Random(c.seed) if c.seed is not None else None
        controller = CanaryController(
            mc.name, c, rng=rng,
            on_event=lambda event: hooks.on_canary(event) if hooks.on_canary else None)
        router.canary = controller
        arms = {c.stable: "stable", c.canary: "canary"}

        def record(target: Target, ok: bool, ms: float) -> None:
            controller.record(arms[target.name], ok, ms / 1e3)
            controller.evaluate()

        for name in arms:
            targets[name].on_outcome = record
    if opts.shadow is not None:
        shadow_target = Target(opts.shadow.target, served[opts.shadow.target],
                               Breaker(f"{opts.shadow.target}-shadow", opts.breaker))
        labels = bool(router.metadata.outputs) and router.metadata.outputs[0].name == "scores"
        router.shadow = Shadow(mc.name, shadow_target, opts.shadow.fraction, labels,
                               on_result=hooks.on_shadow)
    hooks.routers[mc.name] = router
    router.hooks = hooks
    return router
