"""The tensor kind (``runtime = "tensor"``) serving small real ONNX graphs (``tests/
tensor_graphs.py``) in process: every KServe V2 datatype through, in JSON and in Triton's
binary extension both ways, encoded and decoded by tritonclient's own functions; NaN and
infinity through; each bad input a 400 naming the input before anything is queued; a graph
that fails on some values a 422 for that request only; a graph without a batch dimension
served unbatched. Every answer is compared with ONNX Runtime called directly."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from starlette.testclient import TestClient

from sokuji import config as cfg
from tests import tensor_graphs as graphs
from tests.conftest import client_for

pytestmark = pytest.mark.integration

MAX_BATCH = 8


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("graphs")
    return {"every": graphs.write_every_type(d), "arith": graphs.write_arith(d),
            "strings": graphs.write_strings(d), "gather": graphs.write_gather(d),
            "reshape": graphs.write_reshape(d), "fixed": graphs.write_fixed(d),
            "fp16": graphs.write_fp16(d)}


@pytest.fixture(scope="module")
def client(paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[TestClient]:
    models = tuple(cfg.ModelConfig(name=name, runtime="tensor", path=str(path),
                                   max_batch_size=MAX_BATCH, intra_op_threads=1, cache=False,
                                   options={"max_elements": 16} if name == "fp16" else {})
                   for name, path in paths.items())
    models += (cfg.ModelConfig(name="every_unbatched", runtime="tensor",
                               path=str(paths["every"]), max_batch_size=0, cache=False),
               cfg.ModelConfig(name="arith_cached", runtime="tensor", path=str(paths["arith"]),
                               max_batch_size=MAX_BATCH))
    config = cfg.validate(cfg.ServerConfig(
        models=models, builtin_pipelines=False, max_request_bytes=1 << 20,
        cache_dir=str(tmp_path_factory.mktemp("cache"))))
    with client_for(config) as c:
        yield c


def ort_run(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """ONNX Runtime called directly: the reference every answer is compared with."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


