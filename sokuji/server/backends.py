"""The stores behind the server, built from the config: the response cache (memory or
Redis) and the job store (SQLite or Redis)."""

from __future__ import annotations

from typing import Any

from sokuji.config import ServerConfig
from sokuji.core.cache import ResponseCache
from sokuji.errors import ConfigError
from sokuji.observability.metrics import Metrics


def build_cache(config: ServerConfig, metrics: Metrics) -> ResponseCache | None:
    c = config.cache
    if not c.enabled or not any(m.cache for m in config.models):
        return None
    if c.backend == "redis":
        from sokuji.core.cache import RedisBackend

        backend: Any = RedisBackend(c.redis_url, c.ttl_s)
    else:
        from sokuji.core.cache import MemoryBackend

        backend = MemoryBackend(c.max_bytes, c.ttl_s)
    return ResponseCache(backend, on_result=metrics.cache_result)


def job_store(config: ServerConfig) -> Any:
    from sokuji.core import jobs

    if config.jobs.backend == "redis":
        try:
            return jobs.RedisJobStore(config.jobs.redis_url)
        except Exception as exc:  # any connection error: stop start-up, say why
            raise ConfigError.for_key("jobs.redis_url", config.jobs.redis_url,
                                      f"cannot reach Redis: {exc}") from exc
    return jobs.JobStore(config.jobs_path)
