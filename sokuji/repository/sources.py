"""Where the models a server may load come from (``repository/control.py`` loads them): a
``Source`` is the names it can load now, and one's ``ModelConfig`` (with a Triton config
override, when a load call sends one).

``config_source`` serves the server's ``[[models]]`` and ``[[pipelines]]`` as the config holds
them (an override sets the Triton fields that have a ``[[models]]`` key: ``override_config``);
``repository_source`` a Triton model repository, read again at each look; ``chain`` the first
of several that has a name. ``source_for`` is the one place that picks the source of a server
(a Triton model repository once ``model_repository`` is configured).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from sokuji.config import ModelConfig, ServerConfig
from sokuji.errors import LoadFailed, ModelNotFound
from sokuji.repository import defaults

Override = str | dict[str, Any] | None
"""A Triton model configuration sent with a load (JSON text or parsed), or None."""


@dataclass(frozen=True)
class Source:
    """Where the models a server may load come from."""

    names: Callable[[], list[str]]
    """Every name it can load now."""
    resolve: Callable[[str, Override], ModelConfig]
    """The config of one (``ModelNotFound`` if it has none of that name), with an override."""
    what: str = "the server's config"


def config_source(config: ServerConfig, keep: Callable[[ModelConfig], bool] = lambda mc: True
                  ) -> Source:
    """The models of the server's config (``[[models]]``, ``[[pipelines]]``, the built-in
    ones) that ``keep`` keeps, as the config holds them: a load builds one again from its
    entry, re-reading its files (a new ``model.onnx`` at the same path is picked up). An
    override sets the Triton fields that have a ``[[models]]`` key (``override_config``)."""

    def entries() -> dict[str, ModelConfig]:
        return {mc.name: mc for _, mc in defaults.entries(config) if keep(mc)}

    def resolve(name: str, override: Override) -> ModelConfig:
        mc = entries().get(name)
        if mc is None:
            raise ModelNotFound(f"unknown model '{name}'", param="model")
        return override_config(mc, override) if override else mc

    return Source(lambda: list(entries()), resolve)


def repository_source(root: Path) -> Source:
    """The models of a Triton model repository (``repository/triton_repo.py``), read again
    at each look: a load reads the model's ``config.pbtxt`` and version directories as they
    are now (a new version dropped in is the one loaded); an override is a whole Triton
    config used in place of ``config.pbtxt``, as Triton's load API takes it."""
    from sokuji.repository import triton_repo

    return Source(lambda: list(triton_repo.names(root)),
                  lambda name, override: triton_repo.model_config(root, name, override),
                  f"the model repository {root}")


def source_for(config: ServerConfig) -> Source:
    """The one place that says where a server's models come from: its config's, and with
    ``model_repository`` the repository's (the config holds those as they were at start,
    ``options.triton_config`` set; they are read from the repository instead)."""
    if not config.model_repository:
        return config_source(config)
    return chain(repository_source(Path(config.model_repository)),
                 config_source(config, lambda mc: "triton_config" not in mc.options))


def chain(*sources: Source) -> Source:
    """The first source that has a name answers for it."""

    def names() -> list[str]:
        seen: dict[str, None] = {}
        for s in sources:
            seen.update(dict.fromkeys(s.names()))
        return list(seen)

    def resolve(name: str, override: Override) -> ModelConfig:
        for s in sources:
            if name in s.names():
                return s.resolve(name, override)
        raise ModelNotFound(f"unknown model '{name}'", param="model")

    return Source(names, resolve, " and ".join(s.what for s in sources))


_OVERRIDABLE = {"name", "backend", "platform", "max_batch_size", "instance_group",
                "dynamic_batching", "version_policy", "input", "output", "parameters"}


def override_config(mc: ModelConfig, override: Override) -> ModelConfig:
    """``mc`` with the fields of a Triton model configuration that have a ``[[models]]`` key:
    ``max_batch_size``, ``instance_group[0].count`` (instances), ``dynamic_batching``'s
    ``max_queue_delay_microseconds`` and ``default_queue_policy`` (``max_queue_size``,
    ``default_timeout_microseconds``). Other known fields are taken as they are; an unknown
    one, or a value of the wrong type, is a ``LoadFailed`` naming it."""
    doc = _parse_override(override)
    unknown = sorted(set(doc) - _OVERRIDABLE)
    if unknown:
        raise LoadFailed(f"config override: field '{unknown[0]}' is not one Sokuji applies to "
                         f"a [[models]] entry (it takes: {', '.join(sorted(_OVERRIDABLE))})",
                         param="parameters.config")
    if doc.get("name", mc.name) != mc.name:
        raise LoadFailed(f"config override: name '{doc['name']}' is not the model's "
                         f"('{mc.name}')", param="parameters.config")
    changes: dict[str, Any] = {}
    if "max_batch_size" in doc:
        changes["max_batch_size"] = doc["max_batch_size"]
    groups = doc.get("instance_group")
    if isinstance(groups, list) and groups and isinstance(groups[0], dict) \
            and "count" in groups[0]:
        changes["instances"] = groups[0]["count"]
    changes = {k: int(v) if isinstance(v, str) and v.isdigit() else v  # (64-bit: strings)
               for k, v in changes.items()}
    batching = doc.get("dynamic_batching")
    if isinstance(batching, dict):
        if "max_queue_delay_microseconds" in batching:
            changes["max_queue_delay_ms"] = _number(
                batching["max_queue_delay_microseconds"], "dynamic_batching."
                "max_queue_delay_microseconds") / 1000
        policy = batching.get("default_queue_policy")
        if isinstance(policy, dict):
            if "max_queue_size" in policy:
                changes["max_queue_depth"] = policy["max_queue_size"]
            if "default_timeout_microseconds" in policy:
                changes["default_timeout_ms"] = _number(
                    policy["default_timeout_microseconds"], "dynamic_batching."
                    "default_queue_policy.default_timeout_microseconds") / 1000
    raw = msgspec.to_builtins(mc)
    raw.update(changes)
    try:
        return msgspec.convert(raw, ModelConfig, strict=True)
    except msgspec.ValidationError as exc:
        what, _, where = str(exc).partition(" - at `$.")
        key = where.rstrip("`").split(".")[0].split("[")[0]
        raise LoadFailed(f"config override: '{_TRITON_NAMES.get(key, key)}': {what}",
                         param="parameters.config") from None


_TRITON_NAMES = {
    "max_batch_size": "max_batch_size", "instances": "instance_group[0].count",
    "max_queue_delay_ms": "dynamic_batching.max_queue_delay_microseconds",
    "max_queue_depth": "dynamic_batching.default_queue_policy.max_queue_size",
    "default_timeout_ms": "dynamic_batching.default_queue_policy."
                          "default_timeout_microseconds"}
"""``[[models]]`` key -> the Triton field an override sets it from (errors name the latter)."""


def _parse_override(override: Override) -> dict[str, Any]:
    if isinstance(override, dict):
        return override
    try:
        doc = msgspec.json.decode(override or "{}")
    except msgspec.DecodeError as exc:
        raise LoadFailed(f"config override is not JSON: {exc}",
                         param="parameters.config") from None
    if not isinstance(doc, dict):
        raise LoadFailed("config override must be a JSON object (a Triton model "
                         "configuration)", param="parameters.config")
    return doc


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise LoadFailed(f"config override: '{key}' must be a number", param="parameters.config")
    try:
        return float(value)  # (protobuf's JSON writes 64-bit integers as strings)
    except ValueError:
        raise LoadFailed(f"config override: '{key}' must be a number",
                         param="parameters.config") from None
