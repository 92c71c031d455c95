"""The model repository: builds each configured model as a served model (``core/model.py``:
an ``EncoderModel`` over a runtime and its batcher, or a ``GeneratorModel`` over llama.cpp),
finds them, and says whether they are ready.

Runtimes are imported by name only when a configured model uses them, so ``import sokuji``
stays light and a server without ONNX models never imports onnxruntime.

Readiness: a model is ready once started and while every worker thread of its batcher (or
its engine thread) is alive; the server is ready when every model is. A thread that dies
turns readiness false at once (503), so a balancer stops sending it traffic.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

from sokuji.config import DEFAULT_MODEL_NAME, ModelConfig, ServerConfig, SloConfig, pipeline_model
from sokuji.config_ops import budgets_for
from sokuji.core.batcher import BatchInfo, DynamicBatcher
from sokuji.core.model import ModelKind, ModelMetadata, ServedModel
from sokuji.errors import InvalidInput, ModelNotFound, ModelNotReady
from sokuji.models import variants
from sokuji.models.encoder import EncoderModel, batcher_config
from sokuji.runtimes.base import Runtime

if TYPE_CHECKING:
    from sokuji.llm.generator import GeneratorModel
    from sokuji.media.engine import MediaEngine
    from sokuji.media.model import MediaModel
    from sokuji.pipelines.model import PipelineModel
    from sokuji.routing.load import RoutingHooks

log = logging.getLogger(__name__)


def _build_onnx(model: ModelConfig, server: ServerConfig, path: Path | None = None) -> Runtime:
    from sokuji.runtimes.onnx import OnnxEncoderRuntime
    from sokuji.weights import minilm

    path = path or variants.base_path(model, server)
    if model.path is None and model.name == DEFAULT_MODEL_NAME:
        return OnnxEncoderRuntime(
            path, minilm.tokenizer_path(), intra_op_threads=model.intra_op_threads,
            max_sequence_length=min(model.max_sequence_length, minilm.max_sequence_length()))
    tokenizer = model.tokenizer or str(minilm.tokenizer_path())
    return OnnxEncoderRuntime(path, tokenizer, intra_op_threads=model.intra_op_threads,
                              max_sequence_length=model.max_sequence_length)


def _build_synthetic(model: ModelConfig, server: ServerConfig) -> Runtime:
    from sokuji.runtimes.synthetic import SyntheticRuntime

    return SyntheticRuntime(model.options)


def _build_llama(model: ModelConfig, server: ServerConfig) -> GeneratorModel:
    from sokuji.llm.generator import GeneratorModel
    from sokuji.llm.runtime import LlamaRuntime

    runtime = LlamaRuntime(model.name, model.path, model.options, server.cache_dir,
                           model.max_queue_depth, model.priority_aging_ms,
                           model.max_concurrency)
    runtime.load()
    runtime.engine.queue.slo = budgets_for(model.name, model.slo, server.slos)
    if model.warmup:
        runtime.warmup()
    return GeneratorModel(model, runtime)


def _build_media(model: ModelConfig, server: ServerConfig) -> ServedModel:
    """An OCR or VAD engine (``sokuji/vision``, ``sokuji/audio``) under ``MediaModel``."""
    from sokuji.media.model import MediaModel

    engine: MediaEngine
    # The model's aging rule reaches the engine's queues as an option (an explicit option
    # wins).
    options = {"priority_aging_ms": model.priority_aging_ms, **model.options}
    if model.runtime == "ocr":
        from sokuji.vision.ocr import OcrEngine

        engine = OcrEngine(model.name, options, model.intra_op_threads)
    else:
        from sokuji.audio.vad import VadEngine

        engine = VadEngine(model.name, options, model.intra_op_threads)
    engine.load()
    if model.warmup:
        engine.warmup()
    return MediaModel(model, engine)


def _build_classifier(model: ModelConfig, server: ServerConfig) -> Runtime:
    from sokuji.runtimes.classifier import ClassifierRuntime

    return ClassifierRuntime(model, server)


def _build_upstream(model: ModelConfig, server: ServerConfig) -> ServedModel:
    """A model that is another server (``routing/upstream.py``)."""
    from sokuji.routing.config import parse_upstream
    from sokuji.routing.upstream import UpstreamModel

    at = f"models[{[m.name for m in server.models].index(model.name)}]"
    upstream = UpstreamModel(model, parse_upstream(model.options, f"{at}.options"))
    upstream.load()
    return upstream


RUNTIME_BUILDERS: dict[str, Callable[[ModelConfig, ServerConfig], Runtime]] = {
    "onnx": _build_onnx,
    "synthetic": _build_synthetic,
    "classifier": _build_classifier,
}
"""Encoder runtimes by name (``llama`` is a generator: ``_build_llama``)."""


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
    metadata: ModelMetadata = field(init=False)
    kind: ModelKind = field(init=False)

    def __post_init__(self) -> None:
        self.metadata = self.served.metadata  # (plain attributes: read on every request)
        self.kind = self.served.kind

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
    def metric_name(self) -> str:
        return self.name if self.primary else f"{self.name}@{self.variant}"

    def all(self) -> list[Model]:
        return [self, *self.variants.values()]

    def embedder(self) -> EncoderModel:
        """The model as an encoder; 400 for a generative one."""
        if self.kind is not ModelKind.ENCODER:
            if self.kind is ModelKind.PIPELINE:
                raise InvalidInput(f"'{self.name}' is a pipeline: use /v2/models/{self.name}"
                                   "/infer or /v1/chat/completions", param="model")
            if self.kind is ModelKind.MEDIA:
                what = self.metadata.inputs[0].name
                raise InvalidInput(f"model '{self.name}' takes {what} files: use "
                                   f"/v2/models/{self.name}/infer", param="model")
            raise InvalidInput(f"model '{self.name}' generates text: use "
                               "/v1/chat/completions or /v1/completions", param="model")
        # An EncoderModel, or what serves like one (a router, an upstream): the contract.
        return cast("EncoderModel", self.served)

    def media(self) -> MediaModel | None:
        """The model as a media model (OCR, VAD); None for others."""
        return cast("MediaModel", self.served) if self.kind is ModelKind.MEDIA else None

    def pipeline(self) -> PipelineModel | None:
        """The model as a pipeline; None for a model."""
        return cast("PipelineModel", self.served) if self.kind is ModelKind.PIPELINE else None

    def generator(self) -> GeneratorModel:
        """The model as a generator; 400 for an encoder (or a pipeline that does not
        generate: a generating pipeline is served by ``llm_api`` through ``pipeline()``)."""
        if self.served.kind is not ModelKind.GENERATOR:
            if self.kind is ModelKind.PIPELINE:
                raise InvalidInput(f"pipeline '{self.name}' does not generate text: use "
                                   f"/v2/models/{self.name}/infer", param="model")
            if self.kind is ModelKind.MEDIA:
                raise InvalidInput(f"model '{self.name}' does not generate text: use "
                                   f"/v2/models/{self.name}/infer", param="model")
            raise InvalidInput(f"model '{self.name}' does not generate text (it is an "
                               "encoder: use /v1/embeddings or /v2/models/"
                               f"{self.name}/infer)", param="model")
        return cast("GeneratorModel", self.served)  # the one implementation of that kind

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
    routing: RoutingHooks | None = None
    """Routers' shared breakers and event hooks, when any router is configured."""
    list_in_errors: bool = False
    """Whether a 404 lists the models (or versions) there are. Only on an open server (no
    API keys): with keys, a caller must not learn other tenants' model names from a typo."""

    @classmethod
    def load(cls, config: ServerConfig,
             on_batch: Callable[[str], Callable[[BatchInfo], None]] | None = None,
             served: Mapping[str, ServedModel] | None = None) -> ModelRepository:
        """Build, load and warm every configured model (blocking; call before serving).
        ``served``: models already built, by name, used as they are (on Ray, generators
        that live in deployments of their own: ``scale/ray_llm.py``)."""
        repo = cls(list_in_errors=not config.api_keys)
        for mc in config.models:
            if served is not None and mc.name in served:
                repo.models[mc.name] = Model(mc, served[mc.name])
                log.info("model %s attached (%s)", mc.name, type(served[mc.name]).__name__)
                continue
            if mc.runtime == "onnx":
                repo.models[mc.name] = _load_onnx(mc, config, on_batch)
                continue
            if mc.runtime == "router":
                continue  # after every other model: it holds its targets
            if mc.runtime in ("llama", "ocr", "vad", "upstream"):
                build = {"llama": _build_llama, "upstream": _build_upstream}.get(
                    mc.runtime, _build_media)
                repo.models[mc.name] = Model(mc, build(mc, config))
                log.info("model %s loaded (runtime %s)", mc.name, mc.runtime)
                continue
            runtime = RUNTIME_BUILDERS[mc.runtime](mc, config)
            runtime.load()
            if mc.warmup:
                runtime.warmup()
            repo.models[mc.name] = _batched(mc, runtime, on_batch, mc.name, config.slos)
            log.info("model %s loaded (runtime %s)", mc.name, mc.runtime)
        routers = [(i, mc) for i, mc in enumerate(config.models) if mc.runtime == "router"]
        if routers:
            from sokuji.routing.load import RoutingHooks, load_router

            repo.routing = RoutingHooks()
            targets = {name: m.served for name, m in repo.models.items()}
            for i, mc in routers:
                repo.models[mc.name] = Model(mc, load_router(mc, f"models[{i}]", config,
                                                             targets, repo.routing))
                log.info("router %s loaded", mc.name)
        pipelines = config.pipelines
        if config.builtin_pipelines:
            from sokuji.pipelines import builtin

            pipelines = (*pipelines, *builtin.pipelines(config))
        if pipelines:
            from sokuji.pipelines.load import load_pipelines

            for pc, pipe in load_pipelines(pipelines, config, {
                    name: m.served for name, m in repo.models.items()}):
                repo.models[pc.name] = Model(pipeline_model(pc), pipe)
                log.info("pipeline %s loaded (%d steps)", pc.name, len(pc.steps))
        return repo

    def every(self) -> list[Model]:
        """Every loaded model, other variants included."""
        return [m for model in self.models.values() for m in model.all()]

    def start(self) -> None:
        served = [m.served for m in self.every()]
        for model in self.every():
            if isinstance(model.served, EncoderModel) and len(served) > 1:
                # A lone request may run on the event loop only while the other models
                # have nothing in flight: their replies (tokens) would wait for it.
                model.served.batcher.gate.others_busy = _busy([s for s in served
                                                          if s is not model.served])
            model.served.start()
            model.started = True

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


