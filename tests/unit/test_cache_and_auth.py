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
from sokuji.core.cache import CacheResult, Entry, ResponseCache, cache_key
from sokuji.stores.cache_memory import MemoryBackend
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
    packed = Entry(np.frombuffer(b"packed tensors", dtype=np.uint8), 0)  # dtype "|u1"
    assert Entry.from_bytes(packed.to_bytes()).output.tobytes() == b"packed tensors"


def test_keys_separate_tenants_models_versions_and_item_boundaries() -> None:
    base = cache_key("a", "m", "1", ["x", "y"])
    assert base != cache_key("b", "m", "1", ["x", "y"])
    assert base != cache_key("a", "m", "2", ["x", "y"])
    assert base != cache_key("a", "m", "1", ["xy"])
    assert base != cache_key("a", "m", "1", ["x", "y", ""])
    assert cache_key("a:b", "m", "1", ["x"]) != cache_key("a", "b:m", "1", ["x"])


def test_a_keyed_tenant_named_anonymous_does_not_share_the_open_servers_entries() -> None:
    """An open server's callers are the tenant ``anonymous``; its entries in a shared Redis
    outlive a restart with keys. Keys configured or not is part of the key (the server's
    setting, not the name), so a keyed tenant named ``anonymous`` does not read them."""
    assert cache_key("anonymous", "m", "1", ["x"], keyed=True) != \
        cache_key("anonymous", "m", "1", ["x"], keyed=False)


def test_the_answers_form_is_a_part_of_its_own() -> None:
    """The plain answer's entry was keyed by the input's parts with ``"plain"`` appended: a
    tensors request whose identity ended in ``"plain"`` would have read (or poisoned) the plain
    entry of the input without it. The form is its own length-prefixed part now."""
    assert cache_key("a", "m", "1", ["x"], form="plain") != \
        cache_key("a", "m", "1", ["x", "plain"])
    assert cache_key("a", "m", "1", ["x"], form="plain") != cache_key("a", "m", "1", ["x"])


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


# --- tenant isolation on the control plane, and the priority ceiling ----------------------

ROOT = cfg.ApiKey(key="key-of-root-0003", tenant="root", models=("synth",), admin=True)
CAPPED = cfg.ApiKey(key="key-of-capd-0004", tenant="capd", models=("synth",),
                    max_priority="batch")
ACME, BOLT = {"x-api-key": "key-of-acme-0001"}, {"x-api-key": "key-of-bolt-0002"}
ROOT_H, CAPD_H = {"x-api-key": "key-of-root-0003"}, {"x-api-key": "key-of-capd-0004"}


@pytest.fixture
def tenants() -> Iterator[TestClient]:
    with client_for(server(api_keys=(*KEYS, ROOT, CAPPED))) as client:
        yield client


def model_ids(r: object) -> list[str]:
    assert r.status_code == 200, r.text  # type: ignore[attr-defined]
    return [m["id"] for m in r.json()["data"]]  # type: ignore[attr-defined]


def test_model_list_needs_a_key_and_shows_only_the_tenants_models(tenants: TestClient
                                                                  ) -> None:
    r = tenants.get("/v1/models")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "unauthorized"  # OpenAI's error format
    assert model_ids(tenants.get("/v1/models", headers=BOLT)) == ["synth"]
    assert model_ids(tenants.get("/v1/models", headers=ACME)) == ["synth", "other"]


def test_model_list_can_be_left_open() -> None:
    with client_for(server(api_keys=KEYS, models_require_key=False)) as client:
        assert model_ids(client.get("/v1/models")) == ["synth", "other"]
        assert client.get("/v2/models/other/config").status_code == 200


@pytest.mark.parametrize("suffix", ["", "/ready", "/config", "/versions/1",
                                    "/versions/1/config"])
def test_a_tenant_learns_nothing_about_models_outside_its_list(tenants: TestClient,
                                                               suffix: str) -> None:
    assert tenants.get(f"/v2/models/synth{suffix}").status_code == 401  # no key
    assert tenants.get(f"/v2/models/synth{suffix}", headers=BOLT).status_code == 200
    other = tenants.get(f"/v2/models/other{suffix}", headers=BOLT)
    ghost = tenants.get(f"/v2/models/ghost{suffix}", headers=BOLT)
    assert other.status_code == ghost.status_code == 403
    assert other.json()["error"] == "tenant 'bolt' may not use model 'other'"
    assert ghost.json()["error"] == "tenant 'bolt' may not use model 'ghost'"  # same answer


