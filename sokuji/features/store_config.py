"""Where a feature store lives and how its online store is reached (``FeatureStoreConfig``):
what ``store.py`` opens and ``setup.py`` sets up; the Redis URL read as Feast needs it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from sokuji.errors import ConfigError
from sokuji.features import rag_repo

READ_PATHS = ("online_read", "get_online_features")


@dataclass(frozen=True)
class FeatureStoreConfig:
    """Where the feature store lives and how to reach its online store.

    path:       a directory of its own: Feast's registry and the set-up marker (one each per
                online store), the parquet offline source, the SQLite online store (when no
                Redis), the set-up lock.
    redis_url:  ``redis://[user:password@]host:port[/db]`` (``rediss://`` for TLS): the online
                store is Redis instead of SQLite. Keys are Feast's (entity key + project), so
                ``project`` and the db number keep stores apart.
    project:    Feast project name.
    num_users, seed: the generated users of the built-in repository (rag_repo).
    timeout_s:  Redis connect and read timeout; a lookup that fails is retried once at once
                (a pooled connection may be stale after a Redis restart), then 503.
    read_path:  ``online_read`` (default): the online store's own read through Feast's
                provider, values converted by Feast's type map, ~4x less CPU (under the GIL)
                than ``get_online_features``: Feast's public read with its response assembly.
                Both give the same values for the views ``get`` serves (plain feature views:
                Feast applies no TTL or transformation to their online reads).
    """

    path: Path
    redis_url: str | None = None
    project: str = rag_repo.PROJECT
    num_users: int = 300
    seed: int = 13
    timeout_s: float = 0.5
    read_path: str = "online_read"

    def __post_init__(self) -> None:
        # absolute: Feast resolves a relative online store path against the repo path again
        object.__setattr__(self, "path", Path(self.path).expanduser().resolve())
        if self.read_path not in READ_PATHS:
            raise ConfigError.for_key("features.read_path", self.read_path,
                                      f"expected one of {', '.join(READ_PATHS)}")

    def target(self) -> str:
        """The online store as a name without secrets (marker files, logs)."""
        if self.redis_url is None:
            return f"sqlite:{self.path / 'online.db'}"
        host, port, db, _ = redis_parts(self.redis_url)
        return f"redis:{host}:{port}/{db}"

    def target_id(self) -> str:
        """A file-name-safe id of ``target()``: the registry and the set-up marker are kept
        per online store, so one path can serve SQLite and Redis set-ups side by side."""
        return hashlib.sha256(self.target().encode()).hexdigest()[:12]


def redis_parts(url: str) -> tuple[str, int, int, dict[str, str]]:
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise ConfigError.for_key("features.redis_url", url, "expected redis://host:port/db")
    try:
        db = int(parts.path.lstrip("/") or 0)
        port = parts.port or 6379
    except ValueError as exc:
        raise ConfigError.for_key("features.redis_url", url, str(exc)) from None
    extra = {"ssl": "true"} if parts.scheme == "rediss" else {}
    if parts.username:
        extra["username"] = unquote(parts.username)
    if parts.password:
        extra["password"] = unquote(parts.password)
    # Feast's connection string is "host:port,key=value,...": a comma would split a value.
    if any("," in v for v in extra.values()):
        raise ConfigError.for_key("features.redis_url", url, "a ',' in the user or password "
                                  "cannot pass through Feast's Redis connection string")
    return parts.hostname, port, db, extra
