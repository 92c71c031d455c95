"""Kinds by name: the one place that maps a ``runtime`` to the package that serves it.

Built-in kinds are dotted paths, imported only when a configured model names them (uvicorn's
table of implementations is the pattern), so ``import sokuji`` stays light and a server with
no LLM never imports llama.cpp. Other packages add kinds without forking Sokuji, through the
``sokuji.kinds`` entry-point group::

    # the plug-in's pyproject.toml
    [project.entry-points."sokuji.kinds"]
    echo = "my_package.kind:KIND"

The entry point's name is the ``runtime`` a config names; its object is a ``Kind`` instance
(``kinds/kind.py``). A built-in name cannot be taken over by a plug-in. Entry points are read
only when a config names a runtime that is not built in (or asks which there are).
"""

from __future__ import annotations

import importlib
from functools import cache
from importlib import metadata
from typing import Any

from sokuji.errors import ConfigError

GROUP = "sokuji.kinds"
BUILTIN = {
    "onnx": "sokuji.kinds.encoder.kind:KIND",
    "tensor": "sokuji.kinds.tensor.kind:KIND",
    "synthetic": "sokuji.kinds.synthetic.kind:KIND",
    "llama": "sokuji.kinds.generator.kind:KIND",
    "ocr": "sokuji.kinds.ocr.kind:KIND",
    "vad": "sokuji.kinds.vad.kind:KIND",
    "classifier": "sokuji.kinds.classifier.kind:KIND",
    "upstream": "sokuji.kinds.upstream.kind:KIND",
    "router": "sokuji.kinds.router.kind:KIND",
    "pipeline": "sokuji.kinds.pipeline.kind:KIND",
    "ensemble": "sokuji.kinds.ensemble.kind:KIND",
    "python": "sokuji.kinds.python.kind:KIND",
}
"""Built-in kinds: runtime name -> ``module:attribute`` of its ``Kind``."""
TABLES = {"pipelines": "pipeline"}
"""Top-level config tables whose entries are models of a kind: table -> the kind, which
turns an entry into a model's config (``model_config``)."""


@cache
def _plugins() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=GROUP) if ep.name not in BUILTIN}


def names() -> tuple[str, ...]:
    """Every runtime a config may name: the built-in ones, then the plug-ins'."""
    return (*BUILTIN, *sorted(_plugins()))


@cache
def get(name: str, key: str = "runtime") -> Any:
    """The kind called ``name`` (a ``kinds.kind.Kind``); ``ConfigError`` naming ``key`` if
    there is none, or if the plug-in that registers it cannot be imported. (Typed ``Any``:
    the registry sits below the config schema, which the contract's types name.)"""
    target = BUILTIN.get(name)
    if target is not None:
        module, _, attr = target.partition(":")
        kind = getattr(importlib.import_module(module), attr)
    else:
        entry = _plugins().get(name)
        if entry is None:
            raise ConfigError.for_key(key, name, f"must be one of: {', '.join(names())}")
        try:
            kind = entry.load()
        except Exception as exc:
            raise ConfigError.for_key(key, name, f"the kind registered by {entry.value!r} "
                                      f"cannot be loaded: {type(exc).__name__}: {exc}") from exc
    if not all(callable(getattr(kind, verb, None)) for verb in ("parse", "check", "build")):
        raise ConfigError.for_key(key, name, f"{target or name!r} is not a sokuji Kind "
                                  f"(got {type(kind).__name__})")
    return kind


def table_kind(table: str) -> Any:
    """The kind whose models a top-level config table (``[[pipelines]]``) declares."""
    return get(TABLES[table], table)