def _busy(models: list[ServedModel]) -> Callable[[], bool]:
    def busy() -> bool:
        return any(m.num_waiting or m.capacity().num_running for m in models)
    return busy


def _batched(mc: ModelConfig, runtime: Runtime,
             on_batch: Callable[[str], Callable[[BatchInfo], None]] | None,
             metric_name: str, tenant_slos: Iterable[SloConfig] = ()) -> Model:
    batcher = DynamicBatcher(
        metric_name, runtime.run_batch,
        batcher_config(mc, tenant_slos),
        on_batch=on_batch(metric_name) if on_batch else None)
    return Model(mc, EncoderModel(mc, runtime, batcher))


def _load_onnx(mc: ModelConfig, server: ServerConfig,
               on_batch: Callable[[str], Callable[[BatchInfo], None]] | None) -> Model:
    """The served variant as the model, and every other servable variant beside it."""
    served, files = variants.resolve(mc, server)
    loaded: dict[str, Model] = {}
    for name in (served, *sorted(set(files) - {served})):
        runtime = _build_onnx(mc, server, files[name])
        runtime.load()
        if mc.warmup:
            runtime.warmup()
        metric_name = mc.name if name == served else f"{mc.name}@{name}"
        model = _batched(mc, runtime, on_batch, metric_name, server.slos)
        model.variant, model.primary = name, name == served
        loaded[name] = model
        log.info("model %s loaded (onnx, variant %s%s)", mc.name, name,
                 "" if name == served else ", as a version")
    primary = loaded.pop(served)
    primary.variants = loaded
    return primary
