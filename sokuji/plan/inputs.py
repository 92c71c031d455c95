"""What ``sokuji plan`` reads: ``sokuji bench`` results and, optionally, the server's own view.

A bench result (schema ``sokuji.bench/1``) becomes one ``Run`` per measured load: the run
itself, or every step of a ``--sweep`` (a step keeps its summary; only the last step has
samples). The server's view (``--stats``) comes from a running Sokuji or Triton (``GET
/v2/models/{m}/config`` and ``/stats``) or from a file holding either reply: the batcher's
settings (``max_batch_size``, the queue bound, instances) and the batch sizes it ran.

Anything missing or malformed is a ``ConfigError`` naming the file and the field: the CLI
prints it and exits 2.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sokuji import http_client
from sokuji.errors import ConfigError

SCHEMA = "sokuji.bench/1"  # sokuji.bench.report.SCHEMA, without importing matplotlib's users
STREAMING_TARGETS = ("openai-completions", "openai-chat")
MAX_STATS_BYTES = 64 * 1024 * 1024
"""The most a server's ``/config`` or ``/stats`` answer may be."""


@dataclass(frozen=True)
class Run:
    """One measured load, as the planner reads it."""

    source: str
    mode: str
    """closed | open"""
    concurrency: int | None
    rate: float | None
    arrivals: str
    burstiness: float
    throughput_rps: float
    offered_rps: float
    sent: int
    ok: int
    errors: dict[str, int]
    latency_ms: dict[str, float]
    stages_ms: dict[str, float] | None
    """Mean server time per ``Server-Timing`` stage (no ``total``), or None."""
    tail_stages_ms: dict[str, float] | None
    """The same over the slowest 1% of requests (latency >= p99)."""
    tail_latency_ms: float | None
    """The slowest 1%'s mean latency."""
    samples_ms: np.ndarray
    """Latencies of successful requests (empty for a sweep's earlier steps)."""
    model: str
    target: str
    dataset: str
    streaming: bool
    ttft_ms: dict[str, float] | None = None
    itl_ms: dict[str, float] | None = None
    tpot_ms: dict[str, float] | None = None
    output_tokens: int = 0
    output_tokens_per_s: float = 0.0
    rss_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        load = f"c={self.concurrency}" if self.mode == "closed" else f"{self.rate:g} req/s"
        return f"{Path(self.source).name} ({load})"

    @property
    def refused(self) -> int:
        return int(self.errors.get("http_429", 0))

    @property
    def server_bound(self) -> bool:
        """Its throughput says what the server can do: a closed loop of more than one
        client, or an open loop the server could not keep up with (refusals, or answers
        well short of the offered rate)."""
        if self.mode == "closed":
            return (self.concurrency or 1) > 1
        return self.refused > 0 or self.throughput_rps < 0.9 * self.offered_rps

    @property
    def tokens_per_request(self) -> float:
        return self.output_tokens / self.ok if self.ok else 0.0


