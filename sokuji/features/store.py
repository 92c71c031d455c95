"""Online feature lookups through Feast, for a pipeline's feature step.

    cfg = FeatureStoreConfig(path=cache_dir / "features", redis_url=None)
    store = OnlineFeatures.open(cfg)     # blocking: imports Feast, sets the repository up once
    row = store.get("user", "user-0042", ["expertise", "plan"])
    # -> {"expertise": "beginner", "plan": "free"}
    store.close()

``get`` reads through Feast's online store (``online_read``, the interface every Feast online
store implements, reached through Feast's provider: Feast's key encoding, its Redis hashing,
its value types), not through ``FeatureStore.get_online_features``, whose response assembly
costs ~4x more CPU, all of it under the GIL the event loop needs (benchmarks/feature_lookup.py
measures both against a direct read of the row). ``read_path="get_online_features"`` selects
the public call; the tests check both return the same rows.

Contract of ``get``:
- ``entity`` is an entity's name in the registry (``user``); ``features`` are feature names of
  the feature views keyed by that entity alone, bare (``plan``) or qualified (``user_profile:
  plan``; needed when two views share a name). The result's keys are the names as given.
- An unknown entity, feature name or a non-string id: ``InvalidInput`` naming it, checked
  against the registry (read once at open) before Feast is called.
- An entity id the store does not hold gives every feature as ``None`` (Feast's behaviour):
  the pipeline decides what that means (a step's fallback value, say).
- The online store cannot be reached or fails (Redis down or too slow, SQLite I/O):
  ``StoreUnavailable`` (503, Retry-After); the address goes to the log, not the message.

Threads: ``get`` may be called from many threads at once. The default path shares only
objects read at open (the feature views, Feast's config and online store); the public path
also reads Feast's registry cache, under the registry's own lock, never refreshed here (TTL 0,
cache mode ``thread``: no file ``stat`` per call). The SQLite online store shares one
connection opened with ``check_same_thread=False`` (Python's sqlite3 here is built serialized,
``threadsafety == 3``: SQLite serialises the calls on it); the Redis one shares a redis-py
client whose pool gives each thread its own connection. Both are opened lazily by Feast
without a lock, so ``open`` makes the first read itself, before any thread. More threads add
no throughput (the read is Python under the GIL; SQLite's shared connection even loses some):
a pool of 1-2 threads is enough.
"""

from __future__ import annotations

import logging
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sokuji.errors import ConfigError, InvalidInput, StoreUnavailable
from sokuji.features.setup import SetupReport, ensure_ready
from sokuji.features.store_config import FeatureStoreConfig, redis_parts

log = logging.getLogger(__name__)
_MAX_RESOLVED = 1024  # distinct (entity, features) requests remembered; a pipeline has few


@dataclass(frozen=True)
class _Plan:
    """A validated request: the join key, the refs ("view:feature") in the caller's order,
    and the reads (feature view, its feature names) they need."""

    join_key: str
    refs: tuple[str, ...]
    reads: tuple[tuple[Any, tuple[str, ...]], ...]


def _repo_config(cfg: FeatureStoreConfig) -> Any:
    from feast.infra.offline_stores.dask import DaskOfflineStoreConfig
    from feast.repo_config import RegistryConfig, RepoConfig

    online: Any
    if cfg.redis_url is None:
        from feast.infra.online_stores.sqlite import SqliteOnlineStoreConfig

        online = SqliteOnlineStoreConfig(path=str(cfg.path / "online.db"))
    else:
        from feast.infra.online_stores.redis import RedisOnlineStoreConfig

        host, port, db, extra = redis_parts(cfg.redis_url)
        params = {"db": str(db), "socket_timeout": str(cfg.timeout_s),
                  "socket_connect_timeout": str(cfg.timeout_s), **extra}
        online = RedisOnlineStoreConfig(connection_string=",".join(
            [f"{host}:{port}", *(f"{k}={v}" for k, v in params.items())]))
    return RepoConfig(
        project=cfg.project, provider="local", repo_path=cfg.path,
        registry=RegistryConfig(path=str(cfg.path / f"registry-{cfg.target_id()}.db"),
                                cache_ttl_seconds=0, cache_mode="thread"),
        online_store=online, offline_store=DaskOfflineStoreConfig(),
        entity_key_serialization_version=3)


