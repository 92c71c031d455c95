"""One typed configuration, declared once as a schema (msgspec), validated once at start-up.

Precedence, lowest first: built-in defaults < TOML file < ``SOKUJI_*`` environment < CLI flags.
Every invalid value stops start-up with a ``ConfigError`` naming the key and the value.

A file looks like::

    host = "127.0.0.1"
    port = 8000
    grpc_port = 8001            # KServe V2 over gRPC; 0: off

    [[models]]
    name = "minilm"
    runtime = "onnx"            # onnx | synthetic | llama (GGUF through llama.cpp)
    max_batch_size = 32
    max_batch_tokens = 8192     # items x padded length
    max_queue_delay_ms = 2.0
    batching = "length"         # length | fifo
    intra_op_threads = 0        # 0: let Sokuji choose

How it works: the classes below are the schema: types, defaults and ranges (``Meta``) in one
place. ``load`` merges file, environment and flags into one mapping and converts it with
``msgspec.convert`` (lax: ``"9000"`` is an int, ``"false"`` a bool, as environment values are
strings); ``config_errors.translate`` turns msgspec's first error into a ``ConfigError``
naming the key as the file (or the environment variable) spells it, the value, and a reason.
``_check`` then checks each model's options against its kind's schema (the same translator)
and what a schema cannot say: relations between fields, files on disk, network names.
Objects are frozen ``msgspec.Struct``s: built in code (tests) without checks, like
dataclasses, and checked by ``validate``. ``msgspec.structs.replace`` copies one with changes.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, field

from sokuji import config_errors
from sokuji.config_ops import SloConfig, TracingConfig
from sokuji.config_scale import RayConfig
from sokuji.config_types import (
    AtLeast1,
    Hosts,
    MoreThanZero,
    Priority,
    Runtime,
    Secret,
    ZeroOrMore,
    ZeroOrMoreS,
    _Table,
    _why,
)
from sokuji.core.forming import BatchPolicy
from sokuji.errors import ConfigError
from sokuji.pipelines.config import PipelineConfig
from sokuji.repository import registry

ENV_PREFIX = "SOKUJI_"
DEFAULT_MODEL_NAME = "minilm"
DEFAULT_LLM_NAME = "smollm2"
DEFAULT_OCR_NAME = "ocr"
DEFAULT_VAD_NAME = "vad"


__all__ = ["BatchPolicy", "ModelConfig", "ServerConfig", "SloConfig", "StreamsConfig",
           "TracingConfig", "load"]


class ModelConfig(_Table, frozen=True):
    name: Annotated[str, _why("must be non-empty, without '/'", pattern=r"\A[^/]+\Z")]
    """The model's name in every route (``/v2/models/{name}``, OpenAI's ``model``)."""
    runtime: Runtime = "onnx"
    """The kind of model (``repository/registry.py``): onnx (a text encoder), synthetic, llama
    (GGUF), ocr (PP-OCR: images -> text lines), vad (silero-vad: audio -> speech segments),
    classifier (labels by nearest centroid over an encoder), upstream (another server), router
    (one of other models per request), or a kind a plug-in registers."""
    path: str | None = None
    """ONNX file (runtime onnx). None for the built-in ``minilm``: exported into the cache."""
    tokenizer: str | None = None
    """tokenizer.json for the onnx runtime; defaults to the built-in MiniLM tokenizer."""
    version: str = "1"
    """The version the V2 routes report (``/v2/models/{name}/versions/{version}``)."""
    max_batch_size: ZeroOrMore = 32
    """Items (texts, rows) one batch holds. 0: the model has no batch dimension (Triton's
    meaning; runtime tensor only): each request runs alone, its shapes as the graph's."""
    max_batch_tokens: AtLeast1 = 8192
    """The most items x padded length one batch holds (text models)."""
    max_queue_delay_ms: ZeroOrMoreS = 2.0
    """The most a request waits for others to batch with while the model is busy (an idle
    model runs a lone request at once)."""
    batching: BatchPolicy = BatchPolicy.LENGTH
    """How a batch is formed: ``length`` (the oldest request, then the queued requests of the
    nearest lengths: less padding) or ``fifo`` (in arrival order)."""
    instances: AtLeast1 = 1
    """Batches that may run at once (each in its own worker thread)."""
    intra_op_threads: Annotated[int, _why("must be zero (auto) or more", ge=0)] = 0
    """ONNX Runtime's threads per batch; 0: Sokuji chooses from the cores and instances."""
    max_sequence_length: AtLeast1 = 256
    """Tokens a text is truncated to (text encoders)."""
    max_queue_depth: AtLeast1 = 1024
    """Waiting requests beyond which new ones get 429 at once."""
    max_concurrency: ZeroOrMore = 0
    """Requests admitted (waiting or running) at once; 0: bounded by max_queue_depth only."""
    default_timeout_ms: ZeroOrMoreS = 0.0
    """Deadline for requests that set none; 0: none."""
    priority_aging_ms: ZeroOrMoreS = 1000.0
    """A ``batch``-priority request waiting this long is served as ``interactive``."""
    inline_max_ms: ZeroOrMoreS = 50.0
    """A request that finds the model idle runs on the event loop thread, without a thread
    hand-off, when requests of its size were measured to take at most this long (the loop
    does nothing else meanwhile); 0: every batch runs in a worker thread."""
    warmup: bool = True
    """Run a few requests at start-up, before the model reports ready."""
    cache: bool = True
    """Cache this model's responses (the server-wide [cache] must be enabled too)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """The kind's own options: checked against its schema when the config loads."""
    max_request_bytes: Annotated[int, Meta(ge=1024)] | None = None
    """This model's request body limit; None: the server's ``max_request_bytes``. Media
    models (images, audio files) need more than text models."""
    variant: Annotated[str, _why("must be auto, fp32 or a variant name (int8, ...)",
                                 pattern=r"\A(auto|[a-z0-9][a-z0-9-]{0,31})\Z")] = "fp32"
    """ONNX models: which file serves: fp32 (the original), auto (the variant `sokuji
    optimize` recommended), or a variant's name (int8, ...)."""
    semantic_cache: Mapping[str, Any] = field(default_factory=dict)
    """Answers to requests asked before in other words (``routing/config.py``
    ``SemanticCacheConfig``); off unless ``enabled = true``."""
    slo: SloConfig | None = None
    """This model's service-level objective (``config_ops.py``): reported, and with
    ``admission`` (the default) requests are admitted by time against it."""




