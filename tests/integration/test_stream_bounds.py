"""What one streamed body or one slow request body may hold, against a real ``sokuji serve``
(issue 25, finding 5 and the body timeout): replays of the attacks.

- Two chunked WAV streams trickling a byte at a time held both slots of ``vad``
  (``max_concurrency`` 2) until they closed, answering everyone else 429; now each ends at a
  timeout (408: its status, or its last line) and the slots come back.
- One tenant's streams cannot hold every slot (the per-tenant cap), and streams go through
  priority and deadline like any request.
- A body held open, or trickled, gets 408 instead of holding its request open.

Timeouts are configured small (a second or a few) to keep the tests fast; nothing here
asserts a duration, only which of the bounds ended what.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests

from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

WAV = (Path(__file__).resolve().parent.parent / "data" / "media" / "audio" / "talk16k.wav"
       ).read_bytes()
KEYS = {"acme": "key-acme-0001", "corp": "key-corp-0001", "bulk": "key-bulk-0001"}
CONFIG = f"""
builtin_pipelines = false
body_timeout_s = 3.0
body_idle_timeout_s = 1.0
[streams]
idle_timeout_s = 1.0
total_timeout_s = 3.0
[[models]]
name = "vad"
runtime = "vad"
max_batch_size = 4
max_concurrency = 2
max_request_bytes = 8388608
[[api_keys]]
key = "{KEYS['acme']}"
tenant = "acme"
[[api_keys]]
key = "{KEYS['corp']}"
tenant = "corp"
[[api_keys]]
key = "{KEYS['bulk']}"
tenant = "bulk"
priority = "batch"
max_priority = "batch"
"""
PATH = "/v2/models/vad/infer"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with sokuji_server(CONFIG) as base:
        yield base


class Stream:
    """One chunked upload over a raw socket, its response read as it comes."""

    def __init__(self, url: str, tenant: str, headers: dict[str, str] | None = None) -> None:
        parts = urlsplit(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
        self.reader = self.sock.makefile("rb")
        head = {"Content-Type": "audio/wav", "Accept": "application/x-ndjson",
                "X-API-Key": KEYS[tenant], **(headers or {})}
        self.sock.sendall((f"POST {PATH} HTTP/1.1\r\nHost: localhost\r\n"
                           "Transfer-Encoding: chunked\r\n"
                           + "".join(f"{k}: {v}\r\n" for k, v in head.items())
                           + "\r\n").encode())
        self._stop = threading.Event()
        self._trickler: threading.Thread | None = None

    def chunk(self, data: bytes) -> None:
        self.sock.sendall(b"%x\r\n%s\r\n" % (len(data), data))

    def status(self) -> tuple[int, dict[str, str]]:
        line = self.reader.readline()
        code = int(line.split()[1])
        headers = {}
        while (h := self.reader.readline()) not in (b"\r\n", b""):
            k, _, v = h.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        return code, headers

    def lines(self) -> list[dict[str, Any]]:
        """The rest of a chunked NDJSON body, as records."""
        body = b""
        while (size := int(self.reader.readline(), 16)) != 0:
            body += self.reader.read(size)
            self.reader.readline()
        self.reader.readline()  # the CRLF after the last chunk
        return [json.loads(x) for x in body.decode().splitlines()]

    def error(self, headers: dict[str, str]) -> dict[str, Any]:
        """A plain error reply's body (after ``status``)."""
        doc: dict[str, Any] = json.loads(self.reader.read(int(headers["content-length"])))
        return doc

    def trickle(self, every_s: float) -> None:
        """A byte of audio every ``every_s`` (a thread) until stopped or refused."""
        def run() -> None:
            i = 44
            while not self._stop.wait(every_s):
                try:
                    self.chunk(WAV[i:i + 1])
                except OSError:
                    return
                i += 1

        self._trickler = threading.Thread(target=run, daemon=True)
        self._trickler.start()

    def end(self) -> list[dict[str, Any]]:
        """End an admitted stream's body and read its answer to the end (its slot is free
        once its last line is sent)."""
        self.sock.sendall(b"0\r\n\r\n")
        return self.lines()

    def closed_by_server(self) -> bool:
        return self.reader.read(1) == b""

    def close(self) -> None:
        self._stop.set()
        if self._trickler is not None:
            self._trickler.join()
        self.reader.close()
        self.sock.close()


def plain(url: str, tenant: str) -> requests.Response:
    return requests.post(f"{url}{PATH}", data=WAV, timeout=60,
                         headers={"Content-Type": "audio/wav", "X-API-Key": KEYS[tenant]})


def test_trickling_streams_hold_their_slots_only_until_a_timeout(url: str) -> None:
    trickling, silent = Stream(url, "acme"), Stream(url, "corp")
    try:
        for s in (trickling, silent):
            s.chunk(WAV[:44])  # the header: the stream is admitted and answers 200
            assert s.status()[0] == 200
        locked_out = plain(url, "bulk")
        assert locked_out.status_code == 429, locked_out.text  # both slots are held
        trickling.trickle(0.25)  # never idle: only the total timeout can end it
        idle_end = silent.lines()[-1]
        assert idle_end["status"] == 408 and "streams.idle_timeout_s" in idle_end["error"]
        total_end = trickling.lines()[-1]
        assert total_end["status"] == 408 and "streams.total_timeout_s" in total_end["error"]
        assert silent.closed_by_server() and trickling.closed_by_server()
    finally:
        trickling.close()
        silent.close()
    r = plain(url, "bulk")  # before the fix: 429 for as long as the streams trickled
    assert r.status_code == 200, r.text


