"""Job callbacks cannot reach inside the network: URLs vetted after DNS, addresses pinned, no
redirects, signed bodies, and answers that tell nothing about the network. Listeners here are
real sockets on loopback; the ones that must receive nothing count every connection.
(Durable delivery, per-tenant keys and per-key allowlists: test_callback_delivery.py.)"""

from __future__ import annotations

import asyncio
import http.server
import ipaddress
import json
import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from sokuji import config as cfg
from sokuji.core.backoff import Backoff
from sokuji.errors import Overloaded
from sokuji.server import callback_delivery as delivery
from sokuji.server import callbacks
from sokuji.server.callbacks import (
    POLICY_REFUSAL,
    Allowlist,
    CallbackPolicy,
    CallbackRefused,
    Resolver,
    Target,
    address_problem,
    parse,
)
from tests.conftest import client_for

INFER = "/v2/models/synth/infer"
ASYNC = {"prefer": "respond-async"}
BODY = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["call me"]}]}
REFUSED = f"x-sokuji-callback-url refused: {POLICY_REFUSAL}"


# --- the policy, as functions ----------------------------------------------------------------
@pytest.mark.parametrize("address, problem", [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("::1", "loopback"),
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"),
    ("fc00::1", "private"), ("169.254.1.1", "link-local"), ("fe80::1", "link-local"),
    ("169.254.169.254", "metadata"), ("fd00:ec2::254", "metadata"),
    ("100.100.100.200", "metadata"), ("100.64.0.1", "shared"), ("0.0.0.0", "unspecified"),
    ("::", "unspecified"), ("224.0.0.1", "multicast"), ("239.255.255.250", "multicast"),
    ("ff02::1", "multicast"), ("240.0.0.1", "reserved"), ("255.255.255.255", "reserved"),
    ("192.0.2.1", "private"), ("198.18.0.1", "private"),
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:10.0.0.1", "private"),
    ("::ffff:169.254.169.254", "metadata"), ("2002:7f00:1::", "loopback"),
    ("2002:a9fe:a9fe::", "metadata"), ("64:ff9b::7f00:1", "loopback"),
    ("64:ff9b::a00:1", "private"), ("64:ff9b:1::1", "tunnelled"), ("2001::1", "tunnelled"),
])
def test_every_inside_address_is_refused(address: str, problem: str) -> None:
    reason = address_problem(ipaddress.ip_address(address))
    assert reason is not None and problem in reason


@pytest.mark.parametrize("address", ["8.8.8.8", "93.184.215.14", "2606:4700::1111",
                                     "::ffff:8.8.8.8", "2002:808:808::", "64:ff9b::808:808"])
def test_public_addresses_pass(address: str) -> None:
    assert address_problem(ipaddress.ip_address(address)) is None


@pytest.mark.parametrize("url, reason", [
    ("ftp://example.com/x", "scheme"), ("file:///etc/passwd", "scheme"),
    ("gopher://example.com:70/", "scheme"), ("http://user:pw@example.com/", "user"),
    ("http://example.com@127.0.0.1/", "user"), ("http:///path", "no host"),
    ("http://example.com:0/", "port 0"), ("http://example.com:70000/", "not a valid URL"),
    ("http://example.com:http/", "not a valid URL"), ("http://exa mple.com/", "RFC 3986"),
    ("http://127.0.0.1\\@example.com/", "RFC 3986"), ("http://ex\u00e4mple.com/", "RFC 3986"),
    ("http://%31%32%37.0.0.1/", "percent-encoded"), ("http://[fe80::1%25eth0]/", "zone"),
    ("http://example.com/" + "a" * 2100, "longer than"),
])
def test_malformed_urls_are_refused_by_shape(url: str, reason: str) -> None:
    with pytest.raises(CallbackRefused) as err:
        parse(url)
    assert reason in err.value.reason and err.value.status == 400