class ApiKey(_Table, frozen=True):
    key: Annotated[str, _why("must be a string of at least 8 characters", min_length=8)]
    tenant: Annotated[str, _why("must be a non-empty string", min_length=1)]
    models: Annotated[tuple[str, ...], _why("must be a list of names")] = ()
    """Models this tenant may use; empty: all."""
    priority: Priority = "interactive"
    """Default priority class of this tenant's requests (never above ``max_priority``)."""
    max_priority: Priority = "interactive"
    """The highest class this tenant's requests may ask for (``batch``: a priority header or
    parameter cannot lift them to interactive)."""
    admin: bool = False
    """May read statistics, and /metrics and the dashboard's data (unless ``metrics_require_key``
    is false): they show every tenant's traffic."""
    callback_secret: Secret = ""
    """HMAC key signing this tenant's job callbacks; empty: ``jobs.callback_secret``."""
    max_pending_jobs: ZeroOrMore = 0
    """Unfinished jobs this tenant may have at once; 0: ``jobs.max_pending_per_tenant``."""
    callback_allow: Hosts = ()
    """Hosts or CIDR networks this key's callbacks may reach although they are internal (in
    addition to ``jobs.callback_allow``, which every tenant may reach)."""

    def __post_init__(self) -> None:
        if self.max_priority == "batch":  # the default class stays under the ceiling
            msgspec.structs.force_setattr(self, "priority", "batch")

    def __repr__(self) -> str:  # keys and secrets never reach logs or tracebacks
        return f"ApiKey(tenant={self.tenant!r}, models={self.models!r})"

    def __rich_repr__(self) -> list[tuple[str, Any]]:  # msgspec's own would show them
        return [("tenant", self.tenant), ("models", self.models)]


