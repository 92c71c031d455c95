"""The ``Host`` check (``server/hosts.py``), the DNS-rebinding defence: which names a config
allows, and the app's 421 on every path, before the key is read or any work is done."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from sokuji import config as cfg
from sokuji.errors import ConfigError
from sokuji.server.hosts import AllowedHosts
from tests.conftest import client_for

BODY = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}


def hosts(**extra: object) -> AllowedHosts | None:
    return AllowedHosts.of(cfg.validate(cfg.ServerConfig(
        models=(cfg.ModelConfig(name="synth", runtime="synthetic"),),
        cache_dir=tempfile.mkdtemp(prefix="sokuji-test-"), **extra)))  # type: ignore[arg-type]


def test_bound_to_loopback_only_loopback_names_with_any_port() -> None:
    allowed = hosts()  # host = "127.0.0.1", the default
    assert allowed is not None
    for value in ("localhost", "localhost:8000", "LOCALHOST:1", "127.0.0.1:8000", "[::1]:8000",
                  "[::1]", "localhost.:8000", None):
        assert allowed.allows(value), value
    for value in ("evil.example:8000", "evil.example", "127.0.0.1.evil.example",
                  "localhost.evil.example:8000", "localhost:8000@evil", "localhost:", "::1",
                  "localhost:80000000", "127.0.0.2:8000", "", "[::1", "[::1]x"):
        assert not allowed.allows(value), value
    assert hosts(host="::1").allows("[::1]:9")  # type: ignore[union-attr]
    assert hosts(host="127.0.0.2").allows("127.0.0.2:9")  # type: ignore[union-attr]


def test_bound_wide_any_name_unless_listed() -> None:
    assert hosts(host="0.0.0.0") is None and hosts(host="10.1.2.3") is None  # keys protect
    assert hosts(host="127.0.0.1", ray=cfg.RayConfig(http_host="0.0.0.0")) is None
    assert hosts(allowed_hosts=("*",)) is None
    listed = hosts(host="0.0.0.0", allowed_hosts=("sokuji.internal", "*.corp.example",
                                                  "10.0.0.5", "[fd00::1]"))
    assert listed is not None
    for value in ("sokuji.internal:80", "a.corp.example", "b.a.corp.example:1", "10.0.0.5:8000",
                  "[fd00::1]:8000"):
        assert listed.allows(value), value
    for value in ("corp.example", "xcorp.example", "localhost:8000", "evil.example"):
        assert not listed.allows(value), value


def test_the_setting_is_checked_and_read_from_the_environment() -> None:
    for bad in ("evil.example:8000", "http://x", "a b", "*x", ""):
        with pytest.raises(ConfigError, match=r"allowed_hosts\[0\]"):
            hosts(allowed_hosts=(bad,))
    config = cfg.load(env={"SOKUJI_ALLOWED_HOSTS": "sokuji.internal, *.corp.example"})
    assert config.allowed_hosts == ("sokuji.internal", "*.corp.example")


def test_decisions_kept_are_bounded() -> None:
    from sokuji.server import hosts as module

    allowed = hosts()
    assert allowed is not None
    for i in range(module.KEEP + 500):
        assert not allowed.allows(f"name-{i}.evil.example")
    assert len(allowed._known) == module.KEEP
    assert not allowed.allows("name-5000.evil.example")


@pytest.fixture(scope="module")
def keyed() -> Iterator[TestClient]:
    config = cfg.validate(cfg.ServerConfig(
        models=(cfg.ModelConfig(name="synth", runtime="synthetic"),),
        api_keys=(cfg.ApiKey(key="admin-key-0123456789", tenant="ops", admin=True),),
        metrics_require_key=False, jobs=cfg.JobsConfig(enabled=True),
        cache_dir=tempfile.mkdtemp(prefix="sokuji-test-")))
    with client_for(config) as client:
        yield client


def test_a_rebound_name_gets_421_on_every_path(keyed: TestClient) -> None:
    """The attack: a page whose name resolves to 127.0.0.1 reads the open endpoints (here
    /metrics, opened on purpose) with the victim's browser; the request says its own name."""
    admin = {"authorization": "Bearer admin-key-0123456789"}
    evil = {"host": "rebound.evil.example:8000"}
    for method, path in (("GET", "/metrics"), ("GET", "/dashboard/data"), ("GET", "/dashboard"),
                         ("GET", "/v2/health/ready"), ("GET", "/v2/models/stats"),
                         ("GET", "/nowhere"), ("POST", "/v2/models/synth/infer"),
                         ("POST", "/v1/embeddings"), ("POST", "/v1/chat/completions"),
                         ("GET", "/v2/jobs/0123")):
        r = keyed.request(method, path, headers={**evil, **admin}, json=BODY)
        assert r.status_code == 421, (method, path, r.status_code)
        assert r.json()["code" if not path.startswith("/v1/") else "error"]
        assert "rebound" not in r.text  # the name is not echoed
    assert keyed.get("/metrics").status_code == 200  # the server's own name: answered
    r = keyed.post("/v2/models/synth/infer", json=BODY, headers=admin)
    assert r.status_code == 200
    r = keyed.post("/v2/models/synth/infer", json=BODY,
                   headers={**admin, "host": "127.0.0.1:8000"})
    assert r.status_code == 200