def _need(doc: dict[str, Any], key: str, where: str, kind: type | tuple[type, ...]) -> Any:
    if key not in doc or doc[key] is None:
        raise ConfigError(f"{where}: missing field '{key}'", param=key)
    value = doc[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ConfigError(f"{where}: field '{key}' has the wrong type "
                          f"({type(value).__name__})", param=key)
    return value


def _number(doc: dict[str, Any], key: str, where: str, *, minimum: float = 0.0) -> float:
    value = float(_need(doc, key, where, (int, float)))
    if not math.isfinite(value) or value < minimum:
        raise ConfigError(f"{where}: field '{key}' must be a number >= {minimum:g}, got "
                          f"{value!r}", param=key)
    return value


def _latency(block: Any, where: str) -> dict[str, float]:
    if not isinstance(block, dict):
        raise ConfigError(f"{where}: no latency figures (did every request fail?)")
    for key in ("mean", "p50", "p99"):
        _number(block, key, where)
    return {k: float(v) for k, v in block.items() if isinstance(v, (int, float))}


def _run(source: str, config: dict[str, Any], summary: dict[str, Any], where: str,
         rate: float | None, samples: list[float], extra: dict[str, Any]) -> Run:
    requests = _need(summary, "requests", where, dict)
    mode = str(_need(summary, "mode", where, str))
    if mode not in ("open", "closed"):
        raise ConfigError(f"{where}: field 'mode' must be open or closed, got {mode!r}")
    concurrency = None
    if mode == "closed":
        concurrency = int(_number(config, "concurrency", f"{source}: config", minimum=1))
    elif rate is None:
        rate = _number(config, "rate", f"{source}: config")
    if rate is not None and rate <= 0:
        raise ConfigError(f"{where}: the offered rate must be > 0, got {rate!r}")
    attribution = summary.get("stages") or {}
    stages, tail = attribution.get("mean_ms"), attribution.get("tail_mean_ms")
    tail_latency = None
    for name, share in (attribution.get("tail_share") or {}).items():
        if share and tail and tail.get(name):  # share = the stage's time / the tail's latency
            tail_latency = float(tail[name]) / float(share)
            break
    target = str(config.get("target", "v2"))
    streaming = target in STREAMING_TARGETS or bool(summary.get("ttft_ms"))
    errors = requests.get("errors") or {}
    return Run(
        source=source, mode=mode, concurrency=concurrency, rate=rate,
        arrivals=str(config.get("arrivals", "poisson")),
        burstiness=float(config.get("burstiness") or 1.0),
        throughput_rps=_number(summary, "throughput_rps", where),
        offered_rps=float(summary.get("offered_rps") or rate or 0.0),
        sent=int(_number(requests, "sent", f"{where}.requests")),
        ok=int(_number(requests, "ok", f"{where}.requests")),
        errors={str(k): int(v) for k, v in errors.items()},
        latency_ms=_latency(summary.get("latency_ms"), f"{where}.latency_ms"),
        stages_ms={str(k): float(v) for k, v in stages.items()} if stages else None,
        tail_stages_ms={str(k): float(v) for k, v in tail.items()} if tail else None,
        tail_latency_ms=tail_latency,
        samples_ms=np.asarray(samples, dtype=np.float64),
        model=str(config.get("model", "")), target=target,
        dataset=str(config.get("dataset", "")), streaming=streaming,
        ttft_ms=summary.get("ttft_ms") or None, itl_ms=summary.get("itl_ms") or None,
        tpot_ms=summary.get("tpot_ms") or None,
        output_tokens=int(summary.get("output_tokens") or 0),
        output_tokens_per_s=float(summary.get("output_tokens_per_s") or 0.0),
        rss_bytes=extra.get("rss_bytes"), extra=extra)


def load_bench(path: str) -> list[Run]:
    """Every measured load in one ``sokuji bench`` JSON result."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise ConfigError(f"{path}: not a {SCHEMA} result (schema: {found!r}); write one "
                          "with `sokuji bench ... --out FILE`")
    config = _need(doc, "config", path, dict)
    summary = _need(doc, "summary", path, dict)
    samples = (doc.get("samples") or {}).get("latency_ms") or []
    server = doc.get("server")
    extra = {"rss_bytes": int(server["rss_bytes"])} \
        if isinstance(server, dict) and server.get("rss_bytes") else {}
    sweep = doc.get("sweep")
    if isinstance(sweep, dict) and sweep.get("steps"):
        runs = []
        steps = sweep["steps"]
        for n, step in enumerate(steps):
            where = f"{path}: sweep step {n + 1}"
            if not isinstance(step, dict):
                raise ConfigError(f"{where}: not an object")
            rate = _number(step, "rate", where)
            runs.append(_run(path, config, _need(step, "summary", where, dict), where, rate,
                             samples if n == len(steps) - 1 else [], extra))
        return runs
    return [_run(path, config, summary, f"{path}: summary", None, samples, extra)]


# --- the server's own view ------------------------------------------------------------------

@dataclass(frozen=True)
class ServerInfo:
    """The batcher's settings and what it ran, from ``/config`` and ``/stats``."""

    source: str
    max_batch_size: int | None = None
    queue_depth: int | None = None
    instances: int | None = None
    max_batch_tokens: int | None = None
    batch_counts: dict[int, int] = field(default_factory=dict)
    executions: int = 0
    inferences: int = 0

    @property
    def mean_batch(self) -> float | None:
        return self.inferences / self.executions if self.executions else None


def _get_json(url: str, headers: dict[str, str]) -> Any:
    """The JSON answer to GET ``url`` (redirects are not followed: a 3xx is refused)."""
    try:
        reply = http_client.request("GET", url, headers=headers, timeout_s=10,
                                    max_bytes=MAX_STATS_BYTES)
    except http_client.Unreachable as exc:
        raise ConfigError(f"--stats: GET {url} failed: {exc}") from None
    if not reply.ok:
        raise ConfigError(f"--stats: GET {url} answered {reply.status}"
                          + (" (a key is needed: --header 'Authorization: Bearer ...')"
                             if reply.status in (401, 403) else ""))
    if reply.truncated:
        raise ConfigError(f"--stats: GET {url} answered more than {MAX_STATS_BYTES} bytes")
    try:
        return json.loads(reply.body)
    except ValueError as exc:
        raise ConfigError(f"--stats: GET {url} failed: {exc}") from None


def _from_docs(source: str, model: str, config: dict[str, Any] | None,
               stats: dict[str, Any] | None) -> ServerInfo:
    info: dict[str, Any] = {}
    if config:
        info["max_batch_size"] = int(config["max_batch_size"]) \
            if config.get("max_batch_size") else None
        dyn = config.get("dynamic_batching") or {}
        depth = (dyn.get("default_queue_policy") or {}).get("max_queue_size")
        info["queue_depth"] = int(depth) if depth else None
        groups = config.get("instance_group") or []
        info["instances"] = sum(int(g.get("count", 1)) for g in groups) or None
        tokens = ((config.get("parameters") or {}).get("max_batch_tokens") or {}) \
            .get("string_value")
        info["max_batch_tokens"] = int(tokens) if tokens else None
    if stats:
        entries = stats.get("model_stats") if "model_stats" in stats else [stats]
        mine = [e for e in entries or [] if isinstance(e, dict)
                and (not model or e.get("name") in (model, None))]
        if not mine:
            raise ConfigError(f"{source}: no statistics for model '{model}'")
        e = mine[0]
        info["batch_counts"] = {int(b["batch_size"]): int(b["compute_infer"]["count"])
                                for b in e.get("batch_stats") or []}
        info["executions"] = int(e.get("execution_count") or 0)
        info["inferences"] = int(e.get("inference_count") or 0)
    return ServerInfo(source=source, **info)


def load_stats(source: str, model: str, headers: dict[str, str] | None = None) -> ServerInfo:
    """From a server (``http://host:port``) or a file with its ``/config`` and/or ``/stats``
    reply (or ``{"config": ..., "stats": ...}``)."""
    if source.startswith(("http://", "https://")):
        if not model:
            raise ConfigError("--stats URL: the bench results name no model")
        base = f"{source.rstrip('/')}/v2/models/{model}"
        h = headers or {}
        return _from_docs(source, model, _get_json(f"{base}/config", h),
                          _get_json(f"{base}/stats", h))
    try:
        doc = json.loads(Path(source).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"--stats {source}: cannot read it ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--stats {source}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"--stats {source}: expected a JSON object")
    if "config" in doc or "stats" in doc:
        return _from_docs(source, model, doc.get("config"), doc.get("stats"))
    if "model_stats" in doc or "batch_stats" in doc:
        return _from_docs(source, model, None, doc)
    if "max_batch_size" in doc:
        return _from_docs(source, model, doc, None)
    raise ConfigError(f"--stats {source}: neither a model config nor statistics (expected "
                      "the reply of /v2/models/{m}/config or /stats)")