class CacheConfig(_Table, frozen=True):
    enabled: bool = True
    backend: Literal["memory", "redis"] = "memory"
    """memory (in process, LRU) | redis (shared between replicas)"""
    max_bytes: ZeroOrMore = 64 * 1024 * 1024
    ttl_s: MoreThanZero = 300.0
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_timeout_s: MoreThanZero = 0.1
    """A Redis call slower than this counts as a miss (and a cache error), never a failure."""
    breaker_failures: AtLeast1 = 5
    """Failures in a row after which the backend is skipped for ``breaker_cooldown_s``."""
    breaker_cooldown_s: MoreThanZero = 5.0


class JobsConfig(_Table, frozen=True):
    enabled: bool = True
    backend: Literal["sqlite", "redis"] = "sqlite"
    """sqlite (one server) | redis (replicas share their jobs)"""
    redis_url: str = "redis://127.0.0.1:6379/0"
    path: str = ""
    """SQLite file; default: <cache_dir>/jobs.sqlite"""
    concurrency: AtLeast1 = 16
    """Jobs run at once (they are batched together like any other requests)."""
    redis_timeout_s: MoreThanZero = 2.0
    result_ttl_s: MoreThanZero = 86400.0
    """Finished jobs (and their results) are deleted this long after they finish."""
    max_pending_per_tenant: AtLeast1 = 1000
    """Queued or running jobs one tenant may have; beyond it, submissions get 429."""
    max_stored_bytes_per_tenant: AtLeast1 = 256 * 1024 * 1024
    """Bytes one tenant may keep in the job store: request bodies of unfinished jobs, results
    of finished ones until they expire; beyond it, submissions get 429."""
    max_attempts: AtLeast1 = 5
    """Runs of a job whose answer was transient (429, 503, 504) before that answer is final."""
    callback_allow: Hosts = ()
    """Hosts or CIDR networks callbacks may reach even though they are loopback, private,
    link-local or reserved (refused otherwise, after DNS resolution)."""
    callback_secret: Secret = ""
    """HMAC key for callbacks of tenants without their own; empty: a random key kept in
    <cache_dir>/callback_secret."""
    callback_timeout_s: MoreThanZero = 10.0


class StreamsConfig(_Table, frozen=True):
    """Bounds of a body streamed in (``Api.STREAM``: ``server/stream.py``). A stream past a
    timeout ends with 408: as its status if none was sent yet, else as its last line."""

    idle_timeout_s: MoreThanZero = 10.0
    """No chunk for this long ends the stream."""
    total_timeout_s: MoreThanZero = 600.0
    """The most a stream may last, from its arrival."""
    max_per_tenant: ZeroOrMore = 0
    """Streams one tenant may have in flight on one model (beyond: 429 at once); 0:
    automatic: with API keys configured, one less than the model's ``max_concurrency`` (at
    least 1; 4 for a model without one), so one tenant's streams never hold every slot; with
    no keys, no cap of its own (every caller is the one tenant)."""


