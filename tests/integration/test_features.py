"""The online feature store on a real Feast: SQLite online store (default) and Redis (the test
Redis from SOKUJI_TEST_REDIS_URL, db 13 so other tests' FLUSHDB of db 0 cannot empty it; and
redis-servers of our own to stop). One store per backend is set up per module: Feast's import
and first set-up take seconds."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sqlite3
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from sokuji.errors import InvalidInput, StoreUnavailable
from sokuji.features import rag_repo
from sokuji.features.store import OnlineFeatures
from sokuji.features.store_config import FeatureStoreConfig
from tests.integration.serving import free_port
from tests.integration.test_cache_redis import Proxy, RedisProcess

# find_spec, not importorskip: importing Feast here would bypass the store's own import
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("feast") is None,
                                 reason="feast is not installed (the pipelines extra)")]

REDIS_URL = os.environ.get("SOKUJI_TEST_REDIS_URL")
needs_redis = pytest.mark.skipif(REDIS_URL is None, reason="SOKUJI_TEST_REDIS_URL not set "
                                 "(make test starts redis-server and sets it)")
needs_redis_server = pytest.mark.skipif(shutil.which("redis-server") is None,
                                        reason="redis-server is not installed")
NAMES = list(rag_repo.FEATURES)
USERS = rag_repo.generate_users(300, 13)


def redis_db13(url: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/13"))


def expected(row: dict[str, object]) -> dict[str, object]:
    return {name: row[name] for name in NAMES}


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OnlineFeatures]:
    store = OnlineFeatures.open(FeatureStoreConfig(path=tmp_path_factory.mktemp("features")))
    yield store
    store.close()


@pytest.fixture(scope="module")
def redis_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OnlineFeatures]:
    import redis

    assert REDIS_URL is not None
    url = redis_db13(REDIS_URL)
    client = redis.Redis.from_url(url)  # this project's keys only: Feast's end in its name
    stale = [k for k in client.scan_iter() if k.endswith(b"sokuji_test_features")]
    if stale:
        client.delete(*stale)
    store = OnlineFeatures.open(FeatureStoreConfig(path=tmp_path_factory.mktemp("features"),
                                                   redis_url=url,
                                                   project="sokuji_test_features"))
    yield store
    store.close()


def test_first_open_sets_up_and_lookups_return_the_generated_values(
        sqlite_store: OnlineFeatures) -> None:
    assert sqlite_store.setup.materialized
    assert sqlite_store.setup.marker.exists()
    for row in (USERS[0], USERS[137], USERS[-1]):
        got = sqlite_store.get("user", str(row["user_id"]), NAMES)
        assert got == expected(row)
    assert isinstance(sqlite_store.get("user", "user-0003", ["questions_asked"])
                      ["questions_asked"], int)


def test_qualified_names_and_the_callers_order_and_keys(sqlite_store: OnlineFeatures) -> None:
    row = USERS[42]
    got = sqlite_store.get("user", "user-0042", ["user_profile:plan", "expertise"])
    assert list(got) == ["user_profile:plan", "expertise"]
    assert got == {"user_profile:plan": row["plan"], "expertise": row["expertise"]}


def test_unknown_user_gives_none_values(sqlite_store: OnlineFeatures) -> None:
    assert sqlite_store.get("user", "nobody-at-all", ["plan", "expertise"]) == \
        {"plan": None, "expertise": None}


@pytest.mark.parametrize("entity, entity_id, features, named", [
    ("customer", "user-0001", ["plan"], "customer"),
    ("user", "user-0001", ["plan", "shoe_size"], "shoe_size"),
    ("user", "user-0001", ["other_view:plan"], "other_view:plan"),
    ("user", "user-0001", [], "no features"),
    ("user", 7, ["plan"], "string"),
])
def test_bad_requests_are_invalid_input_naming_the_culprit(
        sqlite_store: OnlineFeatures, entity: str, entity_id: str, features: list[str],
        named: str) -> None:
    with pytest.raises(InvalidInput) as err:
        sqlite_store.get(entity, entity_id, features)
    assert err.value.status == 400
    assert named in err.value.message


def test_get_from_many_threads_at_once(sqlite_store: OnlineFeatures) -> None:
    """Every thread reads different users; any cross-talk between threads sharing Feast's
    connection would hand a thread another user's row."""
    failures: list[str] = []
    barrier = threading.Barrier(8)

    def reader(offset: int) -> None:
        barrier.wait()
        for i in range(150):
            row = USERS[(offset * 37 + i) % len(USERS)]
            try:
                got = sqlite_store.get("user", str(row["user_id"]), NAMES)
            except Exception as exc:  # noqa: BLE001 (collected and reported below)
                failures.append(repr(exc))
                return
            if got != expected(row):
                failures.append(f"{row['user_id']}: {got}")

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert failures == []


