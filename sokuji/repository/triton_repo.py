"""A Triton model repository's models as Sokuji ``ModelConfig``s: the interface for code that
serves or (re)loads them (``sokuji serve --model-repository``, the repository load API).

``names(root)`` lists the model directories; ``model_config(root, name, override)`` is one
model translated (``triton_translate.py``: parsed with Triton's schema, auto-completed from
the graph, checked) and checked as the config checks a ``[[models]]`` entry of its kind
(files, declared tensors' datatypes, preferred batch sizes). The config's own load reads
the repository through ``triton_translate.tables`` (it cannot import this module: this one
imports the config's schema).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sokuji import config_errors
from sokuji.config import ModelConfig, ServerConfig
from sokuji.repository import registry, triton_translate

__all__ = ["model_config", "model_configs", "names"]


def names(root: Path) -> list[str]:
    """The model directories of the repository at ``root``, sorted."""
    return triton_translate.names(root)


def model_config(root: Path, name: str, override: str | dict[str, Any] | None = None
                 ) -> ModelConfig:
    """Model ``name`` of the repository as a checked ``ModelConfig`` (``runtime = "tensor"``).
    ``override``: a model configuration as JSON (string or dict), as Triton's load API takes
    it, used in place of the model's config.pbtxt. ``ConfigError`` naming the model."""
    table = triton_translate.table(root, name, override)
    at = f"model_repository '{name}'"
    model = config_errors.convert(table, ModelConfig, at)
    kind = registry.get(model.runtime, f"{at}.runtime")
    # Checked beside the repository's other models (an ensemble's steps name them).
    others = tuple(ModelConfig(name=n, runtime="tensor") for n in names(root) if n != name)
    kind.check(model, kind.parse(model, at), at, ServerConfig(models=(model, *others)))
    return model


def model_configs(root: Path) -> list[ModelConfig]:
    """Every model of the repository, as ``model_config`` makes each."""
    return [model_config(root, name) for name in names(root)]
