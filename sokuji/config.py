"""One typed configuration, validated once at start-up.

Precedence, lowest first: built-in defaults < TOML file < ``SOKUJI_*`` environment < CLI flags.
Every invalid value stops start-up with a ``ConfigError`` naming the key and the value.

A file looks like::

    host = "127.0.0.1"
    port = 8000

    [[models]]
    name = "minilm"
    runtime = "onnx"            # onnx | synthetic | llama (GGUF through llama.cpp)
    max_batch_size = 32
    max_batch_tokens = 8192     # items x padded length
    max_queue_delay_ms = 2.0
    batching = "length"         # length | fifo
    intra_op_threads = 0        # 0: let Sokuji choose
"""

from __future__ import annotations

import enum
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from sokuji.errors import ConfigError

ENV_PREFIX = "SOKUJI_"
DEFAULT_MODEL_NAME = "minilm"
DEFAULT_LLM_NAME = "smollm2"


class BatchPolicy(enum.StrEnum):
    LENGTH = "length"
    FIFO = "fifo"


@dataclass(frozen=True)
class ModelConfig:
    name: str
    runtime: str = "onnx"
    path: str | None = None
    """ONNX file (runtime onnx). None for the built-in ``minilm``: exported into the cache."""
    tokenizer: str | None = None
    """tokenizer.json for the onnx runtime; defaults to the built-in MiniLM tokenizer."""
    version: str = "1"
    max_batch_size: int = 32
    max_batch_tokens: int = 8192
    max_queue_delay_ms: float = 2.0
    batching: BatchPolicy = BatchPolicy.LENGTH
    instances: int = 1
    """Batches that may run at once (each in its own worker thread)."""
    intra_op_threads: int = 0
    max_sequence_length: int = 256
    max_queue_depth: int = 1024
    """Waiting requests beyond which new ones get 429 at once."""
    max_concurrency: int = 0
    """Requests admitted (waiting or running) at once; 0: bounded by max_queue_depth only."""
    default_timeout_ms: float = 0.0
    """Deadline for requests that set none; 0: none."""
    priority_aging_ms: float = 1000.0
    warmup: bool = True
    cache: bool = True
    """Cache this model's responses (the server-wide [cache] must be enabled too)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Runtime-specific options, validated by the runtime at load."""
    variant: str = "fp32"
    """ONNX models: which file serves: fp32 (the original), auto (the variant `sokuji
    optimize` recommended), or a variant's name (int8, ...)."""


@dataclass(frozen=True)
class ApiKey:
    key: str
    tenant: str
    models: tuple[str, ...] = ()
    """Models this tenant may use; empty: all."""
    priority: str = "interactive"
    """Default priority class of this tenant's requests: interactive | batch."""
    max_priority: str = "interactive"
    """The highest class this tenant's requests may ask for (``batch``: a priority header or
    parameter cannot lift them to interactive)."""
    admin: bool = False
    """May read /metrics (when ``metrics_require_key``) and every model's statistics."""
    callback_secret: str = ""
    """HMAC key signing this tenant's job callbacks; empty: ``jobs.callback_secret``."""
    max_pending_jobs: int = 0
    """Unfinished jobs this tenant may have at once; 0: ``jobs.max_pending_per_tenant``."""

    def __repr__(self) -> str:  # keys and secrets never reach logs or tracebacks
        return f"ApiKey(tenant={self.tenant!r}, models={self.models!r})"


@dataclass(frozen=True)
class CacheConfig:
    enabled: bool = True
    backend: str = "memory"
    """memory (in process, LRU) | redis (shared between replicas)"""
    max_bytes: int = 64 * 1024 * 1024
    ttl_s: float = 300.0
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_timeout_s: float = 0.1
    """A Redis call slower than this counts as a miss (and a cache error), never a failure."""