def infer(client: TestClient, model: str, feeds: dict[str, np.ndarray], binary_in: bool,
          binary_out: bool, outputs: list[str] | None = None) -> Any:
    """One request as tritonclient.http builds it, its answer as tritonclient parses it."""
    import tritonclient.http as httpclient

    inputs = []
    for name, array in feeds.items():
        dt = "BYTES" if array.dtype == object else {
            "bool": "BOOL", "float16": "FP16", "float32": "FP32", "float64": "FP64"}.get(
                array.dtype.name, array.dtype.name.upper())
        inp = httpclient.InferInput(name, list(array.shape), dt)
        inp.set_data_from_numpy(array, binary_data=binary_in)
        inputs.append(inp)
    if outputs is None:
        outputs = [o["name"] for o in client.get(f"/v2/models/{model}").json()["outputs"]]
    wanted = [httpclient.InferRequestedOutput(n, binary_data=binary_out) for n in outputs]
    body, json_size = httpclient.InferenceServerClient.generate_request_body(
        inputs, outputs=wanted)
    headers = {"Content-Type": "application/octet-stream",
               "Inference-Header-Content-Length": str(json_size)} \
        if json_size is not None else {"Content-Type": "application/json"}
    r = client.post(f"/v2/models/{model}/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    length = r.headers.get("inference-header-content-length")
    return httpclient.InferenceServerClient.parse_response_body(
        r.content, header_length=int(length) if length else None)


def every_feeds(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    feeds = {f"x_{dt}": graphs.sample(dt, (rows, 3), seed) for dt in graphs.EVERY}
    feeds["c_INT32"] = graphs.sample("INT32", (rows, 3), seed)
    return feeds


@pytest.mark.parametrize("binary_in", [False, True], ids=["json_in", "binary_in"])
@pytest.mark.parametrize("binary_out", [False, True], ids=["json_out", "binary_out"])
@pytest.mark.parametrize("model", ["every", "every_unbatched"])
def test_every_datatype_both_ways(client: TestClient, paths: dict[str, Path], binary_in: bool,
                                  binary_out: bool, model: str) -> None:
    feeds = every_feeds(2, seed=1)
    want = ort_run(paths["every"], feeds)
    got = infer(client, model, feeds, binary_in, binary_out)
    for dt in graphs.EVERY:
        value = got.as_numpy(f"y_{dt}")
        if dt == "BYTES":  # tritonclient gives bytes elements (JSON: str)
            value = np.array([v.decode() if isinstance(v, bytes) else v
                              for v in value.reshape(-1)], dtype=object).reshape(value.shape)
            assert value.tolist() == want[f"y_{dt}"].tolist()
        else:
            assert value.dtype == want[f"y_{dt}"].dtype, dt
            np.testing.assert_array_equal(value, want[f"y_{dt}"], err_msg=dt)
    np.testing.assert_array_equal(got.as_numpy("c_FP64"), want["c_FP64"])
    assert want["c_FP64"].dtype == np.float64


def test_metadata_and_config_name_the_graphs_tensors(client: TestClient) -> None:
    meta = client.get("/v2/models/every").json()
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]][:2] == \
        [("x_BOOL", "BOOL", [-1, 3]), ("x_UINT8", "UINT8", [-1, 3])]
    assert {t["datatype"] for t in meta["outputs"]} == set(graphs.EVERY)
    config = client.get("/v2/models/every/config").json()
    assert config["max_batch_size"] == MAX_BATCH and "dynamic_batching" in config
    assert config["input"][-1] == {**config["input"][-1], "name": "c_INT32",
                                   "data_type": "TYPE_INT32", "dims": [3]}
    unbatched = client.get("/v2/models/every_unbatched/config").json()
    assert unbatched["max_batch_size"] == 0 and "dynamic_batching" not in unbatched
    assert unbatched["input"][0]["dims"] == [-1, 3]
    fixed = client.get("/v2/models/fixed/config").json()  # no dynamic dim: served unbatched
    assert fixed["max_batch_size"] == 0 and fixed["input"][0]["dims"] == [2, 4]


def test_strings_are_computed_on(client: TestClient, paths: dict[str, Path]) -> None:
    text = np.array(["héllo", "", "日本語 text"], dtype=object)
    want = ort_run(paths["strings"], {"text": text})
    for binary in (False, True):
        got = infer(client, "strings", {"text": text}, binary, binary)
        assert [v.decode() if isinstance(v, bytes) else v for v in got.as_numpy("shout")] \
            == want["shout"].tolist() == ["héllo!", "!", "日本語 text!"]


@pytest.mark.parametrize("binary_in", [False, True], ids=["json_in", "binary_in"])
def test_nan_and_infinity_pass_through(client: TestClient, paths: dict[str, Path],
                                       binary_in: bool) -> None:
    a = np.array([[0.0, 1.0, -1.0, np.nan], [np.inf, -np.inf, 2.0, 1.0]], dtype=np.float32)
    b = np.array([[0.0, 0.0, 0.0, 1.0], [1.0, np.inf, 0.5, 3.0]], dtype=np.float32)
    want = ort_run(paths["arith"], {"a": a, "b": b})
    assert np.isnan(want["ratio"]).any() and np.isinf(want["ratio"]).any()
    for binary_out in (False, True):
        got = infer(client, "arith", {"a": a, "b": b}, binary_in, binary_out)
        for name in ("sum", "ratio", "total"):
            np.testing.assert_array_equal(got.as_numpy(name), want[name], err_msg=name)
    # The JSON answer spells them as Triton does: NaN, Infinity, -Infinity tokens.
    r = client.post("/v2/models/arith/infer", content=orjson.dumps({"inputs": [
        {"name": "a", "datatype": "FP32", "shape": [1, 3], "data": [0.0, 1.0, -1.0]},
        {"name": "b", "datatype": "FP32", "shape": [1, 3], "data": [0.0, 0.0, 0.0]}]}))
    assert r.status_code == 200 and b'"data":[NaN,Infinity,-Infinity]' in r.content