ANSWERS = {"mixed.test": ["93.184.215.14", "10.0.0.7"], "public.test": ["93.184.215.14"],
           "inside.test": ["10.0.0.7"], "meta.test": ["169.254.169.254"],
           "meta6.test": ["::ffff:169.254.169.254"]}


@pytest.fixture
def fake_dns(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The resolver's lookups answer from ``ANSWERS`` (else: does not resolve); returns the
    hosts looked up."""
    asked: list[str] = []

    def lookup(host: str, port: int) -> list[str]:
        asked.append(host)
        if host not in ANSWERS:
            raise OSError("no such host")
        return ANSWERS[host]

    monkeypatch.setattr(callbacks, "lookup", lookup)
    return asked


async def test_every_address_must_pass_and_every_refusal_says_the_same(
        fake_dns: list[str], caplog: pytest.LogCaptureFixture) -> None:
    """Which rule refused, and what a name resolved to, is in the server log only: the
    answer is one sentence whatever the reason (no oracle of the inside network)."""
    policy = CallbackPolicy()
    target = await policy.vet("https://public.test/hook?x=1", "t")
    assert (target.host, target.port, target.address) == ("public.test", 443, "93.184.215.14")
    caplog.set_level(logging.INFO, logger="sokuji.server.callbacks")
    for url, detail in [("http://mixed.test/", "private"), ("http://inside.test/", "private"),
                        ("http://nowhere.test/", "does not resolve"),
                        ("http://metadata.google.internal/", "metadata"),
                        ("http://[::ffff:7f00:1]:80/", "loopback"),
                        ("http://169.254.169.254/", "metadata"),
                        ("http://meta.test/", "metadata")]:
        caplog.clear()
        with pytest.raises(CallbackRefused) as err:
            await policy.vet(url, "t")
        assert err.value.reason == POLICY_REFUSAL, url
        assert detail in caplog.text, url


async def test_allowlists_name_hosts_or_networks_and_metadata_only_exactly(
        fake_dns: list[str]) -> None:
    allowed = CallbackPolicy(["inside.test", "10.0.0.0/8", "169.254.0.0/16"])
    assert (await allowed.vet("http://inside.test/", "t")).address == "10.0.0.7"
    assert (await allowed.vet("http://10.9.9.9:8080/", "t")).address == "10.9.9.9"
    assert (await allowed.vet("http://169.254.1.1/", "t")).address == "169.254.1.1"
    with pytest.raises(CallbackRefused):  # a wider network does not reach a metadata address
        await allowed.vet("http://169.254.169.254/latest/meta-data/", "t")
    named = CallbackPolicy(["meta.test", "meta6.test", "metadata.google.internal"])
    for url in ("http://meta.test/", "http://meta6.test/", "http://metadata.google.internal/"):
        with pytest.raises(CallbackRefused):  # an allowed NAME never reaches one either
            await named.vet(url, "t")
    exact = CallbackPolicy(["169.254.169.254", "meta.test"])
    assert (await exact.vet("http://169.254.169.254/", "t")).address == "169.254.169.254"
    assert (await exact.vet("http://meta.test/", "t")).address == "169.254.169.254"
    # A per-key list adds to the global one, for that key's jobs only.
    policy = CallbackPolicy(["public.test"])
    with pytest.raises(CallbackRefused):
        await policy.vet("http://inside.test/", "t")
    mine = Allowlist.of(["public.test"], ["10.0.0.7"])
    assert (await policy.vet("http://inside.test/", "t", mine)).address == "10.0.0.7"


def test_ip_literals_compare_as_addresses() -> None:
    """yarl writes an IPv6 literal in its short form; the host is the same address."""
    url = "http://[2606:4700:0:0:0:0:0:1111]:8080/hook"
    target = parse(url)
    assert delivery._same_host(Target(url, target.host, target.port, "2606:4700::1111"))
    with pytest.raises(CallbackRefused, match="ambiguous"):
        delivery._same_host(Target(url, "2606:4700::1112", 8080, "2606:4700::1112"))


async def test_lookups_have_their_own_bounded_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup that hangs holds one of the resolver's own threads, never the loop's default
    pool; past its timeout it is abandoned but still counted until its thread is free; a
    tenant's lookups at once, and everyone's, are bounded: past either, 429 at once."""
    gate = threading.Event()
    default_pool_threads: list[str] = []

    def lookup(host: str, port: int) -> list[str]:
        default_pool_threads.append(threading.current_thread().name)
        gate.wait(30)
        return ["93.184.215.14"]

    monkeypatch.setattr(callbacks, "lookup", lookup)
    resolver = Resolver(timeout_s=0.05, threads=3, per_tenant=2)
    try:
        for _ in range(2):
            with pytest.raises(TimeoutError):
                await resolver.resolve("slow.test", 80, "acme")
        with pytest.raises(Overloaded, match="tenant 'acme' already has 2"):
            await resolver.resolve("slow.test", 80, "acme")
        with pytest.raises(TimeoutError):
            await resolver.resolve("slow.test", 80, "bolt")
        with pytest.raises(Overloaded, match="too many callback host lookups"):
            await resolver.resolve("other.test", 80, "carl")
        assert all(name.startswith("sokuji-dns") for name in default_pool_threads)
        gate.set()  # the threads come back: the bound frees up
        deadline = time.monotonic() + 10
        while resolver._in_flight:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert await resolver.resolve("fast.test", 80, "acme") == ["93.184.215.14"]
    finally:
        gate.set()
        resolver.close()


def test_signatures_verify_and_stale_ones_do_not() -> None:
    body = b'{"id": "x"}'
    signature = delivery.sign("s" * 32, 1_700_000_000, body)
    assert signature.startswith("v1=") and len(signature) == 3 + 64
    assert delivery.verify("s" * 32, "1700000000", signature, body, now=1_700_000_100)
    assert not delivery.verify("s" * 32, "1700000000", signature, body + b" ",
                                now=1_700_000_100)
    assert not delivery.verify("t" * 32, "1700000000", signature, body, now=1_700_000_100)
    assert not delivery.verify("s" * 32, "1700000000", signature, body, now=1_700_001_000)
    assert not delivery.verify("s" * 32, "soon", signature, body)


def test_tenants_derive_different_keys_from_one_secret() -> None:
    acme = delivery.tenant_secret("d" * 32, "acme")
    assert len(acme) == 64 and acme != delivery.tenant_secret("d" * 32, "bolt")
    assert acme == delivery.tenant_secret("d" * 32, "acme")
    assert acme != delivery.tenant_secret("e" * 32, "acme")


def test_the_generated_secret_is_private_and_survives_restarts(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "callback_secret"
    first = delivery.load_or_create_secret(path)
    assert len(first) == 64 and int(first, 16) >= 0  # 32 random bytes, hex
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert delivery.load_or_create_secret(path) == first
    assert [p.name for p in path.parent.iterdir()] == ["callback_secret"]  # no temp files


# --- end to end: real listeners ---------------------------------------------------------------
class Listener(http.server.ThreadingHTTPServer):
    """An HTTP server on loopback that counts connections and records POSTs. With ``hold``,
    each request waits for that event before it is answered (``busy`` counts those waiting,
    ``most_busy`` the most at once)."""

    def __init__(self, host: str = "127.0.0.1", status: int = 200,
                 headers: dict[str, str] | None = None, first: tuple[int, ...] = (),
                 hold: threading.Event | None = None) -> None:
        self.connections = 0
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.status = status
        self.first = list(first)
        """Statuses of the first answers, before ``status``."""
        self.reply_headers = headers or {}
        self.hold = hold
        self.busy = self.most_busy = 0
        self._lock = threading.Lock()
        listener = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers["content-length"]))
                headers = {k.lower(): v for k, v in self.headers.items()}
                if listener.hold is not None:
                    with listener._lock:
                        listener.busy += 1
                        listener.most_busy = max(listener.most_busy, listener.busy)
                    listener.hold.wait(60)
                    with listener._lock:
                        listener.busy -= 1
                listener.requests.append((self.path, headers, data))
                self.send_response(listener.first.pop(0) if listener.first
                                   else listener.status)
                for k, v in listener.reply_headers.items():
                    self.send_header(k, v)
                self.send_header("content-length", "0")
                self.end_headers()

            do_GET = do_POST

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__((host, 0), Handler)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        self.connections += 1
        return True

    @property
    def url(self) -> str:
        return f"http://{self.server_address[0]}:{self.server_address[1]}"


