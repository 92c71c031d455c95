"""KServe V2 over gRPC (``server/grpc_v2.py``): a real ``sokuji serve`` with ``grpc_port``,
driven by ``tritonclient.grpc`` unchanged (sync and ``aio``) and by the raw stubs where a
test needs a message tritonclient would not send. Every answer is compared with the REST
answer for the same input (``tritonclient.http``); each bad input is a gRPC status with a
message; a REST and a gRPC request queued together run in one batch."""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from tests import tensor_graphs as graphs
from tests.conftest import CACHE_DIR, ROOT
from tests.integration.serving import free_port, sokuji_server

pytestmark = pytest.mark.integration

KEY, OTHER = "grpc-test-key-1", "grpc-test-key-2"
AUTH = {"authorization": f"Bearer {KEY}"}
META = (("authorization", f"Bearer {KEY}"),)
LIMIT = 256 * 1024
OWN_LIMIT = 8 * 1024
"""``strings``' own ``max_request_bytes``: under the server's (the gRPC message limit)."""
TEXTS = np.array([["a first sentence"], ["and the second, a bit longer"]], dtype=np.object_)


class Server:
    def __init__(self, http: str, grpc_address: str) -> None:
        self.http = http
        self.grpc = grpc_address
        self.rest = httpclient.InferenceServerClient(http, concurrency=4)
        self.client = grpcclient.InferenceServerClient(grpc_address)
        self.channel = grpc.insecure_channel(grpc_address)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("graphs")
    every, strings = graphs.write_every_type(d), graphs.write_strings(d)
    port = free_port()
    entry = ROOT / "tests" / "data" / "pymodels" / "grpc_batch.py"
    echo = ROOT / "tests" / "data" / "pymodels" / "core_forms.py"
    with sokuji_server(f"""
cache_dir = "{CACHE_DIR}"
grpc_port = {port}
max_request_bytes = {LIMIT}
[[api_keys]]
key = "{KEY}"
tenant = "t1"
admin = true
[[api_keys]]
key = "{OTHER}"
tenant = "t2"
models = ["echo"]
[[models]]
name = "minilm"
max_batch_size = 16
intra_op_threads = 1
[[models]]
name = "every"
runtime = "tensor"
path = "{every}"
max_batch_size = 8
intra_op_threads = 1
cache = false
[[models]]
name = "strings"
runtime = "tensor"
path = "{strings}"
max_batch_size = 8
intra_op_threads = 1
max_request_bytes = {OWN_LIMIT}
[[models]]
name = "batch"
runtime = "python"
max_batch_size = 8
inline_max_ms = 0.0
cache = false
[models.options]
entry = "{entry}:BatchSize"
pause_s = 0.3
[[models]]
name = "queue"
runtime = "python"
max_batch_size = 1
max_queue_depth = 1
inline_max_ms = 0.0
cache = false
[models.options]
entry = "{entry}:BatchSize"
pause_s = 0.4
[[models]]
name = "echo"
runtime = "python"
max_batch_size = 8
[models.options]
entry = "{echo}:Echo"
""") as url:
        s = Server(url.removeprefix("http://"), f"127.0.0.1:{port}")
        yield s
        s.client.close()
        s.channel.close()


def _inputs(module: Any, arrays: dict[str, np.ndarray]) -> list[Any]:
    """``module``'s (tritonclient.http / grpc / grpc.aio) InferInputs of ``arrays``."""
    out = []
    for name, array in arrays.items():
        tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def _status(call: Any) -> tuple[str, str]:
    """The gRPC status name and message tritonclient raised."""
    with pytest.raises(InferenceServerException) as info:
        call()
    return str(info.value.status()), info.value.message()


def _raw(stub: Any, request: Any, metadata: Any = META) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, metadata=metadata)
    return info.value


def test_health_and_metadata(server: Server) -> None:
    c = server.client
    assert c.is_server_live() and c.is_server_ready()
    assert c.is_model_ready("minilm", headers=dict(AUTH))
    assert c.get_server_metadata().name == "sokuji"
    for name in ("minilm", "every", "strings"):
        got = c.get_model_metadata(name, headers=dict(AUTH), as_json=True)
        want = server.rest.get_model_metadata(name, headers=dict(AUTH))
        assert got["name"] == want["name"] and got["versions"] == want["versions"]
        for side in ("inputs", "outputs"):
            assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]])
                    for t in got[side]] == \
                [(t["name"], t["datatype"], t["shape"]) for t in want[side]]


