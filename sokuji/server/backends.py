"""The stores behind the server, built from the config: the response cache (memory or
Redis) and the job store (SQLite or Redis)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

from sokuji.config import ServerConfig
from sokuji.core.cache import ResponseCache
from sokuji.errors import ConfigError
from sokuji.observability.metrics import Metrics


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (``redis://:pw@h/0`` ->
    ``redis://:***@h/0``; also ``?password=`` in the query, which redis-py honours), safe
    for errors and logs. A URL that cannot be parsed is replaced whole (it might still hold a
    secret)."""
    try:
        parts = urlsplit(url)
        netloc, query = parts.netloc, parts.query
        if parts.password is not None:
            netloc = f"{parts.username or ''}:***@{netloc.rpartition('@')[2]}"
        if query:
            query = "&".join(
                f"{k}=***" if k.lower() in _SECRET_PARAMS else f"{k}={v}" if sep else k
                for k, sep, v in (item.partition("=") for item in query.split("&")))
        if (netloc, query) == (parts.netloc, parts.query):
            return url
        return urlunsplit(parts._replace(netloc=netloc, query=query))
    except ValueError:
        return "<unparsable URL>"


_SECRET_PARAMS = {"password", "passwd", "pass", "token", "secret"}


def build_cache(config: ServerConfig, metrics: Metrics) -> ResponseCache | None:
    """The response cache, or None when no model uses one. A Redis backend that fails later
    degrades to misses (see ``sokuji.core.cache``); whether it answers at all is checked by
    the server's start-up (``ping``)."""
    c = config.cache
    if not c.enabled or not any(m.cache for m in config.models):
        return None
    if c.backend == "redis":
        from sokuji.stores.cache_redis import RedisBackend

        try:
            backend: Any = RedisBackend(c.redis_url, c.ttl_s, c.redis_timeout_s)
        except ValueError as exc:  # redis-py's verdict on the URL (scheme, port, db)
            raise ConfigError.for_key("cache.redis_url", redact_url(c.redis_url),
                                      str(exc)) from None
    else:
        from sokuji.stores.cache_memory import MemoryBackend

        backend = MemoryBackend(c.max_bytes, c.ttl_s)
    for op in ("get", "set"):
        metrics.cache_errors.labels(op)  # exported as 0 from the start, so rate() works
    from sokuji.core.cache import Breaker

    return ResponseCache(backend, on_result=metrics.cache_result, on_error=metrics.cache_error,
                         breaker=Breaker(c.breaker_failures, c.breaker_cooldown_s))


def job_store(config: ServerConfig) -> Any:
    """The job store the config asks for (a ``JobStoreProtocol``). A Redis store that cannot
    be reached stops start-up with a ConfigError that never shows the URL's password."""
    j = config.jobs
    if j.backend == "redis":
        import redis

        from sokuji.stores.jobs_redis import RedisJobStore

        try:
            return RedisJobStore(j.redis_url, timeout_s=j.redis_timeout_s,
                                 result_ttl_s=j.result_ttl_s)
        except (ValueError, OSError, redis.RedisError) as exc:  # a bad URL, no connection
            reason = str(exc)
            password = _password(j.redis_url)
            if password:  # a driver may echo what it was given
                reason = reason.replace(password, "***")
            raise ConfigError.for_key("jobs.redis_url", redact_url(j.redis_url),
                                      f"cannot reach Redis: {type(exc).__name__}: {reason}"
                                      ) from None
    from sokuji.stores.jobs_sqlite import JobStore

    return JobStore(config.jobs_path, result_ttl_s=j.result_ttl_s)


def _password(url: str) -> str | None:
    try:
        return urlsplit(url).password
    except ValueError:
        return None