@contextmanager
def listening(**kwargs: Any) -> Iterator[Listener]:
    server = Listener(**kwargs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        if server.hold is not None:
            server.hold.set()
        server.shutdown()
        server.server_close()


def app_config(allow: tuple[str, ...] = (), secret: str = "",
               keys: tuple[cfg.ApiKey, ...] = (), cache_dir: str | None = None,
               timeout_s: float = 5.0, **jobs: Any) -> cfg.ServerConfig:
    model = cfg.ModelConfig(name="synth", runtime="synthetic", options={"base_ms": 1.0})
    j = cfg.JobsConfig(callback_allow=allow, callback_secret=secret,
                       callback_timeout_s=timeout_s, **jobs)
    return cfg.validate(cfg.ServerConfig(models=(model,), jobs=j, api_keys=keys,
                                         cache_dir=cache_dir or tempfile.mkdtemp()))


def callback_outcome(client: TestClient, location: str, headers: dict[str, str] | None = None,
                     timeout_s: float = 30.0) -> str:
    """Poll the job until its callback has an outcome (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        outcome = client.get(location, headers=headers).json()["callback"]
        if outcome != "pending":
            return str(outcome)
        time.sleep(0.01)  # (a poll, not a spin: the delivery needs the core too)
    raise TimeoutError(location)


def test_inside_callbacks_are_refused_at_submit_alike_and_nothing_is_sent() -> None:
    with listening() as inside, client_for(app_config()) as client:
        port = inside.server_address[1]
        for url in (f"{inside.url}/x", f"http://localhost:{port}/x",
                    f"http://[::ffff:127.0.0.1]:{port}/", f"http://127.1:{port}/",
                    f"http://0x7f000001:{port}/", f"http://LOCALHOST.:{port}/",
                    "http://169.254.169.254/latest/", "http://10.1.2.3/"):
            r = client.post(INFER, json=BODY, headers={**ASYNC,
                                                       "x-sokuji-callback-url": url})
            assert r.status_code == 400, url
            assert r.json()["error"] == REFUSED, url  # the same words, whatever the reason
    assert inside.connections == 0 and inside.requests == []


def test_an_allowed_listener_gets_exactly_one_signed_post() -> None:
    secret = "a-shared-secret-of-32-characters"
    with listening() as hook, client_for(app_config(("127.0.0.1",), secret)) as client:
        r = client.post(INFER, json=BODY, headers={**ASYNC,
                                                   "x-sokuji-callback-url": f"{hook.url}/done"})
        assert r.status_code == 202
        assert callback_outcome(client, r.headers["location"]) == "delivered"
    assert len(hook.requests) == 1
    path, headers, data = hook.requests[0]
    assert path == "/done" and headers["x-sokuji-job-id"] == r.json()["id"]
    assert headers["content-type"] == "application/json"
    assert headers["x-sokuji-tenant"] == "anonymous"
    assert delivery.verify(delivery.tenant_secret(secret, "anonymous"),
                            headers["x-sokuji-timestamp"], headers["x-sokuji-signature"], data)
    assert not delivery.verify(secret, headers["x-sokuji-timestamp"],
                                headers["x-sokuji-signature"], data)  # derived, not shared
    doc = json.loads(data)
    assert doc["id"] == r.json()["id"] and doc["status"] == 200
    assert json.loads(doc["body"])["outputs"][0]["data"] == [7.0]


def test_a_redirect_is_a_failure_and_is_not_followed() -> None:
    with listening(host="127.0.0.2") as inside, \
            listening(status=307, headers={}) as hook, \
            client_for(app_config(("127.0.0.1",))) as client:
        hook.reply_headers["location"] = f"{inside.url}/steal"
        r = client.post(INFER, json=BODY, headers={**ASYNC,
                                                   "x-sokuji-callback-url": hook.url})
        assert callback_outcome(client, r.headers["location"]) == "failed"
    assert len(hook.requests) == 1  # a 3xx is final: not retried either
    assert inside.connections == 0


def test_the_status_never_tells_what_answered() -> None:
    with listening(status=404) as hook, client_for(app_config(("127.0.0.1",))) as client:
        r = client.post(INFER, json=BODY, headers={**ASYNC,
                                                   "x-sokuji-callback-url": hook.url})
        assert callback_outcome(client, r.headers["location"]) == "failed"  # not "404"
    assert len(hook.requests) == 1


def test_dns_is_checked_again_at_delivery(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that resolved to a public address at submit and to loopback at delivery (DNS
    rebinding) is refused then, and nothing is sent; the job says only ``refused``."""
    answers = iter([["93.184.215.14"], ["127.0.0.1"]])

    def lookup(host: str, port: int) -> list[str]:
        assert host == "rebind.test"
        return next(answers)

    monkeypatch.setattr(callbacks, "lookup", lookup)
    with listening() as inside, client_for(app_config()) as client:
        url = f"http://rebind.test:{inside.server_address[1]}/"
        r = client.post(INFER, json=BODY, headers={**ASYNC, "x-sokuji-callback-url": url})
        assert r.status_code == 202
        assert callback_outcome(client, r.headers["location"]) == "refused"
    assert inside.connections == 0


def test_the_connection_goes_to_the_vetted_address_with_the_original_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``hook.test`` exists only in the policy's resolver: delivery must use the address the
    policy vetted (no second lookup), and still say ``Host: hook.test``."""
    calls: list[str] = []

    def lookup(host: str, port: int) -> list[str]:
        calls.append(host)
        return ["127.0.0.1"]

    monkeypatch.setattr(callbacks, "lookup", lookup)
    with listening() as hook, client_for(app_config(("hook.test",))) as client:
        url = f"http://hook.test:{hook.server_address[1]}/cb"
        r = client.post(INFER, json=BODY, headers={**ASYNC, "x-sokuji-callback-url": url})
        assert callback_outcome(client, r.headers["location"]) == "delivered"
    assert calls == ["hook.test", "hook.test"]  # at submit, and once before the one attempt
    assert hook.requests[0][1]["host"] == f"hook.test:{hook.server_address[1]}"


def test_a_callback_is_retried_until_it_is_delivered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delivery, "RETRY", Backoff(base_s=0.01, cap_s=0.01))
    monkeypatch.setattr(delivery, "MAX_ATTEMPTS", 4)
    with listening(first=(503, 429)) as hook, \
            client_for(app_config(("127.0.0.1",))) as client:
        r = client.post(INFER, json=BODY, headers={**ASYNC,
                                                   "x-sokuji-callback-url": hook.url})
        assert callback_outcome(client, r.headers["location"]) == "delivered"
    assert len(hook.requests) == 3
    assert len({req[1]["x-sokuji-job-id"] for req in hook.requests}) == 1


def test_a_receiver_that_never_takes_it_leaves_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delivery, "RETRY", Backoff(base_s=0.01, cap_s=0.01))
    monkeypatch.setattr(delivery, "MAX_ATTEMPTS", 3)
    with listening(status=500) as hook, client_for(app_config(("127.0.0.1",))) as client:
        r = client.post(INFER, json=BODY, headers={**ASYNC,
                                                   "x-sokuji-callback-url": hook.url})
        assert callback_outcome(client, r.headers["location"]) == "failed"
    assert len(hook.requests) == 3