def _tamper_sqlite(path: Path, user: str, feature: str, value: str) -> None:
    """Writes one value straight into Feast's SQLite online table, behind Feast's back."""
    from feast.infra.key_encoding_utils import serialize_entity_key
    from feast.protos.feast.types.EntityKey_pb2 import EntityKey
    from feast.protos.feast.types.Value_pb2 import Value

    key = serialize_entity_key(EntityKey(join_keys=["user_id"],
                                         entity_values=[Value(string_val=user)]),
                               entity_key_serialization_version=3)
    with sqlite3.connect(path / "online.db") as db:
        changed = db.execute(
            f"UPDATE {rag_repo.PROJECT}_{rag_repo.VIEW} SET value = ? "
            "WHERE entity_key = ? AND feature_name = ?",
            (Value(string_val=value).SerializeToString(), key, feature)).rowcount
    assert changed == 1


def test_second_open_keeps_the_store_and_a_data_change_sets_it_up_again(
        tmp_path: Path) -> None:
    cfg = FeatureStoreConfig(path=tmp_path, num_users=50)
    first = OnlineFeatures.open(cfg)
    first.close()
    marker = first.setup.marker.read_text()
    _tamper_sqlite(tmp_path, "user-0010", "plan", "tampered")

    again = OnlineFeatures.open(cfg)
    try:  # not materialized again: the value written behind Feast's back is still there
        assert first.setup.materialized and not again.setup.materialized
        assert again.setup.marker.read_text() == marker
        assert again.get("user", "user-0010", ["plan"]) == {"plan": "tampered"}
    finally:
        again.close()

    changed = OnlineFeatures.open(replace(cfg, seed=14))
    try:
        assert changed.setup.materialized
        new_users = rag_repo.generate_users(50, 14)
        assert changed.get("user", "user-0010", NAMES) == expected(new_users[10])
    finally:
        changed.close()


def test_the_environment_feast_sets_on_import_is_restored(sqlite_store: OnlineFeatures) -> None:
    """feast.metrics sets the prometheus_client multiprocess variables when imported; left
    set, child processes (and metrics created later) would write mmap files (setup.py)."""
    assert "feast.metrics" in sys.modules  # the fixture opened a store in this process
    assert not {"PROMETHEUS_MULTIPROC_DIR", "PROMETHEUS_MULTIPROCESS_DIR"} & set(os.environ)
    from prometheus_client import values

    assert values.ValueClass is values.MutexValue


def test_get_after_close_is_unavailable(tmp_path: Path, sqlite_store: OnlineFeatures) -> None:
    store = OnlineFeatures.open(FeatureStoreConfig(path=tmp_path, num_users=5))
    store.close()
    with pytest.raises(StoreUnavailable):
        store.get("user", "user-0001", ["plan"])


def test_both_read_paths_return_the_same_rows(sqlite_store: OnlineFeatures) -> None:
    """online_read (the default) against Feast's public get_online_features, every user."""
    public = OnlineFeatures.open(replace(sqlite_store._cfg, read_path="get_online_features"))
    try:
        assert not public.setup.materialized
        for uid in [str(row["user_id"]) for row in USERS] + ["nobody-at-all"]:
            for names in (NAMES, ["user_profile:plan", "plan"]):
                assert public.get("user", uid, names) == sqlite_store.get("user", uid, names)
    finally:
        public.close()


@needs_redis
@pytest.mark.parametrize("read_path", ["online_read", "get_online_features"])
def test_redis_returns_the_same_rows_as_sqlite(redis_store: OnlineFeatures,
                                               sqlite_store: OnlineFeatures,
                                               read_path: str) -> None:
    store = OnlineFeatures.open(replace(redis_store._cfg, read_path=read_path))
    try:
        assert redis_store.setup.materialized and not store.setup.materialized
        for uid in [str(row["user_id"]) for row in USERS] + ["nobody-at-all"]:
            assert store.get("user", uid, NAMES) == sqlite_store.get("user", uid, NAMES)
    finally:
        store.close()


