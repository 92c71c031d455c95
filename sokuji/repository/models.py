"""The model repository: builds each configured model by its kind (``kinds/kind.py``, found
by the registry), finds them by name and version, and says whether they are ready.

Kinds are imported by name only when a configured model uses them, so ``import sokuji``
stays light and a server without ONNX models never imports onnxruntime.

Readiness: a model is ready once started and while every worker thread of its batcher (or
its engine thread) is alive; the server is ready when every model is. A thread that dies
turns readiness false at once (503), so a balancer stops sending it traffic.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from sokuji.config import ModelConfig, ServerConfig
from sokuji.core.batcher import BatchInfo
from sokuji.core.model import Api, ModelMetadata, ServedModel
from sokuji.errors import ModelNotFound, ModelNotReady
from sokuji.kinds.kind import BuildEnv, Built
from sokuji.repository import defaults, registry

log = logging.getLogger(__name__)


@dataclass
class Model:
    """A configured model (or one of its ONNX variants) and the served model behind it."""

    config: ModelConfig
    served: ServedModel
    started: bool = False
    """Started and not yet shutting down; ``ready`` also needs its threads alive."""
    variant: str = ""
    """The ONNX variant this serves (fp32, int8, ...); empty for other runtimes."""
    primary: bool = True
    """False for the other variants, addressed as V2 versions."""
    variants: dict[str, Model] = field(default_factory=dict)
    """The primary's other servable variants, by name."""
    uses: frozenset[str] = frozenset()
    """The other models its kind took when it was built (a router's targets, a pipeline's
    steps): it holds them, so they cannot be swapped or unloaded under it
    (``repository/control.py``)."""
    revision: str = ""
    """Which load of its config this is (``repository/control.py``: the config and model
    file's fingerprint); empty for the one built at start. The response cache keys by it,
    so a model loaded again never answers with what the one before computed."""
    metadata: ModelMetadata = field(init=False)
    apis: frozenset[Api] = field(init=False)
    """What it serves (``core.model.Api``)."""

    def __post_init__(self) -> None:
        self.metadata = self.served.metadata  # (plain attributes: read on every request)
        self.apis = self.served.apis

    @classmethod
    def of(cls, config: ModelConfig, built: Built, uses: Iterable[str] = ()) -> Model:
        """The repository's entry for what a kind built: the served model, and its other
        versions beside it; ``uses``: the models it was built over."""
        model = cls(config, built.served, variant=built.variant, uses=frozenset(uses))
        for name, served in built.versions.items():
            model.variants[name] = cls(config, served, variant=name, primary=False)
        return model

    @property
    def ready(self) -> bool:
        return self.started and self.served.alive

    @property
    def served_version(self) -> str:
        """The version responses name: the variant's, once a model has several (they are
        its versions); else the configured one."""
        return self.variant if self.variant and (self.variants or not self.primary) \
            else self.version

    @property
    def cache_version(self) -> str:
        """What names this version in response-cache keys: version, variant, revision."""
        base = f"{self.version}:{self.variant}"
        return f"{base}:{self.revision}" if self.revision else base

    @property
    def metric_name(self) -> str:
        return self.name if self.primary else f"{self.name}@{self.variant}"

    def all(self) -> list[Model]:
        return [self, *self.variants.values()]

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def version(self) -> str:
        return self.config.version


