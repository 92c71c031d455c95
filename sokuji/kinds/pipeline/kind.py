"""Kind ``pipeline``: a ``PipelineModel`` per ``[[pipelines]]`` entry (``PipelineConfig.
as_model`` carries the entry as its options), built last: its steps call the other models.
The indexes and feature stores its steps open are shared by every pipeline
(``BuildEnv.shared``)."""

from __future__ import annotations

from typing import Any

from sokuji.config import ModelConfig, PipelineConfig, ServerConfig
from sokuji.errors import ConfigError
from sokuji.kinds.kind import BuildEnv, Built, Kind


class PipelineKind(Kind):
    phase = 2  # after the models and routers its steps call

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

        return Built(load_pipeline(options, env.at, env.server, env.models, env.shared))


KIND = PipelineKind()
