"""Response cache (LRU, TTL, coalescing, tenant isolation) and API keys, in-process."""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest
from starlette.testclient import TestClient

from sokuji import config as cfg
from sokuji.bench.engine import parse_server_timing
from sokuji.core.cache import CacheResult, Entry, MemoryBackend, ResponseCache, cache_key
from tests.conftest import client_for

INFER = "/v2/models/synth/infer"
BODY = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["same"]}]}


def entry(n: int = 4) -> Entry:
    return Entry(np.arange(n, dtype=np.float32).reshape(1, n), n)


async def test_lru_is_bounded_in_bytes_and_honours_ttl() -> None:
    now = [0.0]
    backend = MemoryBackend(max_bytes=3 * entry().nbytes, ttl_s=10, clock=lambda: now[0])
    for k in "abc":
        await backend.set(k, entry())
    await backend.get("a")  # a is now the most recently used
    await backend.set("d", entry())
    assert await backend.get("b") is None  # the least recently used went
    assert await backend.get("a") is not None and len(backend) == 3
    assert backend.bytes <= backend.max_bytes
    now[0] = 11.0
    assert await backend.get("a") is None  # expired


async def test_identical_requests_in_flight_are_computed_once() -> None:
    cache = ResponseCache(MemoryBackend(1 << 20, 60))
    gate, calls = asyncio.Event(), []

    async def compute() -> Entry:
        calls.append(1)
        await gate.wait()
        return entry()

    tasks = [asyncio.create_task(cache.get_or_compute("m", "k", compute)) for _ in range(5)]
    await asyncio.sleep(0)
    gate.set()
    results = [r for _, r in await asyncio.gather(*tasks)]
    assert len(calls) == 1
    assert sorted(results) == sorted([CacheResult.MISS] + [CacheResult.COALESCED] * 4)
    assert (await cache.get_or_compute("m", "k", compute))[1] is CacheResult.HIT


async def test_a_failed_computation_is_not_cached_and_reaches_every_waiter() -> None:
    cache = ResponseCache(MemoryBackend(1 << 20, 60))
    gate = asyncio.Event()

    async def boom() -> Entry:
        await gate.wait()
        raise ValueError("runtime broke")

    tasks = [asyncio.create_task(cache.get_or_compute("m", "k", boom)) for _ in range(3)]
    await asyncio.sleep(0)
    gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, ValueError) for r in results)
    assert await cache.backend.get("k") is None


def test_entries_round_trip_through_bytes() -> None:
    e = Entry(np.random.default_rng(0).random((3, 384), dtype=np.float32), 17)
    back = Entry.from_bytes(e.to_bytes())
    np.testing.assert_array_equal(back.output, e.output)
    assert back.num_tokens == 17


def test_keys_separate_tenants_models_versions_and_item_boundaries() -> None:
    base = cache_key("a", "m", "1", ["x", "y"])
    assert base != cache_key("b", "m", "1", ["x", "y"])
    assert base != cache_key("a", "m", "2", ["x", "y"])
    assert base != cache_key("a", "m", "1", ["xy"])
    assert base != cache_key("a", "m", "1", ["x", "y", ""])


def server(**extra: object) -> cfg.ServerConfig:
    model = cfg.ModelConfig(name="synth", runtime="synthetic", options={"base_ms": 0.0})
    other = cfg.ModelConfig(name="other", runtime="synthetic", options={"base_ms": 0.0})
    return cfg.validate(cfg.ServerConfig(models=(model, other),  # type: ignore[arg-type]
                                         cache_dir=tempfile.mkdtemp(), **extra))


@pytest.fixture
def cached() -> Iterator[TestClient]:
    with client_for(server()) as client:
        yield client


def cache_note(r: object) -> str:
    header = r.headers["server-timing"]  # type: ignore[attr-defined]
    return header.split('cache;dur=')[1].split('desc="')[1].split('"')[0]