def test_minilm_equals_rest(server: Server) -> None:
    inputs = _inputs(grpcclient, {"text": TEXTS})
    res = server.client.infer("minilm", inputs, request_id="g-1", headers=dict(AUTH),
                              outputs=[grpcclient.InferRequestedOutput("embedding")])
    emb = res.as_numpy("embedding")
    assert emb.shape == (2, 384) and emb.dtype == np.float32
    assert res.get_response().id == "g-1"
    rest = server.rest.infer("minilm", _inputs(httpclient, {"text": TEXTS}), headers=dict(AUTH))
    np.testing.assert_allclose(emb, rest.as_numpy("embedding"), atol=1e-5)
    # typed contents (bytes_contents) as well as raw, and the trailing server-timing
    req = service_pb2.ModelInferRequest(model_name="minilm")
    tensor = req.inputs.add(name="text", datatype="BYTES", shape=[2])
    tensor.contents.bytes_contents.extend(t.encode() for t in TEXTS.reshape(-1))
    response, call = server.stub.ModelInfer.with_call(req, metadata=META)
    typed = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(2, 384)
    np.testing.assert_allclose(typed, emb, atol=1e-5)
    trailing = dict(call.trailing_metadata())
    assert "infer;dur=" in trailing["server-timing"]


def test_every_datatype_equals_rest(server: Server) -> None:
    arrays = {f"x_{dt}": graphs.sample(dt, (2, 3), seed=i) for i, dt in enumerate(graphs.EVERY)}
    arrays["c_INT32"] = graphs.sample("INT32", (2, 3), seed=99)
    res = server.client.infer("every", _inputs(grpcclient, arrays), headers=dict(AUTH))
    rest = server.rest.infer("every", _inputs(httpclient, arrays), headers=dict(AUTH))
    for dt in graphs.EVERY:
        got, want = res.as_numpy(f"y_{dt}"), rest.as_numpy(f"y_{dt}")
        assert got.shape == (2, 3) and got.dtype == want.dtype, dt
        np.testing.assert_array_equal(got, want)
        if dt != "BYTES":
            np.testing.assert_array_equal(got, arrays[f"x_{dt}"])
    np.testing.assert_array_equal(res.as_numpy("c_FP64"), arrays["c_INT32"].astype(np.float64))
    # requested outputs: only those named come back
    one = server.client.infer("every", _inputs(grpcclient, arrays), headers=dict(AUTH),
                              outputs=[grpcclient.InferRequestedOutput("y_INT8")])
    assert [o.name for o in one.get_response().outputs] == ["y_INT8"]


def test_typed_contents_every_datatype(server: Server) -> None:
    """The typed ``contents`` fields (no raw contents) decode as raw ones do (the Python
    echo model gives each array back as it came); FP16 has none; typed and raw do not mix."""
    field = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
             "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
             "UINT16": "uint_contents", "UINT32": "uint_contents",
             "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents"}
    req = service_pb2.ModelInferRequest(model_name="echo")
    arrays = {}
    for i, dt in enumerate(field):
        arrays[f"x_{dt}"] = array = graphs.sample(dt, (2, 3), seed=i)
        t = req.inputs.add(name=f"x_{dt}", datatype=dt, shape=[2, 3])
        getattr(t.contents, field[dt]).extend(array.reshape(-1).tolist())
    res = grpcclient.InferResult(server.stub.ModelInfer(req, metadata=META))
    for name, array in arrays.items():
        got = res.as_numpy(name)
        assert got.dtype == array.dtype, name
        np.testing.assert_array_equal(got, array)
    t = req.inputs.add(name="x_FP16", datatype="FP16", shape=[1])
    t.contents.fp32_contents.append(1.0)
    error = _raw(server.stub, req)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "FP16" in error.details() and "raw_input_contents" in error.details()
    mixed = service_pb2.ModelInferRequest(model_name="echo")
    t = mixed.inputs.add(name="a", datatype="INT32", shape=[1])
    t.contents.int_contents.append(1)
    mixed.inputs.add(name="b", datatype="INT32", shape=[1])
    mixed.raw_input_contents.append(np.int32(2).tobytes())
    error = _raw(server.stub, mixed)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "raw_input_contents" in error.details()
    req2 = service_pb2.ModelInferRequest(model_name="strings")
    t = req2.inputs.add(name="text", datatype="BYTES", shape=[2])
    t.contents.bytes_contents.extend([b"ab", b"c"])
    res = grpcclient.InferResult(server.stub.ModelInfer(req2, metadata=META))
    rest = server.rest.infer("strings", _inputs(httpclient, {
        "text": np.array(["ab", "c"], dtype=object)}), headers=dict(AUTH))
    np.testing.assert_array_equal(res.as_numpy("shout"), rest.as_numpy("shout"))