@dataclass(frozen=True)
class JobsConfig:
    enabled: bool = True
    backend: str = "sqlite"
    """sqlite (one server) | redis (replicas share their jobs)"""
    redis_url: str = "redis://127.0.0.1:6379/0"
    path: str = ""
    """SQLite file; default: <cache_dir>/jobs.sqlite"""
    concurrency: int = 16
    """Jobs run at once (they are batched together like any other requests)."""
    redis_timeout_s: float = 2.0
    result_ttl_s: float = 86400.0
    """Finished jobs (and their results) are deleted this long after they finish."""
    max_pending_per_tenant: int = 1000
    """Queued or running jobs one tenant may have; beyond it, submissions get 429."""
    max_attempts: int = 5
    """Runs of a job whose answer was transient (429, 503, 504) before that answer is final."""
    callback_allow: tuple[str, ...] = ()
    """Hosts or CIDR networks callbacks may reach even though they are loopback, private,
    link-local or reserved (refused otherwise, after DNS resolution)."""
    callback_secret: str = ""
    """HMAC key for callbacks of tenants without their own; empty: a random key kept in
    <cache_dir>/callback_secret."""
    callback_timeout_s: float = 10.0


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    cache_dir: str = str(Path.home() / ".cache" / "sokuji")
    max_request_bytes: int = 4 * 1024 * 1024
    log_level: str = "info"
    shutdown_drain_s: float = 0.0
    """On SIGTERM: seconds between readiness turning false and the listener closing."""
    shutdown_grace_s: float = 30.0
    """Then: the most seconds in-flight requests get to finish."""
    models: tuple[ModelConfig, ...] = (
        ModelConfig(name=DEFAULT_MODEL_NAME),
        ModelConfig(name=DEFAULT_LLM_NAME, runtime="llama", max_queue_depth=256, cache=False))
    api_keys: tuple[ApiKey, ...] = ()
    cache: CacheConfig = CacheConfig()
    jobs: JobsConfig = JobsConfig()
    metrics_require_key: bool = False
    """/metrics needs an API key marked ``admin`` (when keys are configured)."""
    models_require_key: bool = True
    """/v1/models needs an API key and lists only the caller's models (when keys are
    configured)."""

    @property
    def jobs_path(self) -> str:
        return self.jobs.path or str(Path(self.cache_dir) / "jobs.sqlite")

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)


_SERVER_SCALARS = {"host": str, "port": int, "cache_dir": str, "max_request_bytes": int,
                   "log_level": str, "shutdown_drain_s": float, "shutdown_grace_s": float,
                   "metrics_require_key": bool, "models_require_key": bool}
_LOG_LEVELS = {"critical", "error", "warning", "info", "debug", "trace"}