class ServerConfig(_Table, frozen=True):
    host: str = "127.0.0.1"
    """The address HTTP (and gRPC) listen on."""
    port: Annotated[int, _why("must be between 0 and 65535", ge=0, le=65535)] = 8000
    """HTTP's port (REST: KServe V2, OpenAI, the extensions, /metrics, the dashboard)."""
    grpc_port: Annotated[int, _why("must be between 0 and 65535", ge=0, le=65535)] = 8001
    """KServe V2 over gRPC (``inference.GRPCInferenceService``, ``server/grpc_v2.py``) on
    this port of ``host``, beside HTTP, in the same process and event loop (gRPC and REST
    requests share batches); 8001 as Triton's; 0: off. Messages larger than the largest
    ``max_request_bytes`` (the server's or a model's) are refused by gRPC before decoding.
    Needs the ``grpc`` extra (without it: a warning, HTTP only)."""
    cache_dir: str = str(Path.home() / ".cache" / "sokuji")
    """Exported models, jobs, the feature store's SQLite, optimizer variants."""
    max_request_bytes: Annotated[int, Meta(ge=1024)] = 4 * 1024 * 1024
    """The largest request body (413 beyond; a model may set its own)."""
    log_level: Literal["critical", "debug", "error", "info", "trace", "warning"] = "info"
    shutdown_drain_s: ZeroOrMoreS = 0.0
    """On SIGTERM: seconds between readiness turning false and the listener closing."""
    shutdown_grace_s: ZeroOrMoreS = 30.0
    """Then: the most seconds in-flight requests get to finish."""
    repository_poll_s: ZeroOrMoreS = 0.0
    """Every this many seconds, look for models added, changed (config or model file) or
    removed, and load or unload them (Triton's ``--model-control-mode=poll``); 0: only the
    repository extension's explicit load and unload (``repository/control.py``)."""
    models: Annotated[tuple[ModelConfig, ...],
                      _why("must be an array of tables, at least one", min_length=1)] = (
        ModelConfig(name=DEFAULT_MODEL_NAME),
        ModelConfig(name=DEFAULT_LLM_NAME, runtime="llama", max_queue_depth=256, cache=False),
        # A queued image holds its detection input (float32, 6-48 MB): 32 bound the memory.
        ModelConfig(name=DEFAULT_OCR_NAME, runtime="ocr", max_batch_size=8, max_queue_depth=32,
                    max_request_bytes=32 * 1024 * 1024),
        ModelConfig(name=DEFAULT_VAD_NAME, runtime="vad", max_batch_size=8, max_queue_depth=64,
                    max_request_bytes=64 * 1024 * 1024))
    """The models served (``[[models]]``); the built-in ones when the file has none."""
    pipelines: tuple[PipelineConfig, ...] = ()
    """Graphs of steps served as models (``[[pipelines]]``)."""
    model_repository: str = ""
    """A Triton model repository (``<dir>/<model>/config.pbtxt``, ``<model>/<version>/
    model.onnx``): every model in it is served beside ``[[models]]`` (``docs/triton-
    repository.md``), translated when the config loads (``load``; needs the ``repository``
    extra). Without ``[[models]]`` in the file, only the repository's models are served."""
    feature_store_redis_url: str = ""
    """The built-in feature store's online store: SQLite under cache_dir when empty, else
    this Redis."""
    builtin_pipelines: bool = True
    """Serve the built-in ``rag`` pipeline when the built-in ``minilm`` and ``smollm2`` are
    served and the ``pipelines`` extra is installed."""
    api_keys: tuple[ApiKey, ...] = ()
    """Keys, each a tenant (``[[api_keys]]``); none: the server is open."""
    dashboard: bool = True
    """The live dashboard at /dashboard (and its sampler: a point a second); false: neither."""
    slos: tuple[SloConfig, ...] = ()
    """Tenants' SLOs (``tenant`` set, ``model`` optional); a model's own is its ``slo``."""
    tracing: TracingConfig = TracingConfig()
    """OpenTelemetry traces (``[tracing]``)."""
    cache: CacheConfig = CacheConfig()
    """The response cache (``[cache]``): in memory, or a shared Redis."""
    jobs: JobsConfig = JobsConfig()
    """Asynchronous jobs and their callbacks (``[jobs]``)."""
    ray: RayConfig = RayConfig()
    """Scale-out on Ray Serve (``sokuji serve --ray`` only): ``config_scale.py``."""
    metrics_require_key: bool = True
    """When API keys are configured, /metrics and the dashboard's data need a key marked
    ``admin``; false opens both (a scraper on a private network). With no keys the server is
    open whatever this says."""
    allowed_hosts: tuple[str, ...] = ()
    """The names the server answers to in the ``Host`` header (any port): a host name, an IP
    address, ``*.example.com`` (its subdomains) or ``*`` (any). Empty: bound to a loopback
    ``host``, ``localhost``, ``127.0.0.1``, ``::1`` and ``host`` itself (a DNS-rebinding page
    gets 421); bound to any other address, any name (then API keys are the protection).
    ``SOKUJI_ALLOWED_HOSTS``: comma-separated."""
    models_require_key: bool = True
    """/v1/models needs an API key and lists only the caller's models (when keys are
    configured)."""
    body_timeout_s: MoreThanZero = 60.0
    """The most a request body may take to arrive, from when it is read (408 beyond)."""
    body_idle_timeout_s: MoreThanZero = 10.0
    """The most time between two pieces of a request body (408 beyond)."""
    streams: StreamsConfig = StreamsConfig()
    """Bodies streamed in (``Api.STREAM``): their timeouts and per-tenant cap."""

    @property
    def jobs_path(self) -> str:
        return self.jobs.path or str(Path(self.cache_dir) / "jobs.sqlite")

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)