def test_inference_does_not_reveal_other_models_either(tenants: TestClient) -> None:
    r = tenants.post("/v2/models/ghost/infer", json=BODY, headers=BOLT)
    assert r.status_code == 403 and "other" not in r.text  # no list of the models there are
    r = tenants.post("/v1/embeddings", json={"model": "ghost", "input": "x"}, headers=BOLT)
    assert r.status_code == 403 and "other" not in r.text
    r = tenants.post("/v2/models/ghost/infer", json=BODY, headers=ACME)  # may use every model
    assert r.status_code == 404 and "other" not in r.text  # with keys, 404s list nothing


def test_probes_and_server_metadata_need_no_key(tenants: TestClient) -> None:
    for path in ("/v2/health/live", "/v2/health/ready", "/health", "/v2"):
        assert tenants.get(path).status_code == 200, path


def test_stats_need_an_admin_key(tenants: TestClient) -> None:
    """A model's statistics count every tenant's requests (and say when it last ran): a
    tenant that may use the model reading them learns the others' traffic. Admin only."""
    for path in ("/v2/models/stats", "/v2/models/synth/stats", "/v2/models/other/stats",
                 "/v2/models/synth/versions/1/stats", "/v2/models/ghost/stats"):
        r = tenants.get(path)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
        assert tenants.get(path, headers={"x-api-key": "not-a-key-at-all"}).status_code == 401
        for tenant in (BOLT, ACME):  # its own model, every model: no statistics
            r = tenants.get(path, headers=tenant)
            assert r.status_code == 403 and "admin" in r.json()["error"], path
            assert "other" not in r.json()["error"] or "other" in path
    r = tenants.get("/v2/models/stats", headers=ROOT_H)
    assert r.status_code == 200  # admin: every model's statistics
    assert {s["name"] for s in r.json()["model_stats"]} == {"synth", "other"}
    assert tenants.get("/v2/models/other/stats", headers=ROOT_H).status_code == 200


def test_metrics_need_an_admin_key_once_keys_exist(tenants: TestClient) -> None:
    r = tenants.get("/metrics")  # metrics_require_key is on by default
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    r = tenants.get("/metrics", headers=ACME)
    assert r.status_code == 403 and "admin" in r.json()["error"]
    r = tenants.get("/metrics", headers=ROOT_H)
    assert r.status_code == 200 and "sokuji_requests_total" in r.text
    with client_for(server(api_keys=(*KEYS, ROOT), metrics_require_key=False)) as client:
        assert client.get("/metrics").status_code == 200  # the opt-out: a private scraper
        assert client.get("/v2/models/stats").status_code == 401  # statistics: still admin
        assert client.get("/v2/models/stats", headers=ACME).status_code == 403


def test_a_priority_cannot_rise_above_the_tenants_ceiling(tenants: TestClient) -> None:
    from sokuji.core.request import Priority

    served = tenants.app.inference.repo.models["synth"].served  # type: ignore[attr-defined]
    seen: list[Priority] = []
    submit = served.submit

    def spy(prepared: object, ctx: object) -> object:
        seen.append(ctx.priority)  # type: ignore[attr-defined]
        return submit(prepared, ctx)

    served.submit = spy
    asks: list[tuple[dict[str, str], dict[str, object], Priority]] = [
        (CAPD_H | {"x-sokuji-priority": "interactive"}, {}, Priority.BATCH),  # clamped
        (CAPD_H, {"priority": 1}, Priority.BATCH),                            # clamped
        (CAPD_H, {}, Priority.BATCH),
        (ACME | {"x-sokuji-priority": "batch"}, {}, Priority.BATCH),
        (ACME, {}, Priority.INTERACTIVE),
        (BOLT | {"x-sokuji-priority": "interactive"}, {}, Priority.INTERACTIVE),  # no ceiling
        (BOLT, {"priority": 0}, Priority.BATCH),  # Triton's 0: the tenant's default
    ]
    for i, (headers, params, _) in enumerate(asks):
        body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                            "data": [f"text {i}"]}], "parameters": params}
        r = tenants.post(INFER, json=body, headers=headers | {"cache-control": "no-cache"})
        assert r.status_code == 200, r.text
    assert seen == [want for _, _, want in asks]


def test_priority_ceiling_rules() -> None:
    from sokuji.core.request import Priority
    from sokuji.server.scheduling import priority

    header = {"x-sokuji-priority": "interactive"}
    assert priority(header, {}, None, "batch") is Priority.BATCH
    assert priority(header, {}, None, "interactive") is Priority.INTERACTIVE
    assert priority(header, {}, None, None) is Priority.INTERACTIVE
    assert priority({}, {"priority": 2}, None, "interactive") is Priority.BATCH
    assert priority({}, {}, "interactive", "batch") is Priority.BATCH
    assert priority({}, {"priority": 0}, "batch", None) is Priority.BATCH