@dataclass
class ModelRepository:
    models: dict[str, Model] = field(default_factory=dict)
    draining: bool = False
    """Shutting down: not ready, but requests that still arrive are served until the end."""
    list_in_errors: bool = False
    """Whether a 404 lists the models (or versions) there are. Only on an open server (no
    API keys): with keys, a caller must not learn other tenants' model names from a typo."""

    @classmethod
    def load(cls, config: ServerConfig,
             on_batch: Callable[[str], Callable[[BatchInfo], None]] | None = None,
             served: Mapping[str, ServedModel] | None = None) -> ModelRepository:
        """Build, load and warm every configured model (blocking; call before serving), each
        by its kind (``repository/registry.py``), in the kinds' phases (a router after its
        targets, a pipeline last). ``served``: models already built, by name, used as they
        are (on Ray, generators that live in deployments of their own: ``scale/ray_llm.py``)."""
        repo = cls(list_in_errors=not config.api_keys)
        entries = [(at, mc, registry.get(mc.runtime, f"{at}.runtime"))
                   for at, mc in defaults.entries(config)]
        shared: dict[int, dict[str, Any]] = {}  # each kind's state, shared by its models
        for phase in sorted({kind.phase for _, _, kind in entries}):
            for at, mc, kind in entries:
                if kind.phase != phase:
                    continue
                if served is not None and mc.name in served:
                    repo.models[mc.name] = Model(mc, served[mc.name])
                    log.info("model %s attached (%s)", mc.name, type(served[mc.name]).__name__)
                    continue
                models = Taken({n: m.served for n, m in repo.models.items()})
                env = BuildEnv(config, at, models, shared.setdefault(id(kind), {}), on_batch)
                built = kind.build(mc, kind.parse(mc, at), env)
                repo.models[mc.name] = Model.of(mc, built, models.taken)
                log.info("model %s loaded (runtime %s)", mc.name, mc.runtime)
        return repo

    def every(self) -> list[Model]:
        """Every loaded model, other variants included."""
        return [m for model in self.models.values() for m in model.all()]

    def start(self) -> None:
        self.wire_neighbours()
        for model in self.every():
            model.served.start()
            model.started = True

    def wire_neighbours(self) -> None:
        """Tell every model how to ask whether the others have work in flight (again after
        a model was swapped or unloaded: the question must name the ones served now)."""
        served = [m.served for m in self.every()]
        if len(served) > 1:
            for model in self.every():
                model.served.neighbours(_busy([s for s in served if s is not model.served]))

    def mark_unready(self) -> None:
        """Readiness turns false (shutdown begins); requests are still served."""
        for model in self.every():
            model.started = False
        self.draining = True

    async def stop(self) -> None:
        for model in self.every():
            model.started = False
        await asyncio.gather(*(m.served.stop() for m in self.every()))
        # In threads: a model's close may wait (bounded) for work it must not free under,
        # e.g. a prompt still being tokenised in a worker thread (LlamaRuntime.close).
        await asyncio.gather(*(asyncio.to_thread(m.served.close) for m in self.every()))

    def get(self, name: str, version: str | None = None) -> Model:
        """The model (version) by name; 404 naming what is missing, and what there is only
        when ``list_in_errors``."""
        model = self.models.get(name)
        if model is None:
            listed = (f"; available: {', '.join(sorted(self.models)) or 'none'}"
                      if self.list_in_errors else "")
            raise ModelNotFound(f"unknown model '{name}'{listed}", param="model")
        if version in model.variants:
            return model.variants[version]
        if version not in (None, "", model.version, model.variant or model.version):
            versions = [model.version, *(v for v in [model.variant] if v), *model.variants]
            listed = f"; available: {', '.join(versions)}" if self.list_in_errors else ""
            raise ModelNotFound(f"model '{name}' has no version '{version}'{listed}",
                                param="version")
        return model

    def get_ready(self, name: str, version: str | None = None) -> Model:
        model = self.get(name, version)
        served = model.served
        if not (model.started or self.draining) or not served.alive:
            raise ModelNotReady(f"model '{name}' is not ready")
        return model

    @property
    def ready(self) -> bool:
        """Every model and every variant it serves as a version is ready."""
        return bool(self.models) and all(m.ready for m in self.every())


class Taken(Mapping[str, ServedModel]):
    """The models a kind is given to build over (``BuildEnv.models``), noting the names it
    takes: what the built model holds. A kind that copies the mapping (a pipeline's
    resources) takes every name it copies."""

    def __init__(self, models: Mapping[str, ServedModel]) -> None:
        self._models = dict(models)
        self.taken: set[str] = set()

    def __getitem__(self, name: str) -> ServedModel:
        served = self._models[name]
        self.taken.add(name)
        return served

    def __iter__(self) -> Iterator[str]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)

    def __contains__(self, name: object) -> bool:
        return name in self._models


def _busy(models: list[ServedModel]) -> Callable[[], bool]:
    def busy() -> bool:
        return any(m.num_waiting or m.capacity().num_running for m in models)
    return busy
