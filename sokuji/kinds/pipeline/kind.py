"""Kind ``pipeline``: a ``PipelineModel`` per ``[[pipelines]]`` entry (``model_config`` makes
the entry a model's config, carrying it as its options), built last: its steps call the
other models.
The indexes and feature stores its steps open are shared by every pipeline
(``BuildEnv.shared``)."""

from __future__ import annotations

from typing import Any

from sokuji.config import ModelConfig, ServerConfig
from sokuji.errors import ConfigError
from sokuji.kinds.kind import BuildEnv, Built, Kind
from sokuji.pipelines.config import PipelineConfig


class PipelineKind(Kind):
    phase = 2  # after the models and routers its steps call

    def model_config(self, pc: PipelineConfig) -> ModelConfig:
        """How the model-level parts (Triton config, metadata, deadlines) see a pipeline."""
        return ModelConfig(name=pc.name, runtime="pipeline", version=pc.version,
                           max_batch_size=1, max_queue_depth=pc.max_concurrency or 1024,
                           default_timeout_ms=pc.default_timeout_ms, cache=pc.cache,
                           warmup=False, options={"pipeline": pc})

    def builtins(self, config: ServerConfig) -> tuple[PipelineConfig, ...]:
        """The built-in pipelines ``config`` serves (``rag``): names an API key's ``models``
        may list beside the config's own models and pipelines."""
        if not config.builtin_pipelines:
            return ()
        from sokuji.pipelines import builtin

        return builtin.pipelines(config, quiet=True)

    def parse(self, model: ModelConfig, at: str) -> Any:
        pipeline = model.options.get("pipeline")
        if not isinstance(pipeline, PipelineConfig):
            raise ConfigError.for_key(f"{at}.runtime", model.runtime,
                                      "pipelines are declared as [[pipelines]] entries")
        return pipeline

    def check(self, model: ModelConfig, options: Any, at: str, config: ServerConfig) -> None:
        from sokuji.pipelines.graph import check_pipeline

        check_pipeline(options, at, {m.name for m in config.models})

    def build(self, model: ModelConfig, options: Any, env: BuildEnv) -> Built:
        from sokuji.pipelines.load import load_pipeline

        return Built(load_pipeline(options, env.at, env.server, env.models, env.shared,
                                   env.on_batch))


KIND = PipelineKind()
