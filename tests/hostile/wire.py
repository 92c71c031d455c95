"""HTTP/1.1 by hand, for requests no client library sends: a Content-Length that lies, a
body sent in part and held, a chunked body trickled. One connection per request."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import orjson


@dataclass
class Answer:
    """A response as read off the socket; ``status`` None: the server closed the
    connection (or sent nothing before ``timeout``) without answering."""

    status: int | None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    seconds: float = 0.0

    def reason(self) -> str:
        """The error's message, whichever protocol's format it has (V2 or OpenAI)."""
        try:
            doc = orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return self.body.decode("utf-8", "replace").strip()
        error = doc.get("error") if isinstance(doc, dict) else None
        if isinstance(error, dict):
            return str(error.get("message") or "")
        return str(error or doc.get("detail") or "")


def connect(url: str, timeout: float) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80),
                                    timeout=timeout)
    return sock


def head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def read_answer(sock: socket.socket, timeout: float, t0: float | None = None) -> Answer:
    """The response on ``sock`` (``Connection: close``: the body runs to the end)."""
    start = time.monotonic() if t0 is None else t0
    sock.settimeout(timeout)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    seconds = time.monotonic() - start
    if not data.startswith(b"HTTP/1."):
        return Answer(None, seconds=seconds)
    top, _, body = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = _unchunk(body)
    return Answer(status, headers, body, seconds)


def _unchunk(raw: bytes) -> bytes:
    out, rest = b"", raw
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            break
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2:]
    return out


def send(url: str, path: str, headers: dict[str, str], body: bytes,
         content_length: int | None = None, timeout: float = 30.0,
         half_close: bool = False) -> Answer:
    """POST ``body`` with ``Content-Length: content_length`` (by default its true length);
    ``half_close``: shut the sending side after the body (the server sees the end)."""
    sock = connect(url, timeout)
    try:
        length = len(body) if content_length is None else content_length
        t0 = time.monotonic()
        sock.sendall(head(path, {**headers, "Content-Length": str(length)}) + body)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        return read_answer(sock, timeout, t0)
    finally:
        sock.close()


def chunked(url: str, path: str, headers: dict[str, str], body: bytes,
            timeout: float = 30.0) -> Answer:
    """POST ``body`` chunked (no Content-Length), in 64 KiB chunks."""
    sock = connect(url, timeout)
    try:
        t0 = time.monotonic()
        sock.sendall(head(path, {**headers, "Transfer-Encoding": "chunked"}))
        for i in range(0, len(body), 65536):
            part = body[i:i + 65536]
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))
            except (BrokenPipeError, ConnectionResetError):
                break  # refused before the end: its answer is waiting
        else:
            sock.sendall(b"0\r\n\r\n")
        return read_answer(sock, timeout, t0)
    finally:
        sock.close()


def held(url: str, path: str, headers: dict[str, str], body: bytes,
         wait_s: float) -> Answer:
    """Send the headers and half of ``body`` (its Content-Length the whole), then hold the
    connection open for up to ``wait_s``: what the server answers meanwhile."""
    sock = connect(url, wait_s + 5)
    try:
        t0 = time.monotonic()
        sock.sendall(head(path, {**headers, "Content-Length": str(len(body))})
                     + body[:len(body) // 2])
        return read_answer(sock, wait_s, t0)
    finally:
        sock.close()


def trickle(url: str, path: str, headers: dict[str, str], first: bytes,
            wait_s: float, every_s: float = 1.0) -> Answer:
    """Open a chunked stream, send ``first``, then one byte every ``every_s`` for up to
    ``wait_s``, reading whatever the server answers (an idle or total timeout ends it)."""
    sock = connect(url, every_s + 5)
    try:
        t0 = time.monotonic()
        sock.sendall(head(path, {**headers, "Transfer-Encoding": "chunked"})
                     + b"%x\r\n%s\r\n" % (len(first), first))
        data = b""
        sock.settimeout(every_s)
        while time.monotonic() - t0 < wait_s:
            try:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
            except TimeoutError:
                pass
            except ConnectionResetError:  # the server ended it (closed with our bytes unread)
                break
            try:
                sock.sendall(b"1\r\n\x00\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
        if b"\r\n\r\n" not in data:
            return Answer(None, seconds=time.monotonic() - t0)
        status = int(data.split(b"\r\n", 1)[0].split()[1])
        return Answer(status, body=data.partition(b"\r\n\r\n")[2],
                      seconds=time.monotonic() - t0)
    finally:
        sock.close()