def test_python_model_equals_rest(server: Server) -> None:
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    res = server.client.infer("echo", _inputs(grpcclient, {"x": x}), headers=dict(AUTH))
    rest = server.rest.infer("echo", _inputs(httpclient, {"x": x}), headers=dict(AUTH))
    np.testing.assert_array_equal(res.as_numpy("x"), rest.as_numpy("x"))
    np.testing.assert_array_equal(res.as_numpy("x"), x)
    assert res.as_numpy("types").tolist() == rest.as_numpy("types").tolist()


def test_aio_client(server: Server) -> None:
    async def main() -> list[np.ndarray]:
        client = aioclient.InferenceServerClient(server.grpc)
        try:
            assert await client.is_server_live()
            results = await asyncio.gather(*(
                client.infer("minilm", _inputs(aioclient, {"text": TEXTS}), headers=dict(AUTH))
                for _ in range(4)))
            return [r.as_numpy("embedding") for r in results]
        finally:
            await client.close()

    embs = asyncio.run(main())
    for emb in embs[1:]:
        np.testing.assert_allclose(emb, embs[0], atol=1e-5)


def test_bad_input(server: Server) -> None:
    c = server.client
    code, message = _status(lambda: c.infer("nope", _inputs(grpcclient, {"text": TEXTS}),
                                            headers=dict(AUTH)))
    assert code == "StatusCode.NOT_FOUND" and "nope" in message
    code, message = _status(lambda: c.infer("minilm", _inputs(grpcclient, {
        "text": np.ones((2, 1), np.float32)}), headers=dict(AUTH)))
    assert code == "StatusCode.INVALID_ARGUMENT" and "datatype" in message
    code, message = _status(lambda: c.infer("minilm", _inputs(grpcclient, {
        "text": np.array([[["a"]]], dtype=object)}), headers=dict(AUTH)))
    assert code == "StatusCode.INVALID_ARGUMENT" and "shape" in message
    code, message = _status(lambda: c.infer(
        "minilm", _inputs(grpcclient, {"text": TEXTS}), headers=dict(AUTH),
        outputs=[grpcclient.InferRequestedOutput("nothing")]))
    assert code == "StatusCode.INVALID_ARGUMENT" and "nothing" in message
    # a raw content whose size disagrees with shape x datatype
    req = service_pb2.ModelInferRequest(model_name="every")
    for dt in (*graphs.EVERY, "c"):
        name = f"x_{dt}" if dt != "c" else "c_INT32"
        req.inputs.add(name=name, datatype=dt if dt != "c" else "INT32", shape=[1, 3])
        req.raw_input_contents.append(b"\0" * 3 * (4 if dt in ("c", "INT32") else 1))
    error = _raw(server.stub, req)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "x_UINT16" in error.details() and "3 bytes" in error.details(), error.details()
    # too large: over max_request_bytes, refused by gRPC before it is parsed
    big = np.array([["x" * (LIMIT + 10)]], dtype=object)
    code, message = _status(lambda: c.infer("minilm", _inputs(grpcclient, {"text": big}),
                                            headers=dict(AUTH)))
    assert code == "StatusCode.RESOURCE_EXHAUSTED" and "larger than max" in message
    # keys: none, unknown, a tenant that may not use the model
    for headers, want in ((None, "UNAUTHENTICATED"), ({"authorization": "Bearer nokey123"},
                                                      "UNAUTHENTICATED"),
                          ({"authorization": f"Bearer {OTHER}"}, "PERMISSION_DENIED")):
        code, message = _status(lambda h=headers: c.infer(
            "minilm", _inputs(grpcclient, {"text": TEXTS}), headers=h))
        assert code == f"StatusCode.{want}" and message, (headers, message)
    code, _ = _status(lambda: c.get_model_metadata("minilm"))
    assert code == "StatusCode.UNAUTHENTICATED"
    code, _ = _status(lambda: c.get_inference_statistics(
        "echo", headers={"authorization": f"Bearer {OTHER}"}))
    assert code == "StatusCode.PERMISSION_DENIED"


