"""A real OTLP/HTTP trace receiver, as a separate process, for tests and benchmarks.

``python -m tests.integration.otlp_receiver OUT`` serves ``POST /v1/traces`` on a free port
(printed first on stdout), decodes each ``application/x-protobuf`` body with the OTLP
protobuf definitions (``ExportTraceServiceRequest``), and appends every span to ``OUT`` as
one JSON line: service, trace / span / parent ids (hex), name, kind, start / end (epoch ns),
attributes, status code. Anything else is refused as a collector would (404, 405, 415, 400).

``otlp_receiver()`` starts one and yields a ``Receiver``: its ``url`` for
``[tracing] endpoint``, and ``spans()`` / ``wait_for()`` to read what arrived.

``--count`` (benchmarks): every body is parsed (protobuf), but its spans are only counted
(requests, spans, bytes by service); ``GET /stats`` answers the counts as JSON.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER",
         5: "CONSUMER"}
Span = dict[str, Any]


def _value(v: Any) -> Any:
    """An OTLP ``AnyValue`` as plain JSON."""
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, which) if which else None


def decode(body: bytes) -> list[Span]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    request = ExportTraceServiceRequest.FromString(body)
    out: list[Span] = []
    for rs in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append({
                    "service": resource.get("service.name", ""),
                    "scope": ss.scope.name,
                    "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                    "parent_span_id": s.parent_span_id.hex(), "name": s.name,
                    "kind": KINDS.get(s.kind, str(s.kind)),
                    "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                    "attributes": {kv.key: _value(kv.value) for kv in s.attributes},
                    "status": s.status.code, "flags": s.flags})
    return out


def serve(out_path: str | None) -> None:
    """Write spans to ``out_path``, or (None) only count them."""
    lock = threading.Lock()
    counts: dict[str, dict[str, int]] = {}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as a collector's

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _answer(self, status: int, body: bytes = b"",
                    content_type: str = "application/x-protobuf") -> None:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/stats" and out_path is None:
                with lock:
                    self._answer(200, json.dumps(counts).encode(), "application/json")
                return
            self._answer(405, b"use POST", "text/plain")

        def do_POST(self) -> None:
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                ExportTraceServiceResponse,
            )

            if self.path != "/v1/traces":
                self._answer(404, b"not found", "text/plain")
                return
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length)
            if self.headers.get("content-type", "").split(";")[0].strip() \
                    != "application/x-protobuf":
                self._answer(415, b"application/x-protobuf only", "text/plain")
                return
            if self.headers.get("content-encoding", "") == "gzip":
                body = gzip.decompress(body)
            try:
                if out_path is None:
                    count(body)
                    self._answer(200, ExportTraceServiceResponse().SerializeToString())
                    return
                spans = decode(body)
            except Exception as exc:  # noqa: BLE001 - a malformed body: the sender's fault
                self._answer(400, str(exc).encode(), "text/plain")
                return
            with lock, open(out_path, "a", encoding="utf-8") as f:
                for span in spans:
                    f.write(json.dumps(span) + "\n")
            self._answer(200, ExportTraceServiceResponse().SerializeToString())

    def count(body: bytes) -> None:
        """Parse the request (protobuf, as a collector does) and count its spans only."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        request = ExportTraceServiceRequest.FromString(body)
        with lock:
            for rs in request.resource_spans:
                service = next((kv.value.string_value for kv in rs.resource.attributes
                                if kv.key == "service.name"), "")
                c = counts.setdefault(service, {"requests": 0, "spans": 0, "bytes": 0})
                c["requests"] += 1
                c["bytes"] += len(body)
                c["spans"] += sum(len(ss.spans) for ss in rs.scope_spans)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


class Receiver:
    def __init__(self, url: str, path: Path) -> None:
        self.url = url
        self.path = path

    def spans(self) -> list[Span]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]

    def wait_for(self, found: Callable[[list[Span]], bool], timeout_s: float = 20.0
                 ) -> list[Span]:
        """Every span so far, once ``found`` says what was awaited has arrived."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if found(spans):
                return spans
            if time.monotonic() > deadline:
                raise TimeoutError(f"not arrived after {timeout_s} s ({len(spans)} spans)")
            time.sleep(0.05)  # polling another process's output file


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    with tempfile.TemporaryDirectory(prefix="otlp-") as tmp:
        out = Path(tmp) / "spans.jsonl"
        proc = subprocess.Popen([sys.executable, "-m", "tests.integration.otlp_receiver",
                                 str(out)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            port = int(proc.stdout.readline())
            yield Receiver(f"http://127.0.0.1:{port}/v1/traces", out)
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    serve(None if sys.argv[1] == "--count" else sys.argv[1])