_TABLES = ("models", "pipelines", "api_keys", "cache", "jobs", "slos", "tracing", "ray",
           "streams")
_SCALARS = tuple(k for k in ServerConfig.__struct_fields__ if k not in _TABLES)
"""The top-level keys that ``SOKUJI_<KEY>`` environment variables and CLI flags may set."""
_BOOLS = {k for k in _SCALARS if isinstance(getattr(ServerConfig(), k), bool)}
_LISTS = {"allowed_hosts"}
"""Top-level lists an environment variable or a flag spells comma-separated."""
_WORDS = {"yes": True, "on": True, "no": False, "off": False}  # beside true/false/1/0


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
    names: dict[str, str] = {}  # keys whose value came from the environment: named so
    for key in _SCALARS:
        value = env.get(f"{ENV_PREFIX}{key.upper()}")
        if value is not None:
            raw[key], names[key] = _word(key, value), f"{ENV_PREFIX}{key.upper()}"
    for key, value in (overrides or {}).items():
        if value is not None:
            raw[key] = _word(key, value)
            names.pop(key, None)
    if raw.get("model_repository"):
        from sokuji.repository import triton_translate

        raw["models"] = [*raw.get("models", []),
                         *triton_translate.tables(str(raw["model_repository"]))]
    return _check(_convert(raw, names))


def validate(config: ServerConfig) -> ServerConfig:
    """Check every value of a config built in code (its constructors check nothing); return
    it, as the checked copy that ``load`` would build, or raise ``ConfigError``."""
    return _check(_convert(msgspec.to_builtins(config), {}))


def check_schema(text: str) -> ServerConfig:
    """A TOML text checked against the schema alone: types, ranges, unknown keys and every
    model's ``options`` against its kind's schema, not what needs this machine (files on
    disk, the models a router names). For examples (the docs' TOML blocks are checked so)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError.for_key("config", text[:40], f"not valid TOML: {exc}") from None
    checked = _convert(raw, {})
    for i, model in enumerate(checked.models):
        registry.get(model.runtime, f"models[{i}].runtime").parse(model, f"models[{i}]")
    return checked


def _word(key: str, value: Any) -> Any:
    if key in _BOOLS and isinstance(value, str):
        return _WORDS.get(value.lower(), value)
    if key in _LISTS and isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def _convert(raw: dict[str, Any], names: Mapping[str, str]) -> ServerConfig:
    try:
        return msgspec.convert(raw, ServerConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise config_errors.translate(str(exc), raw, names, ServerConfig,
                                      secret_tables=("api_keys",)) from None


def _check(config: ServerConfig) -> ServerConfig:
    """What the schema cannot say: relations between fields, files, network names; and each
    model's options, by the kind its ``runtime`` names (``repository/registry.py``)."""
    seen: set[str] = set()
    for i, m in enumerate(config.models):
        at = model_key(config, i)
        kind = registry.get(m.runtime, f"{at}.runtime")
        if m.max_batch_size == 0 and not kind.unbatched:
            raise ConfigError.for_key(f"{at}.max_batch_size", 0,
                                      f"must be at least 1 (0, no batch dimension, is for "
                                      f"runtime tensor; runtime {m.runtime} batches)")
        kind.check(m, kind.parse(m, at), at, config)
        if m.name in seen:
            raise ConfigError.for_key(f"{at}.name", m.name, "duplicate model name")
        seen.add(m.name)
    _check_semantic_caches(config)
    for i, p in enumerate(config.pipelines):
        if p.name in seen:
            raise ConfigError.for_key(f"pipelines[{i}].name", p.name,
                                      "a model or pipeline of that name exists")
        seen.add(p.name)
    for i, p in enumerate(config.pipelines):
        kind = registry.table_kind("pipelines")
        m = kind.model_config(p)
        kind.check(m, kind.parse(m, f"pipelines[{i}]"), f"pipelines[{i}]", config)
    # Keys and SLOs may name the built-in pipelines too (rag), served beside these.
    seen.update(p.name for p in registry.table_kind("pipelines").builtins(config))
    if len({k.key for k in config.api_keys}) != len(config.api_keys):
        raise ConfigError("Config 'api_keys': the same key is listed twice", param="api_keys")
    for i, k in enumerate(config.api_keys):
        for name in k.models:
            if name not in seen:
                raise ConfigError.for_key(f"api_keys[{i}].models", name, "no such model")
        _check_hosts(f"api_keys[{i}].callback_allow", k.callback_allow)
    _check_hosts("jobs.callback_allow", config.jobs.callback_allow)
    _check_allowed_hosts(config.allowed_hosts)
    _check_slos(config, seen)
    if config.jobs.max_stored_bytes_per_tenant < config.max_request_bytes:
        raise ConfigError.for_key("jobs.max_stored_bytes_per_tenant",
                                  config.jobs.max_stored_bytes_per_tenant,
                                  f"must be at least max_request_bytes "
                                  f"({config.max_request_bytes})")
    return config