@needs_redis
def test_a_flushed_redis_is_set_up_again_at_the_next_open(
        redis_store: OnlineFeatures, tmp_path: Path) -> None:
    import redis

    assert REDIS_URL is not None
    url = redis_db13(REDIS_URL)
    cfg = FeatureStoreConfig(path=tmp_path, redis_url=url, project="sokuji_flush", num_users=20)
    OnlineFeatures.open(cfg).close()
    unchanged = OnlineFeatures.open(cfg)
    unchanged.close()
    assert not unchanged.setup.materialized
    client = redis.Redis.from_url(url)
    client.delete(*[k for k in client.scan_iter() if k.endswith(b"sokuji_flush")])
    again = OnlineFeatures.open(cfg)
    try:
        assert again.setup.materialized
        assert again.get("user", "user-0019", NAMES) == \
            expected(rag_repo.generate_users(20, 13)[19])
    finally:
        again.close()
    # the module's store (another project in the same db) was not touched
    assert redis_store.get("user", "user-0001", ["plan"]) == {"plan": USERS[1]["plan"]}


def test_redis_nobody_listens_is_503_at_open(tmp_path: Path) -> None:
    cfg = FeatureStoreConfig(path=tmp_path, redis_url=f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(StoreUnavailable) as err:
        OnlineFeatures.open(cfg)
    assert err.value.status == 503 and "127.0.0.1" not in err.value.message


@needs_redis_server
def test_redis_down_or_silent_after_open_is_503_then_recovers(tmp_path: Path) -> None:
    server = RedisProcess()
    server.start()
    proxy = Proxy(server.port)
    cfg = FeatureStoreConfig(path=tmp_path, redis_url=f"redis://127.0.0.1:{proxy.port}/0",
                             num_users=20, timeout_s=0.2)
    store = OnlineFeatures.open(cfg)
    try:
        want = expected(rag_repo.generate_users(20, 13)[5])
        assert store.get("user", "user-0005", NAMES) == want
        proxy.silent = True  # a partition: the read times out
        with pytest.raises(StoreUnavailable):
            store.get("user", "user-0005", NAMES)
        proxy.silent = False
        assert store.get("user", "user-0005", NAMES) == want
        server.stop()  # down: refused
        with pytest.raises(StoreUnavailable):
            store.get("user", "user-0005", NAMES)
        server.start()  # back, empty (no persistence): served again, as unknown rows
        assert store.get("user", "user-0005", ["plan"]) == {"plan": None}
    finally:
        store.close()
        proxy.close()
        server.stop()


def test_a_users_own_feast_repository_is_served_as_it_is(sqlite_store: OnlineFeatures,
                                                           tmp_path: Path) -> None:
    """A directory with a feature_store.yaml (here: over the registry and online store the
    built-in set-up wrote) opens as a store: same entities, same rows."""
    cfg = sqlite_store._cfg
    (tmp_path / "feature_store.yaml").write_text(
        f"project: {cfg.project}\nprovider: local\n"
        f"registry: {cfg.path / f'registry-{cfg.target_id()}.db'}\n"
        f"online_store:\n  type: sqlite\n  path: {cfg.path / 'online.db'}\n"
        "entity_key_serialization_version: 3\n")
    own = OnlineFeatures.from_repo(tmp_path)
    try:
        assert own.entities() == sqlite_store.entities()
        for row in (USERS[5], USERS[250]):
            assert own.get("user", str(row["user_id"]), NAMES) == expected(row)
        assert own.get("user", "nobody", ["plan"]) == {"plan": None}
        with pytest.raises(InvalidInput, match="shoe_size"):
            own.get("user", "user-0001", ["shoe_size"])
    finally:
        own.close()


def test_a_directory_without_feature_store_yaml_is_refused(tmp_path: Path) -> None:
    from sokuji.errors import ConfigError

    with pytest.raises(ConfigError, match="not a Feast repository"):
        OnlineFeatures.from_repo(tmp_path)