def test_config_and_statistics(server: Server) -> None:
    got = server.client.get_model_config("minilm", headers=dict(AUTH), as_json=True)["config"]
    want = server.rest.get_model_config("minilm", headers=dict(AUTH))
    assert got["name"] == want["name"] and int(got["max_batch_size"]) == \
        want["max_batch_size"]
    assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in got["input"]] \
        == [(t["name"], t["data_type"], t["dims"]) for t in want["input"]]
    assert got["parameters"] == want["parameters"]
    server.client.infer("strings", _inputs(grpcclient, {
        "text": np.array(["s"], dtype=object)}), headers=dict(AUTH))
    stats = server.client.get_inference_statistics("strings", headers=dict(AUTH), as_json=True)
    rest = server.rest.get_inference_statistics("strings", headers=dict(AUTH))
    g, r = stats["model_stats"][0], rest["model_stats"][0]
    assert g["name"] == r["name"] == "strings" and g["version"] == r["version"]
    assert int(g["inference_count"]) == r["inference_count"] >= 1
    assert int(g["inference_stats"]["success"]["count"]) == \
        r["inference_stats"]["success"]["count"]


def test_rest_and_grpc_share_a_batch(server: Server) -> None:
    """One request holds the model (0.3 s); a REST and a gRPC request sent meanwhile queue and
    run as one batch of two: each answer says the size of the batch it ran in."""
    x = np.ones((1, 2), np.float32)

    def rest() -> int:  # (a client of its own: tritonclient.http's is one thread's)
        client = httpclient.InferenceServerClient(server.http)
        return int(client.infer("batch", _inputs(httpclient, {"x": x}),
                                     headers=dict(AUTH)).as_numpy("n")[0])

    def grpc_() -> int:
        return int(server.client.infer("batch", _inputs(grpcclient, {"x": x}),
                                       headers=dict(AUTH)).as_numpy("n")[0])

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = pool.submit(rest)
        time.sleep(0.1)
        both = [pool.submit(rest), pool.submit(grpc_)]
        assert first.result() == 1
        assert [f.result() for f in both] == [2, 2]
    # a deadline (Triton's ``timeout`` parameter, microseconds) passed while queued: 504 ->
    # DEADLINE_EXCEEDED from the server, with its message
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        held = pool.submit(rest)
        time.sleep(0.1)
        code, message = _status(lambda: server.client.infer(
            "batch", _inputs(grpcclient, {"x": x}), headers=dict(AUTH), timeout=20_000))
        held.result()
    assert code == "StatusCode.DEADLINE_EXCEEDED" and "deadline" in message.lower()
    # the gRPC deadline is the request's: one that passes while queued never runs
    def count() -> int:
        stats = server.client.get_inference_statistics("batch", headers=dict(AUTH))
        return int(stats.model_stats[0].inference_count)

    before = count()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        held = pool.submit(rest)
        time.sleep(0.1)
        code, _ = _status(lambda: server.client.infer(
            "batch", _inputs(grpcclient, {"x": x}), headers=dict(AUTH), client_timeout=0.05))
        held.result()
    time.sleep(0.4)  # (a request wrongly kept would have run by now)
    assert code == "StatusCode.DEADLINE_EXCEEDED" and count() == before + 1