def _coerce(key: str, value: object, kind: type) -> Any:
    """Turn a file or environment value into ``kind``, naming the key on failure."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in {"1", "true", "yes", "on", "0", "false",
                                                        "no", "off"}:
            return value.lower() in {"1", "true", "yes", "on"}
        raise ConfigError.for_key(key, value, "not a valid bool")
    if kind is int:
        if isinstance(value, bool):
            raise ConfigError.for_key(key, value, "not a valid integer")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError.for_key(key, value, "not a valid integer")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError.for_key(key, value, "not a valid number")
    if kind is str:
        if isinstance(value, str):
            return value
        raise ConfigError.for_key(key, value, "not a string")
    raise AssertionError(kind)


_MODEL_KINDS: dict[str, type] = {
    "name": str, "runtime": str, "path": str, "tokenizer": str, "version": str,
    "max_batch_size": int, "max_batch_tokens": int, "max_queue_delay_ms": float,
    "batching": str, "instances": int, "intra_op_threads": int, "max_sequence_length": int,
    "warmup": bool, "max_queue_depth": int, "max_concurrency": int,
    "default_timeout_ms": float, "priority_aging_ms": float, "cache": bool, "variant": str,
}
RUNTIMES = ("onnx", "synthetic", "llama")


def _model_from_mapping(index: int, raw: Mapping[str, Any]) -> ModelConfig:
    prefix = f"models[{index}]"
    if not isinstance(raw, Mapping):
        raise ConfigError.for_key(prefix, raw, "each model must be a table")
    known = {f.name for f in fields(ModelConfig)}
    for key in raw:
        if key not in known:
            raise ConfigError.for_key(f"{prefix}.{key}", raw[key], "unknown key")
    if "name" not in raw:
        raise ConfigError.for_key(f"{prefix}.name", None, "every model needs a name")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "options":
            if not isinstance(value, Mapping):
                raise ConfigError.for_key(f"{prefix}.options", value, "must be a table")
            values[key] = dict(value)
        else:
            values[key] = _coerce(f"{prefix}.{key}", value, _MODEL_KINDS[key])
    if "batching" in values:
        try:
            values["batching"] = BatchPolicy(values["batching"])
        except ValueError:
            raise ConfigError.for_key(f"{prefix}.batching", values["batching"],
                                      "must be one of: length, fifo") from None
    return ModelConfig(**values)


def _validate_model(index: int, m: ModelConfig) -> None:
    prefix = f"models[{index}]"
    if not m.name or "/" in m.name:
        raise ConfigError.for_key(f"{prefix}.name", m.name, "must be non-empty, without '/'")
    if m.runtime not in RUNTIMES:
        raise ConfigError.for_key(f"{prefix}.runtime", m.runtime,
                                  f"must be one of: {', '.join(RUNTIMES)}")
    positive = {"max_batch_size": m.max_batch_size, "max_batch_tokens": m.max_batch_tokens,
                "instances": m.instances, "max_sequence_length": m.max_sequence_length,
                "max_queue_depth": m.max_queue_depth}
    for key, value in positive.items():
        if value < 1:
            raise ConfigError.for_key(f"{prefix}.{key}", value, "must be at least 1")
    if m.max_queue_delay_ms < 0:
        raise ConfigError.for_key(f"{prefix}.max_queue_delay_ms", m.max_queue_delay_ms,
                                  "must be zero or more")
    for key in ("max_concurrency", "default_timeout_ms", "priority_aging_ms"):
        if getattr(m, key) < 0:
            raise ConfigError.for_key(f"{prefix}.{key}", getattr(m, key), "must be zero or more")
    if m.intra_op_threads < 0:
        raise ConfigError.for_key(f"{prefix}.intra_op_threads", m.intra_op_threads,
                                  "must be zero (auto) or more")
    if m.runtime == "onnx" and m.path is None and m.name != DEFAULT_MODEL_NAME:
        raise ConfigError.for_key(f"{prefix}.path", None,
                                  "an onnx model other than the built-in minilm needs a path")
    if m.variant != "fp32" and m.runtime != "onnx":
        raise ConfigError.for_key(f"{prefix}.variant", m.variant, "variants are for onnx models")
    if m.variant != "auto" and not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,31}", m.variant):
        raise ConfigError.for_key(f"{prefix}.variant", m.variant,
                                  "must be auto, fp32 or a variant name (int8, ...)")
    if m.path is not None and m.runtime in ("onnx", "llama") and not Path(m.path).is_file():
        raise ConfigError.for_key(f"{prefix}.path", m.path, "no such file")


_API_KEY_FIELDS = {"key", "tenant", "models", "priority", "max_priority", "admin",
                   "callback_secret", "max_pending_jobs"}


def _api_keys(raw: Any) -> tuple[ApiKey, ...]:
    if not isinstance(raw, list):
        raise ConfigError.for_key("api_keys", "...", "must be an array of tables")
    keys = []
    for i, entry in enumerate(raw):
        where = f"api_keys[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError.for_key(where, "...", "must be a table")
        for k in entry:
            if k not in _API_KEY_FIELDS:
                raise ConfigError.for_key(f"{where}.{k}", entry[k], "unknown key")
        key, tenant = entry.get("key"), entry.get("tenant")
        if not isinstance(key, str) or len(key) < 8:
            # The value itself is never echoed: it is a secret.
            raise ConfigError(f"Config '{where}.key' must be a string of at least 8 characters",
                              param=f"{where}.key")
        if not isinstance(tenant, str) or not tenant:
            raise ConfigError.for_key(f"{where}.tenant", tenant, "must be a non-empty string")
        models = entry.get("models", [])
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise ConfigError.for_key(f"{where}.models", models, "must be a list of names")
        extra: dict[str, Any] = {}
        for name in ("priority", "max_priority"):
            value = entry.get(name, "interactive")
            if value not in ("interactive", "batch"):
                raise ConfigError.for_key(f"{where}.{name}", value,
                                          "must be interactive or batch")
            extra[name] = value
        if extra["priority"] == "interactive" and extra["max_priority"] == "batch":
            extra["priority"] = "batch"  # the default class stays under the ceiling
        if "admin" in entry:
            extra["admin"] = _coerce(f"{where}.admin", entry["admin"], bool)
        if "max_pending_jobs" in entry:
            extra["max_pending_jobs"] = _coerce(f"{where}.max_pending_jobs",
                                                entry["max_pending_jobs"], int)
            if extra["max_pending_jobs"] < 0:
                raise ConfigError.for_key(f"{where}.max_pending_jobs",
                                          extra["max_pending_jobs"], "must be zero or more")
        secret = entry.get("callback_secret", "")
        if not isinstance(secret, str) or (secret and len(secret) < 16):
            raise ConfigError(f"Config '{where}.callback_secret' must be a string of at least "
                              "16 characters", param=f"{where}.callback_secret")
        keys.append(ApiKey(key=key, tenant=tenant, models=tuple(models),
                           callback_secret=secret, **extra))
    return tuple(keys)


def _table(name: str, raw: Any, cls: Any, kinds: dict[str, type]) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError.for_key(name, raw, "must be a table")
    values = {}
    for k, v in raw.items():
        if k not in kinds:
            raise ConfigError.for_key(f"{name}.{k}", v, "unknown key")
        if kinds[k] is tuple:
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise ConfigError.for_key(f"{name}.{k}", v, "must be a list of strings")
            values[k] = tuple(v)
        else:
            values[k] = _coerce(f"{name}.{k}", v, kinds[k])
    return cls(**values)


def _cache(raw: Any) -> CacheConfig:
    return _table("cache", raw, CacheConfig, {"enabled": bool, "backend": str,
                                               "max_bytes": int, "ttl_s": float,
                                               "redis_url": str, "redis_timeout_s": float})


def _allow_entry(entry: str) -> None:
    """A callback allowlist entry is a CIDR network, an IP address or a host name."""
    import ipaddress

    if "/" in entry or entry.replace(".", "").isdigit() or ":" in entry:
        ipaddress.ip_network(entry, strict=False)
    elif not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})", entry):
        raise ValueError("must be a host name, an IP address or a CIDR network")


def validate(config: ServerConfig) -> ServerConfig:
    """Check every value; return the config unchanged or raise ``ConfigError``."""
    if not 0 <= config.port <= 65535:
        raise ConfigError.for_key("port", config.port, "must be between 0 and 65535")
    if config.max_request_bytes < 1024:
        raise ConfigError.for_key("max_request_bytes", config.max_request_bytes,
                                  "must be at least 1024")
    if config.log_level not in _LOG_LEVELS:
        raise ConfigError.for_key("log_level", config.log_level,
                                  f"must be one of: {', '.join(sorted(_LOG_LEVELS))}")
    if not config.models:
        raise ConfigError.for_key("models", [], "at least one model is needed")
    for key in ("shutdown_drain_s", "shutdown_grace_s"):
        if getattr(config, key) < 0:
            raise ConfigError.for_key(key, getattr(config, key), "must be zero or more")
    seen: set[str] = set()
    for i, m in enumerate(config.models):
        _validate_model(i, m)
        if m.name in seen:
            raise ConfigError.for_key(f"models[{i}].name", m.name, "duplicate model name")
        seen.add(m.name)
    if len({k.key for k in config.api_keys}) != len(config.api_keys):
        raise ConfigError("Config 'api_keys': the same key is listed twice", param="api_keys")
    for i, k in enumerate(config.api_keys):
        for name in k.models:
            if name not in seen:
                raise ConfigError.for_key(f"api_keys[{i}].models", name, "no such model")
    if config.jobs.backend not in ("sqlite", "redis"):
        raise ConfigError.for_key("jobs.backend", config.jobs.backend, "must be sqlite or redis")
    j = config.jobs
    for key in ("concurrency", "max_pending_per_tenant", "max_attempts"):
        if getattr(j, key) < 1:
            raise ConfigError.for_key(f"jobs.{key}", getattr(j, key), "must be at least 1")
    for key in ("redis_timeout_s", "result_ttl_s", "callback_timeout_s"):
        if getattr(j, key) <= 0:
            raise ConfigError.for_key(f"jobs.{key}", getattr(j, key), "must be more than zero")
    if j.callback_secret and len(j.callback_secret) < 16:
        raise ConfigError("Config 'jobs.callback_secret' must be at least 16 characters",
                          param="jobs.callback_secret")
    for entry in j.callback_allow:
        try:
            _allow_entry(entry)
        except ValueError as exc:
            raise ConfigError.for_key("jobs.callback_allow", entry, str(exc)) from None
    c = config.cache
    if c.backend not in ("memory", "redis"):
        raise ConfigError.for_key("cache.backend", c.backend, "must be memory or redis")
    if c.redis_timeout_s <= 0:
        raise ConfigError.for_key("cache.redis_timeout_s", c.redis_timeout_s,
                                  "must be more than zero")
    if c.max_bytes < 0 or c.ttl_s <= 0:
        raise ConfigError.for_key("cache.ttl_s" if c.ttl_s <= 0 else "cache.max_bytes",
                                  c.ttl_s if c.ttl_s <= 0 else c.max_bytes, "out of range")
    return config


def load(path: str | Path | None = None, env: Mapping[str, str] | None = None,
         overrides: Mapping[str, Any] | None = None) -> ServerConfig:
    """Build the config from file, environment and CLI overrides, then validate it."""
    env = os.environ if env is None else env
    path = path if path is not None else env.get(f"{ENV_PREFIX}CONFIG")
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError.for_key("config", str(path), "no such file") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError.for_key("config", str(path), f"not valid TOML: {exc}") from None
    tables = {"models", "api_keys", "cache", "jobs"}
    for key in raw:
        if key not in _SERVER_SCALARS and key not in tables:
            raise ConfigError.for_key(key, raw[key], "unknown key")
    values: dict[str, Any] = {k: _coerce(k, v, _SERVER_SCALARS[k])
                              for k, v in raw.items() if k not in tables}
    if "api_keys" in raw:
        values["api_keys"] = _api_keys(raw["api_keys"])
    if "cache" in raw:
        values["cache"] = _cache(raw["cache"])
    if "jobs" in raw:
        values["jobs"] = _table("jobs", raw["jobs"], JobsConfig,
                                {"enabled": bool, "backend": str, "redis_url": str,
                                 "path": str, "concurrency": int, "redis_timeout_s": float,
                                 "result_ttl_s": float, "max_pending_per_tenant": int,
                                 "max_attempts": int, "callback_allow": tuple,
                                 "callback_secret": str, "callback_timeout_s": float})
    for key, kind in _SERVER_SCALARS.items():
        env_value = env.get(f"{ENV_PREFIX}{key.upper()}")
        if env_value is not None:
            values[key] = _coerce(f"{ENV_PREFIX}{key.upper()}", env_value, kind)
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = _coerce(key, value, _SERVER_SCALARS[key])
    config = ServerConfig(**values)
    if "models" in raw:
        if not isinstance(raw["models"], list):
            raise ConfigError.for_key("models", raw["models"], "must be an array of tables")
        config = replace(config, models=tuple(
            _model_from_mapping(i, m) for i, m in enumerate(raw["models"])))
    return validate(config)