def test_a_stream_silent_before_its_header_is_a_408(url: str) -> None:
    s = Stream(url, "acme")
    try:
        s.chunk(WAV[:10])
        code, headers = s.status()
        assert code == 408 and headers.get("connection") == "close"
        assert "streams.idle_timeout_s" in s.error(headers)["error"]
    finally:
        s.close()
    assert plain(url, "acme").status_code == 200


def test_one_tenant_cannot_hold_every_slot(url: str) -> None:
    first = Stream(url, "acme")
    try:
        first.chunk(WAV[:44])
        assert first.status()[0] == 200
        second = Stream(url, "acme")  # max_concurrency 2: acme's cap is 1
        try:
            second.chunk(WAV[:44])
            code, headers = second.status()
            assert code == 429 and headers["retry-after"] == "1"
            assert "streams.max_per_tenant" in second.error(headers)["error"]
        finally:
            second.close()
        r = plain(url, "corp")  # before the fix: 429 behind acme's two streams
        assert r.status_code == 200, r.text
        other = Stream(url, "corp")
        try:
            other.chunk(WAV[:44])
            assert other.status()[0] == 200
            other.end()
        finally:
            other.close()
        first.end()
    finally:
        first.close()


def test_a_batch_stream_leaves_the_last_slot_to_interactive_work(url: str) -> None:
    alone = Stream(url, "bulk")
    try:
        alone.chunk(WAV[:44])
        assert alone.status()[0] == 200  # an idle model admits it
        alone.end()
    finally:
        alone.close()
    held = Stream(url, "acme")
    try:
        held.chunk(WAV[:44])
        assert held.status()[0] == 200
        batch = Stream(url, "bulk")
        try:
            batch.chunk(WAV[:44])
            code, headers = batch.status()
            assert code == 429 and "kept for interactive" in batch.error(headers)["error"]
        finally:
            batch.close()
        asked = Stream(url, "corp", {"X-Sokuji-Priority": "batch"})
        try:
            asked.chunk(WAV[:44])
            assert asked.status()[0] == 429  # the priority header counts the same way
        finally:
            asked.close()
        assert plain(url, "corp").status_code == 200  # the last slot is there for it
        held.end()
    finally:
        held.close()


def test_a_stream_past_its_deadline_is_refused_504(url: str) -> None:
    s = Stream(url, "acme", {"X-Sokuji-Timeout-Ms": "0.001"})
    try:
        s.chunk(WAV[:44])
        code, headers = s.status()
        assert code == 504, s.error(headers)  # before the fix: 200, the deadline ignored
        assert s.error(headers)["code"] == "deadline_exceeded"
    finally:
        s.close()


def _held_body(url: str, send: Any, extra: str = ""
               ) -> tuple[int, dict[str, str], dict[str, Any], bool]:
    """POST a plain upload declaring all of ``WAV``, ``send(sock)`` sending part of it."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall((f"POST {PATH} HTTP/1.1\r\nHost: localhost\r\nContent-Type: audio/wav\r\n"
                      f"X-API-Key: {KEYS['acme']}\r\nContent-Length: {len(WAV)}\r\n{extra}"
                      "\r\n").encode())
        send(sock)
        reader = sock.makefile("rb")
        code = int(reader.readline().split()[1])
        headers = {}
        while (h := reader.readline()) not in (b"\r\n", b""):
            k, _, v = h.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        doc = json.loads(reader.read(int(headers["content-length"])))
        closed = reader.read(1) == b""
        reader.close()
    return code, headers, doc, closed


@pytest.mark.parametrize("extra", ["", "Prefer: respond-async\r\n"], ids=["infer", "job"])
def test_a_body_held_open_is_a_408(url: str, extra: str) -> None:
    code, headers, doc, closed = _held_body(url, lambda s: s.sendall(WAV[:len(WAV) // 2]),
                                            extra)
    assert code == 408 and doc["code"] == "request_timeout", doc
    assert "body_idle_timeout_s" in doc["error"]
    assert headers.get("connection") == "close" and closed


def test_a_trickled_body_is_a_408(url: str) -> None:
    stop = threading.Event()

    def trickle(sock: socket.socket) -> None:
        def run() -> None:
            for i in range(len(WAV)):
                if stop.wait(0.25):
                    return
                try:
                    sock.sendall(WAV[i:i + 1])
                except OSError:
                    return

        threading.Thread(target=run, daemon=True).start()

    try:
        code, _, doc, closed = _held_body(url, trickle)
    finally:
        stop.set()
    assert code == 408 and "body_timeout_s" in doc["error"], doc
    assert closed