def test_port_taken(server: Server, tmp_path: Path) -> None:
    """The server refuses a port already taken (no SO_REUSEPORT sharing)."""
    import subprocess
    import sys

    port = int(server.grpc.rsplit(":", 1)[1])
    config = tmp_path / "s.toml"
    config.write_text(f'port = {free_port()}\ngrpc_port = {port}\ncache_dir = "{tmp_path}"\n'
                      '[[models]]\nname = "echo"\nruntime = "python"\n[models.options]\n'
                      f'entry = "{ROOT}/tests/data/pymodels/core_forms.py:Echo"\n')
    proc = subprocess.run([sys.executable, "-m", "sokuji", "serve", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "grpc_port" in proc.stderr, proc.stderr[-2000:]


def test_overload_retry_after(server: Server) -> None:
    """A full queue: 429 -> RESOURCE_EXHAUSTED, its Retry-After as trailing metadata."""
    x = np.ones((1, 2), np.float32)

    def rest() -> Any:
        client = httpclient.InferenceServerClient(server.http)
        try:
            return client.infer("queue", _inputs(httpclient, {"x": x}), headers=dict(AUTH))
        except InferenceServerException as exc:
            return exc

    req = service_pb2.ModelInferRequest(model_name="queue")
    req.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    req.raw_input_contents.append(x.tobytes())
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        held = [pool.submit(rest)]
        time.sleep(0.1)
        held.append(pool.submit(rest))
        time.sleep(0.1)
        error = _raw(server.stub, req)
        for f in held:
            f.result()
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert int(dict(error.trailing_metadata())["retry-after"]) >= 1
    assert error.details()


def test_stream_infer(server: Server) -> None:
    """ModelStreamInfer (tritonclient's start_stream / async_stream_infer): one response per
    request, equal to ModelInfer's; a bad request's error in the stream, which goes on."""
    results: list[Any] = []
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: results.append((result, error)),
                        headers=dict(AUTH))
    for i in range(3):
        client.async_stream_infer("minilm", _inputs(grpcclient, {"text": TEXTS}),
                                  request_id=f"s-{i}")
    client.async_stream_infer("minilm", _inputs(grpcclient, {
        "text": np.ones((2, 1), np.float32)}), request_id="bad")
    client.async_stream_infer("strings", _inputs(grpcclient, {
        "text": np.array(["q"], dtype=object)}), request_id="s-3")
    client.stop_stream()
    client.close()
    assert len(results) == 5
    good = {r.get_response().id: r for r, e in results if e is None}
    errors = [e for r, e in results if e is not None]
    assert sorted(good) == ["s-0", "s-1", "s-2", "s-3"]
    assert len(errors) == 1 and "datatype" in errors[0].message()
    want = server.client.infer("minilm", _inputs(grpcclient, {"text": TEXTS}),
                               headers=dict(AUTH)).as_numpy("embedding")
    for i in range(3):
        np.testing.assert_allclose(good[f"s-{i}"].as_numpy("embedding"), want, atol=1e-5)


def test_over_a_models_own_limit_is_refused_before_decoding(server: Server) -> None:
    """A message under gRPC's limit (the largest of any model's) but over ``strings``' own:
    RESOURCE_EXHAUSTED naming the limit, though its input is of the wrong datatype (decoding
    would have said INVALID_ARGUMENT); the same input under the limit: INVALID_ARGUMENT."""
    def request(size: int) -> Any:
        req = service_pb2.ModelInferRequest(model_name="strings")
        req.inputs.add(name="text", datatype="FP32", shape=[size // 4])
        req.raw_input_contents.append(b"\0" * (size // 4 * 4))
        return req

    error = _raw(server.stub, request(OWN_LIMIT + 64))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert "max_request_bytes" in error.details() and "strings" in error.details()
    error = _raw(server.stub, request(OWN_LIMIT // 2))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "datatype" in error.details()
    ok = server.client.infer("strings", _inputs(grpcclient, {
        "text": np.array(["s"], dtype=object)}), headers=dict(AUTH))
    assert ok.as_numpy("shout").tolist() == [b"s!"]


def test_repository_index_load_and_unload(server: Server) -> None:
    """The repository RPCs, as tritonclient.grpc calls them, against the REST answers."""
    c = server.client
    index = c.get_model_repository_index(headers=dict(AUTH), as_json=True)["models"]
    rest = server.rest.get_model_repository_index(headers=dict(AUTH))
    assert sorted(m["name"] for m in index) == sorted(m["name"] for m in rest)
    assert {"minilm", "every", "strings", "echo"} <= {m["name"] for m in index}
    assert [m.get("state") for m in index if m["name"] == "every"] == ["READY"]
    # a load with a config override (control.py's rule: parameters["config"], JSON)
    c.load_model("every", headers=dict(AUTH), config='{"max_batch_size": 4}')
    got = c.get_model_config("every", headers=dict(AUTH), as_json=True)["config"]
    assert int(got["max_batch_size"]) == 4
    c.load_model("every", headers=dict(AUTH))  # a plain load: the configured 8 again
    got = c.get_model_config("every", headers=dict(AUTH), as_json=True)["config"]
    assert int(got["max_batch_size"]) == 8
    # unload: not ready, UNAVAILABLE in the index, NOT_FOUND to infer; loaded back
    c.unload_model("every", headers=dict(AUTH))
    assert not server.rest.is_model_ready("every", headers=dict(AUTH))  # (REST: a 404)
    code, message = _status(lambda: c.is_model_ready("every", headers=dict(AUTH)))
    assert code == "StatusCode.NOT_FOUND" and "every" in message
    code, _ = _status(lambda: c.infer("every", _inputs(grpcclient, {
        "x_FP32": np.ones((1, 3), np.float32)}), headers=dict(AUTH)))
    assert code == "StatusCode.NOT_FOUND"
    entry = next(m for m in c.get_model_repository_index(headers=dict(AUTH), as_json=True)[
        "models"] if m["name"] == "every")
    assert entry["state"] == "UNAVAILABLE", entry
    req = service_pb2.RepositoryIndexRequest(ready=True)
    names = {m.name for m in server.stub.RepositoryIndex(req, metadata=META).models}
    assert "every" not in names and "minilm" in names
    c.load_model("every", headers=dict(AUTH))
    assert c.is_model_ready("every", headers=dict(AUTH))


def test_repository_rpcs_refused(server: Server) -> None:
    """No key: UNAUTHENTICATED; a key not marked admin: PERMISSION_DENIED; an unknown model:
    NOT_FOUND; a parameter Sokuji does not take or of the wrong type: INVALID_ARGUMENT."""
    c = server.client
    other = {"authorization": f"Bearer {OTHER}"}
    for call in (lambda h: c.get_model_repository_index(headers=h),
                 lambda h: c.load_model("echo", headers=h),
                 lambda h: c.unload_model("echo", headers=h)):
        code, message = _status(lambda f=call: f(None))
        assert code == "StatusCode.UNAUTHENTICATED" and message
        code, message = _status(lambda f=call: f(other))
        assert code == "StatusCode.PERMISSION_DENIED" and "admin" in message
    for call in (lambda: c.load_model("nope", headers=dict(AUTH)),
                 lambda: c.unload_model("nope", headers=dict(AUTH))):
        code, message = _status(call)
        assert code == "StatusCode.NOT_FOUND" and "nope" in message, message
    req = service_pb2.RepositoryModelLoadRequest(model_name="every")
    req.parameters["file:1/model.onnx"].bytes_param = b"x"
    with pytest.raises(grpc.RpcError) as info:
        server.stub.RepositoryModelLoad(req, metadata=META)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a load parameter" in (info.value.details() or "")
    req = service_pb2.RepositoryModelUnloadRequest(model_name="every")
    req.parameters["unload_dependents"].string_param = "yes"
    with pytest.raises(grpc.RpcError) as info:
        server.stub.RepositoryModelUnload(req, metadata=META)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unload_dependents" in (info.value.details() or "")
    assert c.is_model_ready("every", headers=dict(AUTH))


def test_traceparent_metadata_is_the_spans_parent() -> None:
    """``traceparent`` metadata on a gRPC infer is honoured as REST's header is
    (``test_tracing.py``): a server sampling nothing else exports the request's span under
    the client's trace id and span."""
    from tests.integration.otlp_receiver import otlp_receiver

    trace_id, parent = "feed" + secrets.token_hex(14), secrets.token_hex(8)
    port = free_port()
    with otlp_receiver() as rx, sokuji_server(f"""grpc_port = {port}
[tracing]
enabled = true
endpoint = "{rx.url}"
sample_ratio = 0.0
service_name = "sokuji-grpc"
export_delay_ms = 50
[[models]]
name = "enc"
runtime = "synthetic"
warmup = false
[models.options]
base_ms = 1.0
"""):
        with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
            text = np.array(["hello"], dtype=object)
            client.infer("enc", _inputs(grpcclient, {"text": text}))  # not sampled
            client.infer("enc", _inputs(grpcclient, {"text": text}),
                         headers={"traceparent": f"00-{trace_id}-{parent}-01"})
        spans = rx.wait_for(lambda got: any(s["trace_id"] == trace_id and
                                            s["name"] == "infer enc" for s in got))
    server_spans = [s for s in spans if s["name"] == "infer enc"]
    assert len(server_spans) == 1, server_spans  # the unsampled request: no span
    span = server_spans[0]
    assert span["trace_id"] == trace_id and span["parent_span_id"] == parent
    assert span["kind"] == "SERVER" and span["service"] == "sokuji-grpc"
    assert span["attributes"]["gen_ai.request.model"] == "enc"
