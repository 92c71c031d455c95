"""The model repository: builds each configured model's runtime and batcher, and finds them.

Runtimes are imported by name only when a configured model uses them, so ``import sokuji``
stays light and a server without ONNX models never imports onnxruntime.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from sokuji.config import DEFAULT_MODEL_NAME, ModelConfig, ServerConfig
from sokuji.core.batcher import BatcherConfig, BatchInfo, DynamicBatcher
from sokuji.errors import InvalidInput, ModelNotFound, ModelNotReady
from sokuji.runtimes.base import ModelMetadata, Runtime

if TYPE_CHECKING:
    from sokuji.llm.engine import GenerationEngine

log = logging.getLogger(__name__)


def _build_onnx(model: ModelConfig, server: ServerConfig) -> Runtime:
    from sokuji.runtimes.onnx import OnnxEncoderRuntime

    if model.path is None and model.name == DEFAULT_MODEL_NAME:
        from sokuji.models import minilm

        return OnnxEncoderRuntime(
            minilm.ensure_onnx(server.cache_dir), minilm.tokenizer_path(),
            intra_op_threads=model.intra_op_threads,
            max_sequence_length=min(model.max_sequence_length, minilm.max_sequence_length()))
    assert model.path is not None  # config validation guarantees it
    from sokuji.models import minilm as default_tokenizer

    tokenizer = model.tokenizer or str(default_tokenizer.tokenizer_path())
    return OnnxEncoderRuntime(model.path, tokenizer, intra_op_threads=model.intra_op_threads,
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

    @classmethod
    def load(cls, config: ServerConfig,
             on_batch: Callable[[str], Callable[[BatchInfo], None]] | None = None,
             ) -> ModelRepository:
        """Build, load and warm every configured model (blocking; call before serving)."""
        repo = cls()
        for mc in config.models:
            runtime = RUNTIME_BUILDERS[mc.runtime](mc, config)
            runtime.load()
            if mc.warmup:
                runtime.warmup()
            engine = getattr(runtime, "engine", None)
            if engine is not None:
                repo.models[mc.name] = Model(mc, runtime, runtime.describe(), engine=engine)
                log.info("model %s loaded (runtime %s)", mc.name, mc.runtime)
                continue
            batcher = DynamicBatcher(
                mc.name, runtime.run_batch,
                BatcherConfig(max_batch_size=mc.max_batch_size,
                              max_batch_tokens=mc.max_batch_tokens,
                              max_queue_delay_ms=mc.max_queue_delay_ms,
                              policy=mc.batching, instances=mc.instances,
                              max_queue_depth=mc.max_queue_depth,
                              max_concurrency=mc.max_concurrency,
                              priority_aging_ms=mc.priority_aging_ms),
                on_batch=on_batch(mc.name) if on_batch else None)
            repo.models[mc.name] = Model(mc, runtime, runtime.describe(), batcher=batcher)
            log.info("model %s loaded (runtime %s)", mc.name, mc.runtime)
        return repo

    def start(self) -> None:
        for model in self.models.values():
            model.scheduler.start()
            model.ready = True

    def mark_unready(self) -> None:
        """Readiness turns false (shutdown begins); requests are still served."""
        for model in self.models.values():
            model.ready = False
        self.draining = True

    async def stop(self) -> None:
        for model in self.models.values():
            model.ready = False
        await asyncio.gather(*(m.scheduler.stop() for m in self.models.values()))
        for model in self.models.values():
            model.runtime.close()

    def get(self, name: str, version: str | None = None) -> Model:
        model = self.models.get(name)
        if model is None:
            raise ModelNotFound(f"unknown model '{name}'; available: "
                                f"{', '.join(sorted(self.models)) or 'none'}", param="model")
        if version not in (None, "", model.version):
            raise ModelNotFound(f"model '{name}' has no version '{version}'; "
                                f"available: {model.version}", param="version")
        return model

    def get_ready(self, name: str, version: str | None = None) -> Model:
        model = self.get(name, version)
        if not model.ready and not (self.draining and model.scheduler.running):
            raise ModelNotReady(f"model '{name}' is not ready")
        return model

    @property
    def ready(self) -> bool:
        return bool(self.models) and all(m.ready for m in self.models.values())
