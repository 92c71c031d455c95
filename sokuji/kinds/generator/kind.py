"""Kind ``llama``: a ``GeneratorModel`` over a ``LlamaRuntime`` (the GGUF, its prompt rules,
the engine thread), its SLO budgets handed to the engine's waiting room."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sokuji.config import ModelConfig, ServerConfig
from sokuji.errors import ConfigError
from sokuji.kinds.kind import BuildEnv, Built, Kind


class GeneratorKind(Kind):
    def parse(self, model: ModelConfig, at: str) -> Any:
        return model.options  # checked by the runtime when it is built

    def check(self, model: ModelConfig, options: Any, at: str, config: ServerConfig) -> None:
        super().check(model, options, at, config)
        if model.path is not None and not Path(model.path).is_file():
            raise ConfigError.for_key(f"{at}.path", model.path, "no such file")

    def build(self, model: ModelConfig, options: Any, env: BuildEnv) -> Built:
        return Built(build_generator(model, env.server))


def build_generator(model: ModelConfig, server: ServerConfig) -> Any:
    """The generator (blocking: loads the GGUF, warms up); also what a Ray Serve LLM replica
    builds (``scale/ray_llm.py``)."""
    from sokuji.config_ops import budgets_for
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


KIND = GeneratorKind()