def test_fp16_graph(client: TestClient, paths: dict[str, Path]) -> None:
    x = np.random.default_rng(3).normal(size=(4, 4)).astype(np.float16)
    want = ort_run(paths["fp16"], {"x": x})
    for binary in (False, True):
        got = infer(client, "fp16", {"x": x}, binary, binary).as_numpy("y")
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, want["y"])


def test_requested_outputs_only(client: TestClient) -> None:
    a = np.ones((1, 2), np.float32)
    got = infer(client, "arith", {"a": a, "b": a}, True, True, outputs=["total"])
    assert [o["name"] for o in got.get_response()["outputs"]] == ["total"]
    np.testing.assert_array_equal(got.as_numpy("total"), [2.0])


def test_the_response_cache_keys_on_every_input(client: TestClient) -> None:
    a = np.array([[1.0, 2.0]], np.float32)
    first = infer(client, "arith_cached", {"a": a, "b": a}, True, True)
    again = infer(client, "arith_cached", {"a": a, "b": a}, True, False)
    other = infer(client, "arith_cached", {"a": a, "b": a * 2}, True, True)
    np.testing.assert_array_equal(first.as_numpy("sum"), again.as_numpy("sum"))
    np.testing.assert_array_equal(other.as_numpy("sum"), [[3.0, 6.0]])
    np.testing.assert_array_equal(again.as_numpy("ratio"), [[1.0, 1.0]])


def test_unbatched_graph_takes_its_own_shape(client: TestClient, paths: dict[str, Path]
                                             ) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    got = infer(client, "fixed", {"x": x}, True, False).as_numpy("y")
    np.testing.assert_array_equal(got, ort_run(paths["fixed"], {"x": x})["y"])


# -- bad input: a 400 naming the input, before anything is queued --------------------------

def v2(*tensors: dict[str, Any]) -> bytes:
    return orjson.dumps({"inputs": list(tensors)})


def t(name: str, datatype: str, shape: list[int], data: Any) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


def binary(name: str, datatype: str, shape: list[int], raw: bytes,
           size: int | None = None) -> tuple[bytes, dict[str, str]]:
    head = orjson.dumps({"inputs": [{"name": name, "datatype": datatype, "shape": shape,
                                     "parameters": {"binary_data_size": size if size
                                                    is not None else len(raw)}}]})
    return head + raw, {"Content-Type": "application/octet-stream",
                        "Inference-Header-Content-Length": str(len(head))}


