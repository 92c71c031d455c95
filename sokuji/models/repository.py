"""The model repository: builds each configured model's runtime and batcher, and finds them.

Runtimes are imported by name only when a configured model uses them, so ``import sokuji``
stays light and a server without ONNX models never imports onnxruntime.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from sokuji.config import DEFAULT_MODEL_NAME, ModelConfig, ServerConfig
from sokuji.core.batcher import BatcherConfig, BatchInfo, DynamicBatcher
from sokuji.errors import InvalidInput, ModelNotFound, ModelNotReady
from sokuji.models import variants
from sokuji.runtimes.base import ModelMetadata, Runtime

if TYPE_CHECKING:
    from sokuji.llm.engine import GenerationEngine

log = logging.getLogger(__name__)


def _build_onnx(model: ModelConfig, server: ServerConfig, path: Path | None = None) -> Runtime:
    from sokuji.models import minilm
    from sokuji.runtimes.onnx import OnnxEncoderRuntime

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


def _build_llama(model: ModelConfig, server: ServerConfig) -> Runtime:
    from sokuji.llm.runtime import LlamaRuntime

    return LlamaRuntime(model.name, model.path, model.options, server.cache_dir,
                        model.max_queue_depth, model.priority_aging_ms)


RUNTIME_BUILDERS: dict[str, Callable[[ModelConfig, ServerConfig], Runtime]] = {
    "onnx": _build_onnx,
    "synthetic": _build_synthetic,
    "llama": _build_llama,
}


class Scheduler(Protocol):
    """What the repository and metrics need of a model's queue: a DynamicBatcher (encoders)
    or a GenerationEngine (LLMs)."""

    @property
    def running(self) -> bool: ...

    @property
    def num_waiting(self) -> int: ...

    def check_capacity(self) -> None: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass
class Model:
    config: ModelConfig
    runtime: Runtime
    metadata: ModelMetadata
    batcher: DynamicBatcher | None = None
    engine: GenerationEngine | None = None
    ready: bool = False
    variant: str = ""
    """The ONNX variant this serves (fp32, int8, ...); empty for other runtimes."""
    primary: bool = True
    """False for the other variants, addressed as V2 versions."""
    variants: dict[str, Model] = field(default_factory=dict)
    """The primary's other servable variants, by name."""

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

    @property
    def scheduler(self) -> Scheduler:
        queue = self.engine if self.engine is not None else self.batcher
        assert queue is not None
        return queue

    def embedder(self) -> DynamicBatcher:
        """The batcher of an encoder model; 400 for a generative one."""
        if self.batcher is None:
            raise InvalidInput(f"model '{self.name}' generates text: use "
                               "/v1/chat/completions or /v1/completions", param="model")
        return self.batcher

    def generator(self) -> GenerationEngine:
        """The engine of a generative model; 400 for an encoder."""
        if self.engine is None:
            raise InvalidInput(f"model '{self.name}' does not generate text (it is an "
                               "encoder: use /v1/embeddings or /v2/models/"
                               f"{self.name}/infer)", param="model")
        return self.engine

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
             ) -> ModelRepository:
        """Build, load and warm every configured model (blocking; call before serving)."""
        repo = cls(list_in_errors=not config.api_keys)
        for mc in config.models:
            if mc.runtime == "onnx":
                repo.models[mc.name] = _load_onnx(mc, config, on_batch)
                continue
            runtime = RUNTIME_BUILDERS[mc.runtime](mc, config)
            runtime.load()
            if mc.warmup:
                runtime.warmup()
            engine = getattr(runtime, "engine", None)
            if engine is not None:
                repo.models[mc.name] = Model(mc, runtime, runtime.describe(), engine=engine)
                log.info("model %s loaded (runtime %s)", mc.name, mc.runtime)
                continue
            repo.models[mc.name] = _batched(mc, runtime, on_batch, mc.name)
            log.info("model %s loaded (runtime %s)", mc.name, mc.runtime)
        return repo

    def every(self) -> list[Model]:
        """Every loaded model, other variants included."""
        return [m for model in self.models.values() for m in model.all()]

    def start(self) -> None:
        for model in self.every():
            model.scheduler.start()
            model.ready = True

    def mark_unready(self) -> None:
        """Readiness turns false (shutdown begins); requests are still served."""
        for model in self.every():
            model.ready = False
        self.draining = True

    async def stop(self) -> None:
        for model in self.every():
            model.ready = False
        await asyncio.gather(*(m.scheduler.stop() for m in self.every()))
        # In threads: a runtime's close may wait (bounded) for work it must not free under,
        # e.g. a prompt still being tokenised in a worker thread (LlamaRuntime.close).
        await asyncio.gather(*(asyncio.to_thread(m.runtime.close) for m in self.every()))

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
        if not model.ready and not (self.draining and model.scheduler.running):
            raise ModelNotReady(f"model '{name}' is not ready")
        return model

    @property
    def ready(self) -> bool:
        return bool(self.models) and all(m.ready for m in self.models.values())


def _batched(mc: ModelConfig, runtime: Runtime,
             on_batch: Callable[[str], Callable[[BatchInfo], None]] | None,
             metric_name: str) -> Model:
    batcher = DynamicBatcher(
        metric_name, runtime.run_batch,
        BatcherConfig.from_model(mc),
        on_batch=on_batch(metric_name) if on_batch else None)
    return Model(mc, runtime, runtime.describe(), batcher=batcher)


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
        model = _batched(mc, runtime, on_batch, metric_name)
        model.variant, model.primary = name, name == served
        loaded[name] = model
        log.info("model %s loaded (onnx, variant %s%s)", mc.name, name,
                 "" if name == served else ", as a version")
    primary = loaded.pop(served)
    primary.variants = loaded
    return primary
