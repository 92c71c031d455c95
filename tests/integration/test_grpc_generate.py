"""Generators over gRPC (``server/grpc_generate.py``): a real ``sokuji serve`` with the
shipped SmolLM2, driven by ``tritonclient.grpc`` unchanged. A stream answers a response per
token chunk then the final flag, its text equals REST's for the same greedy prompt; a
cancelled stream stops its generation and frees its slot; errors come in-stream."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import CACHE_DIR
from tests.integration.serving import free_port, sokuji_server

pytestmark = pytest.mark.integration

PROMPT = "The three primary colors are"
COUNTING = "Count from 1 to 1000, separated by commas: 1, 2, 3, 4, 5,"


class Server:
    def __init__(self, http: str, grpc_address: str) -> None:
        self.http = http
        self.grpc = grpc_address


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    port = free_port()
    with sokuji_server(f"""cache_dir = "{CACHE_DIR}"
grpc_port = {port}
[[models]]
name = "smollm2"
runtime = "llama"
cache = false
[models.options]
slots = 1
context_size = 256
max_new_tokens = 64
""") as url:
        yield Server(url, f"127.0.0.1:{port}")


def inputs(prompt: str, max_tokens: int | None = 6) -> list[Any]:
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    out = [text]
    if max_tokens is not None:
        mt = grpcclient.InferInput("max_tokens", [1], "INT32")
        mt.set_data_from_numpy(np.array([max_tokens], dtype=np.int32))
        out.append(mt)
    return out


def rest(server: Server, prompt: str, max_tokens: int = 6) -> str:
    r = httpx.post(f"{server.http}/v1/completions", json={
        "model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0},
        timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def metric(server: Server, name: str) -> float:
    text = httpx.get(f"{server.http}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and 'model="smollm2"' in line)


def collect(client: grpcclient.InferenceServerClient, results: queue.Queue[Any],
            **kwargs: Any) -> list[Any]:
    """One request's responses, up to the one flagged final (or an error)."""
    client.async_stream_infer("smollm2", **kwargs)
    got = []
    while True:
        result, error = results.get(timeout=60)
        if error is not None:
            got.append(error)
            return got
        got.append(result)
        if result.get_response().parameters["triton_final_response"].bool_param:
            return got


@pytest.fixture()
def stream(server: Server) -> Iterator[tuple[grpcclient.InferenceServerClient, queue.Queue[Any]]]:
    client = grpcclient.InferenceServerClient(server.grpc)
    results: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    yield client, results
    client.stop_stream()
    client.close()


def text_of(result: Any) -> str:
    out = result.as_numpy("text_output")
    return "" if out is None else "".join(x.decode() for x in out.ravel())


@pytest.mark.parametrize("empty_final", [True, False])
def test_stream_chunks_then_final_equal_rest(server: Server, stream: Any,
                                             empty_final: bool) -> None:
    client, results = stream
    want = rest(server, PROMPT)
    got = collect(client, results, inputs=inputs(PROMPT), parameters={"temperature": 0.0},
                  enable_empty_final_response=empty_final, request_id="r1")
    assert not any(isinstance(r, InferenceServerException) for r in got), got
    final = got[-1].get_response()
    assert final.parameters["finish_reason"].string_param == "length"
    assert final.parameters["completion_tokens"].int64_param == 6
    assert final.id == "r1" and final.model_name == "smollm2"
    if empty_final:
        assert text_of(got[-1]) == "" and not final.outputs
        chunks = [text_of(r) for r in got[:-1]]
    else:
        chunks = [text_of(r) for r in got]
    assert len(chunks) >= 2 and all(chunks)
    assert not any(r.get_response().parameters["triton_final_response"].bool_param
                   for r in got[:-1])
    assert "".join(chunks) == want