def model_key(config: ServerConfig, i: int) -> str:
    """Where ``models[i]`` sits, as errors name it: ``model_repository.<name>`` for a model of
    the Triton repository (translated at load, with its ``triton_config``)."""
    m = config.models[i]
    if config.model_repository and "triton_config" in m.options:
        return f"model_repository.{m.name}"
    return f"models[{i}]"


def _check_slos(config: ServerConfig, names: set[str]) -> None:
    """A tenant SLO names a tenant (one of the keys', when keys are configured) and, if
    narrowed, a served model; a model's own ``slo`` names neither."""
    tenants = {k.tenant for k in config.api_keys}
    for i, m in enumerate(config.models):
        if m.slo is not None and (m.slo.tenant or m.slo.model):
            raise ConfigError.for_key(f"models[{i}].slo", m.slo.tenant or m.slo.model,
                                      "a model's own slo names no tenant or model; "
                                      "use [[slos]] for a tenant's")
    for i, slo in enumerate(config.slos):
        if not slo.tenant:
            raise ConfigError.for_key(f"slos[{i}].tenant", "",
                                      "is required (a model's SLO goes in its [[models]] "
                                      "entry as slo = {...})")
        if tenants and slo.tenant not in tenants:
            raise ConfigError.for_key(f"slos[{i}].tenant", slo.tenant,
                                      "no API key has this tenant")
        if slo.model and slo.model not in names:
            raise ConfigError.for_key(f"slos[{i}].model", slo.model, "no such model")


def _check_hosts(key: str, entries: tuple[str, ...]) -> None:
    """A callback allowlist entry is a CIDR network, an IP address or a host name."""
    import ipaddress

    for entry in entries:
        try:
            if "/" in entry or entry.replace(".", "").isdigit() or ":" in entry:
                ipaddress.ip_network(entry, strict=False)
            elif not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})", entry):
                raise ValueError("must be a host name, an IP address or a CIDR network")
        except ValueError as exc:
            raise ConfigError.for_key(key, entry, str(exc)) from None


def _check_allowed_hosts(entries: tuple[str, ...]) -> None:
    """An ``allowed_hosts`` entry: ``*``, ``*.`` and a host name, a host name or an IP
    address (an IPv6 one with or without its brackets); no port."""
    import ipaddress

    for i, entry in enumerate(entries):
        name = entry[2:] if entry.startswith("*.") else entry
        if entry == "*" or re.fullmatch(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252})", name):
            continue
        try:
            ipaddress.ip_address(name.removeprefix("[").removesuffix("]"))
        except ValueError:
            raise ConfigError.for_key(
                f"allowed_hosts[{i}]", entry, "must be '*', a host name, '*.' and a host "
                "name, or an IP address (no port)") from None


def _check_semantic_caches(config: ServerConfig) -> None:
    """Semantic caches (``routing/config.py``: pure): their embedder is a configured model."""
    if not any(m.semantic_cache for m in config.models):
        return
    from sokuji.routing import config as routing

    runtimes = {m.name: m.runtime for m in config.models}
    for i, m in enumerate(config.models):
        if m.semantic_cache:
            routing.parse_semantic_cache(m.semantic_cache, f"models[{i}].semantic_cache",
                                         runtimes)
