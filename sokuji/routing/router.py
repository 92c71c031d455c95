"""A router is a model (``core/model.py``): addressed by name on every protocol, it answers
each request through one of other models (its targets), chosen per request.

- ``rules``: the first rule whose conditions hold (task, characters, tenant, a header)
  names the target; else ``default``.
- ``cascade``: two classifiers (``runtimes/classifier.py``), small then large: the small one
  answers every item; items whose margin (top1 - top2 score) is below the threshold are
  answered by the large one instead. Or two generators: the small one answers whole; when
  its answer's mean token log-probability (its confidence) is below the threshold, the large
  one answers instead (the client sees one answer; its first token waits for the small
  one's whole answer). The threshold is a number or the one ``sokuji route calibrate``
  fitted (``calibrate.py``).
- ``canary``: a weighted choice between a stable and a canary version
  (``canary.py``: steps, checks against live stable, automatic rollback); an optional shadow
  target gets copies whose answers are compared and discarded (``shadow.py``). A canary
  request that fails is answered by stable (the failure still counts against the canary).

Every kind then falls back: on an error, a timeout, a refusal (429) or an open circuit
breaker (``breaker.py``, one per target, shared by every router) the next target in
``fallbacks`` answers, one attempt per target, within what is left of the request's deadline
(``attempts.py``). A lone failing target is skipped too: with nothing left the request fails
at once with 503 and ``Retry-After``. The handle names the target that answered and why;
the HTTP layer turns that into ``X-Sokuji-Served-By`` and a ``route`` entry of
``Server-Timing``; ``sokuji_route_requests_total{router,target,reason}`` counts it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sokuji.config import ModelConfig
from sokuji.core import text_tensors
from sokuji.core.limits import Limit
from sokuji.core.model import (
    Api,
    Capacity,
    ModelBase,
    ModelMetadata,
    Report,
    RequestContext,
)
from sokuji.core.tensor import InferRequest, Tensor
from sokuji.errors import ConfigError, InvalidInput, Overloaded, RouteUnavailable
from sokuji.routing.attempts import Attempts, PreparedRoute, RouteInfo, Target
from sokuji.routing.config import RouterOptions, Rule
from sokuji.routing.submission import RouteGeneration, RouteSubmission

OnRoute = Callable[[str, str, str], None]
"""(router, target, reason): one call per answered request."""


def calibration_path(cache_dir: str | Path, router: str) -> Path:
    return Path(cache_dir) / "routers" / router / "calibration.json"


def read_threshold(cache_dir: str | Path, router: str, at: str) -> float:
    path = calibration_path(cache_dir, router)
    try:
        data = json.loads(path.read_text())
        return float(data["threshold"])
    except FileNotFoundError:
        raise ConfigError(f"Config '{at}.threshold': 'calibrated', but {path} does not exist: "
                          f"run `sokuji route calibrate {router} ...` first, or give a "
                          "number", param=f"{at}.threshold") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"Config '{at}.threshold': cannot read {path}: {exc}",
                          param=f"{at}.threshold") from None


class RouterModel(ModelBase):
    def __init__(self, config: ModelConfig, options: RouterOptions,
                 targets: Mapping[str, Target], threshold: float | None = None,
                 at: str = "models[]") -> None:
        self.config = config
        self.options = options
        self.targets = dict(targets)
        self.threshold = threshold
        self.on_route: OnRoute | None = None
        self.started = False
        self.in_flight = 0
        self.hooks: Any = None
        """The repository's routing hooks (``routing/load.py``), set when it is built."""
        self.canary: Any = None
        """``canary.CanaryController`` for a canary router."""
        self.shadow: Any = None
        """``shadow.Shadow`` when a shadow target is configured."""
        first = next(iter(self.targets.values())).model
        self.apis: frozenset[Api] = first.apis
        self.batches: bool = first.batches
        self.generates = Api.GENERATE in self.apis
        """Its targets generate: a request is a ``GenerationInput``, its handle a stream."""
        self.metadata: ModelMetadata = first.metadata
        self._check_targets(at)
        self.limits = route_limits(config, [t.model for t in self.targets.values()],
                                   batches_texts=not self.generates)
        self._items = next((x for x in self.limits if x.key == "max_batch_size"), None)
        self.primaries = self._primaries()
        """Targets a request may be sent to first (admission checks them)."""

    # -- the contract ------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.config.name

    @property
    def alive(self) -> bool:
        return self.started and any(t.model.alive for t in self.targets.values())

    @property
    def num_waiting(self) -> int:
        return 0  # a router queues nothing itself: its targets do

    def capacity(self) -> Capacity:
        caps = [t.model.capacity() for t in self.targets.values()]
        return Capacity(ready=self.alive, num_waiting=sum(c.num_waiting for c in caps),
                        num_running=self.in_flight,
                        max_queue_depth=self.config.max_queue_depth,
                        drain_per_s=sum(c.drain_per_s for c in caps))

    def attach(self, observers: Any) -> None:
        if self.hooks is not None:
            observers.routing(self.hooks)  # routes, breakers, canary, shadow

    def check_admission(self) -> None:
        """429 before the body is read only when every target a request could go to first
        is full; 503 with Retry-After when every target (fallbacks too) is cooling down.
        (The edge's check, once per request: each attempt is admitted by its target's own
        ``submit``.)"""
        self._admit()
        candidates = [*self.primaries, *(self.targets[n] for n in self.options.fallbacks)]
        open_ = [t for t in candidates if not t.available()]
        if len(open_) == len(candidates):
            wait = min(t.breaker.retry_after_s() for t in open_)
            raise RouteUnavailable(f"router '{self.name}': every target is failing and "
                                   f"cooling down ({', '.join(t.name for t in open_)})",
                                   retry_after_s=max(1, wait))
        refusal: Overloaded | None = None
        for t in candidates:
            if t in open_:
                continue
            try:
                t.model.check_admission()
                return
            except Overloaded as exc:
                refusal = refusal or exc
        if refusal is not None:
            raise refusal

    def _admit(self) -> None:
        if self.in_flight >= self.config.max_queue_depth:
            raise Overloaded(f"router '{self.name}': {self.in_flight} requests in flight",
                             retry_after_s=1)

    def from_tensors(self, request: InferRequest) -> list[str]:
        tensor = request.inputs.get(self.metadata.inputs[0].name)
        if tensor is not None and self._items is not None:
            self._items.check(len(tensor.data), f"input '{self.metadata.inputs[0].name}'")
        return text_tensors.texts(request, self.metadata, self.config.max_batch_size)

    def to_tensors(self, result: Any, report: Report) -> list[Tensor]:
        return text_tensors.rows(self.metadata, result)

    def identity(self, inputs: Any) -> Any:
        return None if self.generates else inputs

    async def prepare(self, inputs: Any, ctx: RequestContext) -> PreparedRoute:
        if self.generates:
            chars = _generation_chars(inputs)
            return PreparedRoute(inputs, chars, "chat" if inputs.chat else "completion")
        if not isinstance(inputs, list) or not all(isinstance(x, str) for x in inputs):
            raise InvalidInput(f"router '{self.name}' takes texts", param="inputs")
        return PreparedRoute(inputs, sum(map(len, inputs)), "embed", num_items=len(inputs))

    def submit(self, prepared: PreparedRoute, ctx: RequestContext, timing: Any = None) -> Any:
        """``timing``: a generating pipeline's (its answer step stamps the caller's)."""
        self._admit()
        if self.generates:
            return RouteGeneration(self, prepared, ctx, timing)
        return RouteSubmission(self, prepared, ctx)

    def start(self) -> None:
        self.started = True
        if self.canary is not None:
            self.canary_task = asyncio.get_running_loop().create_task(self._tick())

    async def stop(self) -> None:
        self.started = False
        task = getattr(self, "canary_task", None)
        if task is not None:
            task.cancel()
        if self.shadow is not None:
            await self.shadow.drain()

    def close(self) -> None:
        pass

    # -- choosing ----------------------------------------------------------------------
    def plan(self, prepared: PreparedRoute, ctx: RequestContext) -> list[tuple[Target, str]]:
        """Targets in the order they are tried, each with the reason it is tried."""
        opts = self.options
        order: list[tuple[Target, str]] = []
        if opts.kind == "rules":
            name, reason = self._rule(prepared, ctx)
            order.append((self.targets[name], reason))
        elif opts.kind == "canary":
            assert self.canary is not None and opts.canary is not None
            arm = self.canary.choose()
            if arm == "canary":  # a failed canary request is answered by stable
                order.append((self.targets[opts.canary.canary], "canary"))
            order.append((self.targets[opts.canary.stable], "stable"))
        else:
            order.append((self.targets[opts.targets[0]], "cascade"))
        seen = {t.name for t, _ in order}
        for name in opts.fallbacks:
            if name not in seen:
                seen.add(name)
                order.append((self.targets[name], "fallback"))
        return order

    def _rule(self, prepared: PreparedRoute, ctx: RequestContext) -> tuple[str, str]:
        for i, rule in enumerate(self.options.rules):
            if _matches(rule, prepared, ctx):
                return rule.target, f"rule:{i}"
        return self.options.default or self.options.rules[0].target, "default"

    def attempts(self, ctx: RequestContext) -> Attempts:
        return Attempts(self.name, ctx, self.options)

    def routed(self, info: RouteInfo) -> None:
        if self.on_route is not None:
            self.on_route(self.name, info.served_by, info.reason)

    async def _tick(self) -> None:
        """A canary is judged every second too, not only when its requests complete (a
        rollback must not wait for traffic that no longer comes)."""
        while True:
            await asyncio.sleep(1.0)
            self.canary.evaluate()

    # -- checks at start ---------------------------------------------------------------
    def _primaries(self) -> list[Target]:
        opts = self.options
        if opts.kind == "rules":
            names = [r.target for r in opts.rules] + ([opts.default] if opts.default else [])
        elif opts.kind == "canary":
            assert opts.canary is not None
            names = [opts.canary.stable, opts.canary.canary]
        else:
            names = [opts.targets[0]]
        return [self.targets[n] for n in dict.fromkeys(names)]

    def _check_targets(self, at: str) -> None:
        """Targets must look alike to a client: the same apis, inputs and outputs (names,
        datatypes, widths); text in, a row per text or a generation out; a cascade's are
        classifiers (a scores matrix)."""
        ref = self.metadata
        for t in self.targets.values():
            m = t.model
            if not (m.batches or m.apis == {Api.GENERATE}):
                raise ConfigError(f"Config '{at}.options': target '{t.name}' serves "
                                  f"{_apis(m.apis)} without batching texts; routers route "
                                  "encoders, classifiers, generators and upstreams",
                                  param=f"{at}.options")
            if m.apis != self.apis or _shape(m.metadata) != _shape(ref):
                raise ConfigError(
                    f"Config '{at}.options': target '{t.name}' ({_apis(m.apis)}, "
                    f"{_describe(m.metadata)}) differs from '{next(iter(self.targets))}' "
                    f"({_apis(self.apis)}, {_describe(ref)}): a router's targets must take "
                    "and return the same tensors", param=f"{at}.options")
        if self.options.kind == "cascade":
            out = ref.outputs[0] if ref.outputs else None
            classifiers = self.batches and not self.generates and out is not None \
                and out.datatype == "FP32" and out.shape[-1] >= 2
            if not (classifiers or self.generates):
                raise ConfigError(f"Config '{at}.options.targets': a cascade needs two "
                                  "classifiers (runtime classifier: a score per label) or two "
                                  "generators", param=f"{at}.options.targets")
            if self.threshold is None:
                raise ConfigError(f"Config '{at}.options.threshold': missing",
                                  param=f"{at}.options.threshold")