A2 = t("a", "FP32", [1, 2], [1.0, 2.0])
BAD: dict[str, tuple[str, Any, list[str]]] = {
    "wrong_datatype": ("arith", v2(t("a", "FP64", [1, 2], [1.0, 2.0]), A2 | {"name": "b"}),
                       ["'a'", "FP64", "expected FP32"]),
    "wrong_rank": ("arith", v2(t("a", "FP32", [2], [1.0, 2.0]), A2 | {"name": "b"}),
                   ["'a'", "[2]", "expected [-1, -1]"]),
    "wrong_fixed_dim": ("fp16", v2(t("x", "FP16", [1, 3], [0.5] * 3)),
                        ["'x'", "[1, 3]", "expected [-1, 4]"]),
    "bool_as_integers": ("every", v2(t("x_BOOL", "BOOL", [1, 3], [0, 1, 1])),
                         ["'x_BOOL'", "must be booleans"]),
    "batch_over_max": ("arith", v2(t("a", "FP32", [MAX_BATCH + 1, 1], [1.0] * (MAX_BATCH + 1)),
                                   t("b", "FP32", [MAX_BATCH + 1, 1], [1.0] * (MAX_BATCH + 1))),
                       ["'a'", f"batch of {MAX_BATCH + 1}", f"max_batch_size = {MAX_BATCH}"]),
    "zero_sized_dim": ("arith", v2(t("a", "FP32", [1, 0], []), t("b", "FP32", [1, 0], [])),
                       ["'a'", "[1, 0]", "size 0"]),
    "zero_batch": ("arith", v2(t("a", "FP32", [0, 2], []), t("b", "FP32", [0, 2], [])),
                   ["'a'", "[0, 2]", "size 0"]),
    "bytes_to_numeric": ("arith", v2(t("a", "BYTES", [1, 2], ["1", "2"]), A2 | {"name": "b"}),
                         ["'a'", "BYTES", "expected FP32"]),
    "numeric_to_bytes": ("strings", v2(t("text", "FP32", [1], [1.0])),
                         ["'text'", "expected BYTES"]),
    "batches_differ": ("arith", v2(t("a", "FP32", [2, 1], [1.0, 2.0]),
                                   t("b", "FP32", [1, 1], [1.0])),
                       ["'b'", "batch of 1", "other inputs have 2"]),
    "json_count_vs_shape": ("arith", v2(t("a", "FP32", [1, 3], [1.0, 2.0]), A2 | {"name": "b"}),
                            ["'a'", "[1, 3]", "2 elements"]),
    "huge_declared_shape_json": ("arith", v2(t("a", "FP32", [1, 1 << 29], [1.0]),
                                             A2 | {"name": "b"}),
                                 ["'a'", str(1 << 29), "does not match its data"]),
    "missing_input": ("arith", v2(A2), ["'b'"]),
    "unknown_input": ("arith", v2(A2, A2 | {"name": "b"}, A2 | {"name": "c"}), ["'c'"]),
    "string_element_not_a_string": ("strings", v2(t("text", "BYTES", [1], [5])),
                                    ["'text'", "must be strings"]),
    "integer_out_of_range": ("every", v2(*[t(f"x_{dt}", dt, [1, 3], [300, 0, 0] if dt ==
                                             "INT8" else ["", "", ""] if dt == "BYTES" else
                                             [False] * 3 if dt == "BOOL" else [0, 0, 0])
                                           for dt in graphs.EVERY],
                                         t("c_INT32", "INT32", [1, 3], [0, 0, 0])),
                             ["'x_INT8'", "out of the range of INT8"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_json_input_is_a_400_naming_it(client: TestClient, case: str) -> None:
    model, body, words = BAD[case]
    r = client.post(f"/v2/models/{model}/infer", content=body,
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400, (case, r.status_code, r.text)
    for word in words:
        assert word in r.json()["error"], (case, word, r.text)


BINARY_BAD: dict[str, tuple[str, tuple[bytes, dict[str, str]], list[str], int]] = {
    "size_vs_shape": ("fp16", binary("x", "FP16", [1, 4], b"\0" * 6),
                      ["'x'", "6 bytes of FP16 data"], 400),
    "huge_declared_shape": ("fp16", binary("x", "FP16", [1 << 30, 4], b"\0" * 8),
                            ["'x'", "does not match its data"], 400),
    "size_past_the_body": ("fp16", binary("x", "FP16", [1, 4], b"\0" * 8, size=4096),
                           ["'x'", "binary_data_size 4096"], 400),
    "bytes_not_utf8": ("strings", binary("text", "BYTES", [1], b"\x02\0\0\0\xff\xfe"),
                       ["'text'", "not UTF-8"], 400),
    "bytes_truncated": ("strings", binary("text", "BYTES", [1], b"\x09\0\0\0ab"),
                        ["'text'", "overruns"], 400),
}


@pytest.mark.parametrize("case", sorted(BINARY_BAD))
def test_bad_binary_input_is_refused_naming_it(client: TestClient, case: str) -> None:
    model, (body, headers), words, status = BINARY_BAD[case]
    r = client.post(f"/v2/models/{model}/infer", content=body, headers=headers)
    assert r.status_code == status, (case, r.status_code, r.text)
    for word in words:
        assert word in r.json()["error"], (case, word, r.text)


def test_too_many_elements_is_a_413_naming_the_limit(client: TestClient) -> None:
    """``options.max_elements`` (16 for fp16) bounds one request's cost beside its bytes."""
    config = client.get("/v2/models/fp16/config").json()
    assert config["parameters"]["limit.options.max_elements"]["string_value"].startswith("16 ")
    r = client.post("/v2/models/fp16/infer", content=v2(t("x", "FP16", [5, 4], [0.5] * 20)))
    assert r.status_code == 413 and "options.max_elements" in r.json()["error"], r.text
    r = client.post("/v2/models/fp16/infer", content=v2(t("x", "FP16", [4, 4], [0.5] * 16)))
    assert r.status_code == 200, r.text


def test_bool_bytes_are_booleans(client: TestClient, paths: dict[str, Path]) -> None:
    """A BOOL byte other than 0 or 1 (binary data) is true, and answered as 1."""
    feeds = every_feeds(1)
    import tritonclient.http as httpclient

    body, size = httpclient.InferenceServerClient.generate_request_body(
        [_binary_input(n, a) for n, a in feeds.items()],
        outputs=[httpclient.InferRequestedOutput("y_BOOL", binary_data=False)])
    head = orjson.loads(body[:size])
    offset = size
    for inp in head["inputs"]:  # the BOOL input's bytes: 7, 0, 255
        if inp["name"] == "x_BOOL":
            body = body[:offset] + b"\x07\x00\xff" + body[offset + 3:]
            break
        offset += inp["parameters"]["binary_data_size"]
    r = client.post("/v2/models/every/infer", content=body, headers={
        "Inference-Header-Content-Length": str(size),
        "Content-Type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    out = next(o for o in r.json()["outputs"] if o["name"] == "y_BOOL")
    assert out["data"] == [True, False, True]


def _binary_input(name: str, array: np.ndarray) -> Any:
    import tritonclient.http as httpclient

    dt = "BYTES" if array.dtype == object else {"bool": "BOOL", "float16": "FP16",
                                                 "float32": "FP32", "float64": "FP64"}.get(
        array.dtype.name, array.dtype.name.upper())
    inp = httpclient.InferInput(name, list(array.shape), dt)
    inp.set_data_from_numpy(array, binary_data=True)
    return inp


# -- a graph that fails at run time on some values ----------------------------------------

def test_a_graph_failing_on_a_request_is_a_422_for_it_alone(client: TestClient) -> None:
    """422 once the graph has computed some input (the gather graph: its warm-up); before
    that (the reshape graph's warm-up of [1, 1] fails) a 500: the fault may be the model's."""
    r = client.post("/v2/models/gather/infer", content=v2(t("index", "INT64", [1, 1], [9])))
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "input_failed" and "Gather" in r.json()["error"]
    bad = v2(t("x", "FP32", [1, 4], [0.0] * 4))
    r = client.post("/v2/models/reshape/infer", content=bad)
    assert r.status_code == 500 and r.json()["code"] == "runtime_failed", r.text
    assert "Reshape" in r.json()["error"]
    r = client.post("/v2/models/reshape/infer", content=v2(t("x", "FP32", [1, 6], [0.0] * 6)))
    assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [1, 2, 3]
    r = client.post("/v2/models/reshape/infer", content=bad)
    assert r.status_code == 422 and "Reshape" in r.json()["error"], r.text

    def call(i: int) -> tuple[int, Any]:
        index = 9 if i % 4 == 0 else i % 5
        r = client.post("/v2/models/gather/infer",
                        content=v2(t("index", "INT64", [1, 1], [index])))
        return r.status_code, r.json()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(call, range(32)))
    for i, (status, doc) in enumerate(answers):  # batch mates of a bad one still answered
        if i % 4 == 0:
            assert status == 422, doc
        else:
            assert status == 200 and doc["outputs"][0]["data"] == [10.0 * (i % 5)], doc
    assert client.get("/v2/health/ready").status_code == 200