def _store_errors(cfg: FeatureStoreConfig) -> tuple[type[BaseException], ...]:
    """What the online store's client raises when the store is down or failing."""
    if cfg.redis_url is None:
        return (sqlite3.Error, OSError)
    import redis

    return (redis.exceptions.RedisError, OSError)


def _as_is(fs: Any) -> None:
    pass


def _bound_redis_retries(fs: Any) -> None:
    """redis-py retries 3 times with backoff by default, connecting included (~4 s when nothing
    listens); a lookup has a deadline, so: one retry at once (a stale pooled connection after a
    Redis restart), then the error. Feast creates the client lazily; ``_get_client`` is its
    accessor (the online store has no public one)."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    online_store = fs._get_provider().online_store
    client = online_store._get_client(fs.config.online_store)
    client.set_retry(Retry(NoBackoff(), 1))


class OnlineFeatures:
    """One opened feature store; see the module docstring for ``get``'s contract."""

    def __init__(self, fs: Any, cfg: FeatureStoreConfig, report: SetupReport) -> None:
        from feast import ValueType
        from feast.protos.feast.types.EntityKey_pb2 import EntityKey
        from feast.protos.feast.types.Value_pb2 import Value
        from feast.type_map import feast_value_type_to_python_type

        self._fs = fs
        self._cfg = cfg
        self.setup = report
        self._errors = _store_errors(cfg)
        self._closed = False
        self._online_store = fs._get_provider().online_store
        self._entity_key, self._value, self._to_python = (
            EntityKey, Value, feast_value_type_to_python_type)
        # entity -> join key; entity -> {name as callers may write it -> [qualified refs]}
        self._join_keys: dict[str, str] = {}
        self._names: dict[str, dict[str, list[str]]] = {}
        self._views: dict[str, Any] = {}
        self._resolved: dict[tuple[str, tuple[str, ...]], _Plan] = {}
        for entity in fs.list_entities(allow_cache=True):
            if entity.value_type == ValueType.STRING:  # ids arrive as strings
                self._join_keys[entity.name] = entity.join_key
                self._names[entity.name] = {}
        for view in fs.list_feature_views(allow_cache=True):
            if len(view.entities) != 1 or view.entities[0] not in self._names:
                continue  # a view keyed by several entities needs several ids: not served
            self._views[view.name] = view
            names = self._names[view.entities[0]]
            for field in view.features:
                ref = f"{view.name}:{field.name}"
                names.setdefault(field.name, []).append(ref)
                names[ref] = [ref]

    @classmethod
    def open(cls, cfg: FeatureStoreConfig) -> OnlineFeatures:
        """Imports Feast, applies and materializes the repository unless already done (see
        setup.py), returns the store ready for ``get``. Blocking: seconds the first time
        (most of it importing Feast), a few hundred ms later. ``StoreUnavailable`` when the
        online store cannot be reached."""
        target = cfg.target()
        errors = _store_errors(cfg)
        try:
            fs, report = ensure_ready(cfg, lambda: _repo_config(cfg), target,
                                      _bound_redis_retries if cfg.redis_url else _as_is)
        except errors as exc:
            log.warning("feature store %s unavailable at open: %r", target, exc)
            raise StoreUnavailable("the feature store cannot be reached") from exc
        return cls(fs, cfg, report)

    @classmethod
    def from_repo(cls, repo_path: Path) -> OnlineFeatures:
        """A user's own Feast repository (a directory with ``feature_store.yaml``), applied
        and materialized by its owner (``feast apply``, ``feast materialize``), opened as it
        is: its entities, views and online store (SQLite, Redis, ...) come from its config.
        Blocking (imports Feast). ``ConfigError`` when it is not a Feast repository;
        ``StoreUnavailable`` when its online store cannot be reached."""
        import time

        from sokuji.features.setup import import_feast

        repo_path = Path(repo_path).absolute()
        if not (repo_path / "feature_store.yaml").is_file():
            raise ConfigError.for_key("store", str(repo_path),
                                      "not a Feast repository (no feature_store.yaml)")
        t0 = time.perf_counter()
        imported = import_feast()
        import feast

        errors: tuple[type[BaseException], ...] = (sqlite3.Error, OSError)
        try:
            import redis

            errors = (*errors, redis.exceptions.RedisError)
        except ImportError:
            pass
        try:
            fs = feast.FeatureStore(repo_path=str(repo_path))
            report = SetupReport(False, imported, time.perf_counter() - t0, "", repo_path)
            store = cls(fs, FeatureStoreConfig(path=repo_path), report)
        except errors as exc:
            log.warning("feature store %s unavailable at open: %r", repo_path, exc)
            raise StoreUnavailable("the feature store cannot be reached") from exc
        store._errors = errors
        for entity, names in store._names.items():  # the first read, before any thread:
            feature = next((n for n in names if ":" in n), None)  # Feast connects lazily
            if feature is not None:
                store.get(entity, "", [feature])
                break
        return store

    def entities(self) -> dict[str, list[str]]:
        """Entity name -> its feature names (bare and qualified): what ``get`` accepts, for
        validating a pipeline's configuration at start."""
        return {entity: sorted(names) for entity, names in self._names.items()}

    def _resolve(self, entity: str, features: list[str]) -> _Plan:
        key = (entity, tuple(features))
        plan = self._resolved.get(key)
        if plan is not None:
            return plan
        names = self._names.get(entity)
        if names is None:
            raise InvalidInput(f"unknown feature entity '{entity}'; known: "
                               f"{', '.join(sorted(self._names)) or 'none'}", param="entity")
        if not features:
            raise InvalidInput("no features requested", param="features")
        refs = []
        for name in features:
            found = names.get(name)
            if found is None:
                raise InvalidInput(f"unknown feature '{name}' for entity '{entity}'",
                                   param="features")
            if len(found) > 1:
                raise InvalidInput(f"feature '{name}' is ambiguous for entity '{entity}': "
                                   f"name one of {', '.join(found)}", param="features")
            refs.append(found[0])
        by_view: dict[str, list[str]] = {}
        for ref in dict.fromkeys(refs):
            view, _, feature = ref.partition(":")
            by_view.setdefault(view, []).append(feature)
        plan = _Plan(self._join_keys[entity], tuple(refs), tuple(
            (self._views[view], tuple(names)) for view, names in by_view.items()))
        if len(self._resolved) < _MAX_RESOLVED:
            self._resolved[key] = plan
        return plan

    def get(self, entity: str, entity_id: str, features: list[str]) -> dict[str, object]:
        """``{feature: value}`` for one entity id, names as requested; every value ``None``
        when the id is unknown. Blocking (one online store read); thread-safe."""
        plan = self._resolve(entity, list(features))
        if not isinstance(entity_id, str):
            raise InvalidInput(f"the '{entity}' id must be a string, got "
                               f"{type(entity_id).__name__}", param="entity_id")
        if self._closed:
            raise StoreUnavailable("the feature store is closed")
        try:
            if self._cfg.read_path == "online_read":
                values = self._online_read(plan, entity_id)
            else:
                # each ref once: Feast refuses a feature asked twice (a name collision)
                columns = self._fs.get_online_features(
                    features=list(dict.fromkeys(plan.refs)),
                    entity_rows=[{plan.join_key: entity_id}], full_feature_names=True).to_dict()
                values = {ref: columns[ref.replace(":", "__", 1)][0] for ref in plan.refs}
        except self._errors as exc:
            log.warning("feature store %s unavailable: %r", self._cfg.target(), exc)
            raise StoreUnavailable("the feature store cannot be reached") from exc
        return {name: values[ref] for name, ref in zip(features, plan.refs, strict=True)}

    def _online_read(self, plan: _Plan, entity_id: str) -> dict[str, object]:
        """One ``online_read`` per feature view; a row the store lacks (None) or a feature
        missing from it gives None, as Feast's public read does."""
        key = self._entity_key(join_keys=[plan.join_key],
                               entity_values=[self._value(string_val=entity_id)])
        values: dict[str, object] = {}
        for view, names in plan.reads:
            # a fresh list: Feast's Redis store appends its timestamp field to the one it gets
            _, row = self._online_store.online_read(self._fs.config, view, [key], list(names))[0]
            for name in names:
                proto = row.get(name) if row else None
                values[f"{view.name}:{name}"] = None if proto is None else self._to_python(proto)
        return values

    def close(self) -> None:
        """Closes the online store's connection (Feast has no synchronous close: the
        connection is its online store's attribute). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for attr in ("_conn", "_client"):
            conn = getattr(self._online_store, attr, None)
            if conn is not None:
                conn.close()
                setattr(self._online_store, attr, None)
