"""What a configuration serves: its ``[[models]]``, its ``[[pipelines]]`` (each a model of
kind ``pipeline``), and the built-in pipelines it can serve (``rag``, over the built-in
MiniLM and SmolLM2), each with where it sits in the config (errors name it)."""

from __future__ import annotations

from sokuji.config import ModelConfig, ServerConfig, model_key
from sokuji.repository import registry


def entries(config: ServerConfig) -> list[tuple[str, ModelConfig]]:
    """Every model to build, as (config key, model config), in config order."""
    out = [(model_key(config, i), mc) for i, mc in enumerate(config.models)]
    pipelines = list(config.pipelines)
    if config.builtin_pipelines:
        from sokuji.pipelines import builtin

        pipelines += builtin.pipelines(config)
    if pipelines:
        kind = registry.table_kind("pipelines")
        out += [(f"pipelines[{i}]" if i < len(config.pipelines)
                 else f"built-in pipeline {pc.name}", kind.model_config(pc))
                for i, pc in enumerate(pipelines)]
    return out