def test_model_infer_equals_rest_and_metadata(server: Server) -> None:
    client = grpcclient.InferenceServerClient(server.grpc)
    want = rest(server, PROMPT, 5)
    result = client.infer("smollm2", inputs(PROMPT, 5), parameters={"temperature": 0.0})
    assert text_of(result) == want
    assert result.get_response().parameters["triton_final_response"].bool_param
    # the generation's stages as trailing server-timing, as REST's header and a tensor
    # model's ModelInfer carry them
    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        req = service_pb2.ModelInferRequest(model_name="smollm2")
        req.inputs.add(name="text_input", datatype="BYTES", shape=[1]) \
            .contents.bytes_contents.append(PROMPT.encode())
        req.parameters["max_tokens"].int64_param = 3
        _, call = stub.ModelInfer.with_call(req, timeout=60)
    timing = dict(call.trailing_metadata())["server-timing"]
    assert "ttft;dur=" in timing and "total;dur=" in timing, timing
    meta = client.get_model_metadata("smollm2")
    assert [t.name for t in meta.inputs] == ["text_input"]
    assert [t.name for t in meta.outputs] == ["text_output"]
    config = client.get_model_config("smollm2").config
    assert config.model_transaction_policy.decoupled
    # stream: true over ModelInfer is refused (one response only), by name
    with pytest.raises(InferenceServerException, match="stream"):
        client.infer("smollm2", inputs(PROMPT, 5), parameters={"stream": True})


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"inputs": "big"}, "limit of 64 new tokens"),
    ({"inputs": "none", "parameters": {"max_tokens": 4}}, "text_input"),
    ({"inputs": "ok", "parameters": {"temperature": 9.0}}, "temperature"),
    ({"inputs": "ok", "parameters": {"beam_width": 2}}, "beam_width"),
    ({"inputs": "two"}, "one prompt per request"),
])
def test_errors_in_stream(server: Server, stream: Any, kwargs: dict[str, Any],
                          needle: str) -> None:
    client, results = stream
    which = kwargs.pop("inputs")
    if which == "big":
        ins = inputs(PROMPT, 1000)
    elif which == "none":
        ins = inputs(PROMPT, 4)[1:]
    elif which == "two":
        two = grpcclient.InferInput("text_input", [2], "BYTES")
        two.set_data_from_numpy(np.array([b"a", b"b"], dtype=np.object_))
        ins = [two]
    else:
        ins = inputs(PROMPT, 4)
    got = collect(client, results, inputs=ins, **kwargs)
    assert len(got) == 1 and isinstance(got[0], InferenceServerException), got
    assert needle in got[0].message()
    # the stream goes on: the next request on it is answered
    ok = collect(client, results, inputs=inputs(PROMPT, 2), parameters={"temperature": 0.0})
    assert not isinstance(ok[-1], InferenceServerException)


def test_cancel_stops_the_generation_and_frees_the_slot(server: Server) -> None:
    cancelled = metric(server, 'sokuji_requests_total{model="smollm2",status="499"}')
    client = grpcclient.InferenceServerClient(server.grpc)
    results: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("smollm2", inputs(COUNTING, 64),
                              parameters={"temperature": 0.0, "ignore_eos": True})
    for _ in range(3):  # a few chunks: it is generating
        result, error = results.get(timeout=60)
        assert error is None and text_of(result)
    assert metric(server, "sokuji_llm_running_sequences") == 1
    client.stop_stream(cancel_requests=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
            metric(server, 'sokuji_requests_total{model="smollm2",status="499"}') == cancelled
            or metric(server, "sokuji_llm_running_sequences") != 0):
        time.sleep(0.05)  # polling the server's own counters
    assert metric(server, 'sokuji_requests_total{model="smollm2",status="499"}') \
        == cancelled + 1
    assert metric(server, "sokuji_llm_running_sequences") == 0
    # the one slot is free: the next request is served (REST's text, greedy)
    again = grpcclient.InferenceServerClient(server.grpc)
    assert text_of(again.infer("smollm2", inputs(PROMPT, 4),
                               parameters={"temperature": 0.0})) == rest(server, PROMPT, 4)
