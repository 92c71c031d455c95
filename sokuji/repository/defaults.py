"""What a configuration serves: its ``[[models]]``, its ``[[pipelines]]`` (each a model of
kind ``pipeline``), and the built-in pipelines it can serve (``rag``, over the built-in
MiniLM and SmolLM2), each with where it sits in the config (errors name it)."""

from __future__ import annotations

from sokuji.config import ModelConfig, ServerConfig


def entries(config: ServerConfig) -> list[tuple[str, ModelConfig]]:
    """Every model to build, as (config key, model config), in config order."""
    out = [(f"models[{i}]", mc) for i, mc in enumerate(config.models)]
    out += [(f"pipelines[{i}]", pc.as_model()) for i, pc in enumerate(config.pipelines)]
    if config.builtin_pipelines:
        from sokuji.pipelines import builtin

        out += [(f"built-in pipeline {pc.name}", pc.as_model())
                for pc in builtin.pipelines(config)]
    return out
