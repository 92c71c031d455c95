"""The blocking HTTP door (sokuji/http_client.py) against a small threaded server: any status
is an answer, redirects are not followed, the body is bounded, no answer is ``Unreachable``,
and it works from inside a running event loop too."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator

import pytest

from sokuji import http_client


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("location", "/ok")
            self.send_header("content-length", "0")
            self.end_headers()
            return
        status, body = {"/ok": (200, b'{"ok": true}'), "/big": (200, b"x" * 10_000),
                        "/missing": (404, b"no")}[self.path]
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        answer = self.headers["x-echo"].encode() + b":" + body
        self.send_response(201)
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def get(url: str, max_bytes: int = 1 << 20) -> http_client.Response:
    return http_client.request("GET", url, timeout_s=5, max_bytes=max_bytes)


def test_any_status_is_an_answer(base: str) -> None:
    ok = get(f"{base}/ok")
    assert ok.status == 200 and ok.ok and ok.body == b'{"ok": true}' and not ok.truncated
    missing = get(f"{base}/missing")
    assert missing.status == 404 and not missing.ok and missing.body == b"no"
    posted = http_client.request("POST", f"{base}/echo", timeout_s=5, max_bytes=100,
                                 headers={"x-echo": "hi"}, body=b"there")
    assert posted.status == 201 and posted.body == b"hi:there"


def test_a_redirect_is_not_followed(base: str) -> None:
    assert get(f"{base}/redirect").status == 302


def test_the_body_is_bounded(base: str) -> None:
    big = get(f"{base}/big", max_bytes=1000)
    assert big.truncated and big.body == b"x" * 1000
    whole = get(f"{base}/big", max_bytes=10_000)
    assert not whole.truncated and len(whole.body) == 10_000


def test_no_answer_is_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(http_client.Unreachable):
            get(f"http://127.0.0.1:{port}/")
    with pytest.raises(http_client.Unreachable):
        get("not a url")


async def test_from_inside_a_running_loop(base: str) -> None:
    assert get(f"{base}/ok").status == 200