def test_a_repeated_request_is_a_cache_hit(cached: TestClient) -> None:
    first, second = cached.post(INFER, json=BODY), cached.post(INFER, json=BODY)
    assert first.json()["outputs"] == second.json()["outputs"]
    assert (cache_note(first), cache_note(second)) == ("miss", "hit")
    timing = parse_server_timing(second.headers["server-timing"])
    assert timing["infer"] == 0.0 and timing["queue"] == 0.0
    emb = cached.post("/v1/embeddings", json={"model": "synth", "input": "same"})
    assert cache_note(emb) == "hit"  # one entry serves both protocols
    metrics = cached.get("/metrics").text
    assert 'sokuji_cache_requests_total{model="synth",result="hit"} 2.0' in metrics
    assert 'sokuji_cache_requests_total{model="synth",result="miss"} 1.0' in metrics


def test_cache_control_bypasses_and_prevents_storing(cached: TestClient) -> None:
    assert cache_note(cached.post(INFER, json=BODY, headers={"cache-control": "no-store"})) \
        == "miss"
    assert cache_note(cached.post(INFER, json=BODY)) == "miss"  # nothing was stored
    assert cache_note(cached.post(INFER, json=BODY, headers={"cache-control": "no-cache"})) \
        == "bypass"
    assert cache_note(cached.post(INFER, json=BODY)) == "hit"


def test_the_cache_can_be_turned_off() -> None:
    with client_for(server(cache=cfg.CacheConfig(enabled=False))) as client:
        r = client.post(INFER, json=BODY)
        assert 'desc="' not in r.headers["server-timing"]


KEYS = (cfg.ApiKey(key="key-of-acme-0001", tenant="acme"),
        cfg.ApiKey(key="key-of-bolt-0002", tenant="bolt", models=("synth",), priority="batch"))


@pytest.fixture
def keyed() -> Iterator[TestClient]:
    with client_for(server(api_keys=KEYS)) as client:
        yield client


def test_one_tenant_never_gets_another_tenants_cached_result(keyed: TestClient) -> None:
    acme = {"authorization": "Bearer key-of-acme-0001"}
    bolt = {"x-api-key": "key-of-bolt-0002"}
    assert cache_note(keyed.post(INFER, json=BODY, headers=acme)) == "miss"
    assert cache_note(keyed.post(INFER, json=BODY, headers=acme)) == "hit"
    assert cache_note(keyed.post(INFER, json=BODY, headers=bolt)) == "miss"  # not acme's


def test_missing_unknown_and_forbidden_keys(keyed: TestClient,
                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    r = keyed.post(INFER, json=BODY)
    assert r.status_code == 401 and "missing API key" in r.json()["error"]
    assert r.headers["www-authenticate"] == "Bearer"
    r = keyed.post(INFER, json=BODY, headers={"authorization": "Bearer not-a-real-key"})
    assert r.status_code == 401 and r.json()["error"] == "unknown API key"
    r = keyed.post("/v2/models/other/infer", json=BODY,
                   headers={"x-api-key": "key-of-bolt-0002"})
    assert r.status_code == 403 and "tenant 'bolt' may not use model 'other'" in r.json()["error"]
    r = keyed.post("/v1/embeddings", json={"model": "other", "input": "x"},
                   headers={"authorization": "Bearer key-of-bolt-0002"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert keyed.post("/v2/models/other/infer", json=BODY,
                      headers={"x-api-key": "key-of-acme-0001"}).status_code == 200
    assert "not-a-real-key" not in caplog.text and "key-of-" not in caplog.text
    assert "key-of-" not in repr(KEYS)


def test_no_keys_configured_means_open(cached: TestClient) -> None:
    assert cached.post(INFER, json=BODY).status_code == 200


def test_key_config_errors_never_echo_the_key(tmp_path: object) -> None:
    import pathlib

    path = pathlib.Path(str(tmp_path)) / "k.toml"
    path.write_text('[[api_keys]]\nkey = "short"\ntenant = "t"\n')
    with pytest.raises(cfg.ConfigError) as err:
        cfg.load(path, env={})
    assert "short" not in err.value.message and "api_keys[0].key" in err.value.message