def route_limits(config: ModelConfig, targets: list[Any],
                 batches_texts: bool) -> tuple[Limit, ...]:
    """A router's cost bound: each of its targets' limits at the largest value any target
    allows (what a request may cost wherever it goes: the chosen target checks its own),
    and no more than the router's own bounds: its body (``max_request_bytes``, when it sets
    one) and, for texts, ``max_batch_size`` (the router refuses more before routing)."""
    merged: dict[str, Limit] = {}
    for target in targets:
        for limit in target.limits:
            held = merged.get(limit.key)
            if held is None or limit.value > held.value:
                merged[limit.key] = limit
    own: dict[str, int] = {}
    if config.max_request_bytes is not None:
        own["max_request_bytes"] = config.max_request_bytes
    if batches_texts:
        own["max_batch_size"] = config.max_batch_size
    for key, value in own.items():
        held = merged.get(key)
        if held is None:
            merged[key] = Limit(key, value, "bytes" if key == "max_request_bytes" else "items",
                                "bytes of one request's body" if key == "max_request_bytes"
                                else "texts in one request")
        elif value < held.value:
            merged[key] = Limit(key, value, held.unit, held.what)
    return tuple(merged.values())


def _matches(rule: Rule, prepared: PreparedRoute, ctx: RequestContext) -> bool:
    when = rule.when
    if when.max_chars is not None and prepared.chars > when.max_chars:
        return False
    if when.min_chars is not None and prepared.chars < when.min_chars:
        return False
    if when.tenant and ctx.tenant not in when.tenant:
        return False
    if when.task and prepared.task not in when.task:
        return False
    if when.header:
        headers = ctx.headers or {}
        for name, value in when.header.items():
            if headers.get(name.lower()) != value:
                return False
    return True


def _generation_chars(req: Any) -> int:
    if req.messages is not None:
        return sum(len(str(m.get("content") or "")) for m in req.messages)
    prompt = req.prompt
    return len(prompt) if isinstance(prompt, str) else len(prompt or ())


def _shape(meta: ModelMetadata) -> tuple[Any, ...]:
    return (tuple((s.name, s.datatype) for s in meta.inputs),
            tuple((s.name, s.datatype, s.shape[-1] if s.shape else None)
                  for s in meta.outputs))


def _apis(apis: frozenset[Api]) -> str:
    return "+".join(a.value for a in Api if a in apis) or "nothing"


def _describe(meta: ModelMetadata) -> str:
    ins = ", ".join(f"{s.name} {s.datatype}" for s in meta.inputs)
    outs = ", ".join(f"{s.name} {s.datatype}{list(s.shape)}" for s in meta.outputs)
    return f"inputs {ins}; outputs {outs}"
