"""Issue 25, finding 3, replayed against a real ``sokuji serve`` with two tenants, in front
of a fake OpenAI / KServe V2 upstream (a plain HTTP server in this process) whose answers
carry what a shared upstream's state reveals: ``usage.prompt_tokens_details.cached_tokens``
(its prompt cache's hits) and its ``Server-Timing`` (0.28 ms: its response cache's hit).

With the upstream example of ``docs/routing.md`` (``api_key_env`` alone) both tenants are
sent with one key, so neither field may reach either of them: tenant 2 read 18 cached tokens
for a wrong guess of tenant 1's system prompt and 20 for the right one, and 0.28 ms against 4.8 ms
for a text tenant 1 had embedded. With ``tenant_keys_env`` (a key of each tenant's own) they pass
through as before. Chat and text completions, plain and streamed, and embeddings over both
protocols.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import orjson
import pytest

from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

CACHED = 20
UPSTREAM_TIMING = "cache;dur=0.01;desc=\"hit\", total;dur=0.28"
UPSTREAM_TOTAL = "upstream 0.28 ms"
"""The upstream's total as a Sokuji in front of it shows it (a bare "0.28" could be one
of our own durations)."""
ONE, TWO = "t1-key-0123456789abcdef", "t2-key-0123456789abcdef"
ENV = {"UPT_SHARED": "shared-secret", "UPT_ONE": "one-secret", "UPT_TWO": "two-secret"}


class FakeUpstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    keys: list[str] = []  # noqa: RUF012 - the server's record of the keys it was sent

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, body: bytes, content_type: str = "application/json",
                extra: dict[str, str] | None = None) -> None:
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.send_header("server-timing", UPSTREAM_TIMING)
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer(orjson.dumps({
            "name": "m", "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
            "outputs": [{"name": "emb", "datatype": "FP32", "shape": [-1, 3]}]}))

    def do_POST(self) -> None:
        doc = orjson.loads(self.rfile.read(int(self.headers["content-length"])))
        FakeUpstream.keys.append(self.headers.get("authorization", ""))
        usage = {"prompt_tokens": 24, "completion_tokens": 2, "total_tokens": 26,
                 "prompt_tokens_details": {"cached_tokens": CACHED}}
        if self.path == "/v1/embeddings":
            n = len(doc["input"])
            self._answer(orjson.dumps({"data": [{"index": i, "embedding": [1.0, 2.0, 3.0]}
                                                for i in range(n)],
                                       "usage": {"prompt_tokens": n, "total_tokens": n}}))
            return
        if self.path.startswith("/v2/"):
            n = doc["inputs"][0]["shape"][0]
            self._answer(orjson.dumps({"outputs": [{"name": "emb", "datatype": "FP32",
                                                    "shape": [n, 3], "data": [0.5] * 3 * n}]}))
            return
        chat = self.path == "/v1/chat/completions"
        parts = [{"delta": {"content": t}} if chat else {"text": t} for t in ("Hel", "lo")]
        events = [{"choices": [{**p, "finish_reason": None, "index": 0}]} for p in parts]
        events.append({"choices": [{**({"delta": {}} if chat else {"text": ""}),
                                    "finish_reason": "stop", "index": 0}]})
        events.append({"choices": [], "usage": usage})
        body = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
        self._answer(body + b"data: [DONE]\n\n", "text/event-stream")


def upstream(name: str, url: str, own_keys: bool, **extra: str) -> str:
    keys = 'tenant_keys_env = { t1 = "UPT_ONE", t2 = "UPT_TWO" }\n' if own_keys else ""
    more = "".join(f'{k} = "{v}"\n' for k, v in extra.items())
    return (f'[[models]]\nname = "{name}"\nruntime = "upstream"\n[models.options]\n'
            f'url = "{url}"\nupstream_model = "m"\napi_key_env = "UPT_SHARED"\n{keys}{more}')


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    fake = ThreadingHTTPServer(("127.0.0.1", 0), FakeUpstream)
    thread = threading.Thread(target=fake.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{fake.server_address[1]}"
    body = f'[cache]\nenabled = false\n[[api_keys]]\nkey = "{ONE}"\ntenant = "t1"\n' \
           f'[[api_keys]]\nkey = "{TWO}"\ntenant = "t2"\n'
    for own, tag in ((False, "shared"), (True, "own")):
        body += upstream(f"chat-{tag}", url, own, protocol="openai", task="chat")
        body += upstream(f"emb-{tag}", url, own, protocol="openai", task="embeddings")
        body += upstream(f"v2-{tag}", url, own, protocol="v2")
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)  # the server process reads the upstream's keys from its own
    try:
        with sokuji_server(body) as base:
            yield base
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        fake.shutdown()
        fake.server_close()
        thread.join(5)


def shows_upstream_state(base: str, key: str, tag: str) -> list[bool]:
    """For each surface: whether the answer carried the upstream's cached tokens or its
    timing."""
    auth = {"authorization": f"Bearer {key}"}
    seen = []
    for path, chat in (("/v1/chat/completions", True), ("/v1/completions", False)):
        body: dict[str, Any] = {"model": f"chat-{tag}", "max_tokens": 4}
        body.update({"messages": [{"role": "user", "content": "guess"}]} if chat
                    else {"prompt": "guess"})
        r = httpx.post(base + path, json=body, headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        timing = r.headers["server-timing"]
        seen.append(cached == CACHED or f"hit {CACHED}" in timing or UPSTREAM_TOTAL in timing)
        assert cached in (0, CACHED) and r.json()["usage"]["prompt_tokens"] == 24
        stream = {**body, "stream": True, "stream_options": {"include_usage": True,
                                                             "continuous_usage_stats": True}}
        with httpx.stream("POST", base + path, json=stream, headers=auth, timeout=30) as s:
            lines = list(s.iter_lines())
        docs = [orjson.loads(line[6:]) for line in lines
                if line.startswith("data: {")]
        cached_seen = {d["usage"]["prompt_tokens_details"]["cached_tokens"]
                       for d in docs if d.get("usage")}
        comment = next(line for line in lines if line.startswith(": server-timing"))
        seen.append(CACHED in cached_seen or f"hit {CACHED}" in comment
                    or UPSTREAM_TOTAL in comment)
    for path, doc in (("/v1/embeddings", {"model": f"emb-{tag}", "input": ["a", "b"]}),
                      (f"/v2/models/v2-{tag}/infer", {"inputs": [
                          {"name": "text", "datatype": "BYTES", "shape": [1],
                           "data": ["a"]}]})):
        r = httpx.post(base + path, json=doc, headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        seen.append(UPSTREAM_TOTAL in r.headers["server-timing"])
    return seen


def test_a_shared_upstream_key_passes_nothing_of_the_upstreams_state(served: str) -> None:
    assert shows_upstream_state(served, ONE, "shared") == [False] * 6
    assert shows_upstream_state(served, TWO, "shared") == [False] * 6
    FakeUpstream.keys.clear()
    assert shows_upstream_state(served, TWO, "shared") == [False] * 6
    assert set(FakeUpstream.keys) == {"Bearer shared-secret"}


def test_per_tenant_upstream_keys_pass_it_through(served: str) -> None:
    FakeUpstream.keys.clear()
    assert shows_upstream_state(served, ONE, "own") == [True] * 6
    assert set(FakeUpstream.keys) == {"Bearer one-secret"}
    assert shows_upstream_state(served, TWO, "own") == [True] * 6


def test_long_stop_strings_are_refused_before_the_upstream_is_called(served: str) -> None:
    """Issue 25, finding 6, through the upstream kind: four 1 MB stops, 413 naming the
    limit, the upstream never asked; the model's config states its limits."""
    auth = {"authorization": f"Bearer {ONE}"}
    FakeUpstream.keys.clear()
    r = httpx.post(f"{served}/v1/completions", headers=auth, timeout=30, json={
        "model": "chat-own", "prompt": "hi", "stop": ["x" * 1_000_000] * 4})
    assert r.status_code == 413 and r.json()["error"]["param"] == "stop.bytes"
    assert FakeUpstream.keys == []
    params = httpx.get(f"{served}/v2/models/chat-own/config", headers=auth,
                       timeout=30).json()["parameters"]
    assert {"limit.options.max_response_bytes", "limit.stop", "limit.stop.bytes"} <= \
        set(params)
    assert params["limit.stop.bytes"]["string_value"].startswith("512 bytes")
