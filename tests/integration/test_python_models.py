"""Kind ``python`` in a server thread (``workers = 0``) through the HTTP app: the iris class
(scikit-learn trained at start-up) answering as calling it directly does, through
tritonclient unchanged; its stages in ``Server-Timing`` and its metadata as first seen;
requests batched under concurrency; the policy every model has (429 with Retry-After at a
full queue, 504 before compute past a deadline, priorities); the response cache only for a
deterministic class; code that breaks its contract a 502 naming the model and what was
wrong, an exception's text never sent; a class that fails in ``setup`` stopping start-up;
``async def`` and ``describe()``; declared inputs; parameters as plain values; metrics and
Triton statistics.

One client serves every model of the module. The classes are in ``tests/data/pymodels/``;
``core_recorder.Recorder`` is held and read through its module (loaded by module path,
so the test shares it): a request that waits in ``predict`` until the test opens its gate
makes the others queue, so batching and queueing are shown by what the class saw, never
by timings."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from sokuji import config as cfg
from sokuji.errors import ConfigError
from sokuji.pycode import entry as entry_
from sokuji.repository.models import ModelRepository
from tests.conftest import ROOT, client_for
from tests.data.pymodels import core_forms, core_recorder

pytestmark = pytest.mark.integration

IRIS = "tests/data/pymodels/iris.py:Iris"
PKG = "tests.data.pymodels"
ROWS = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3], [5.9, 3.0, 4.2, 1.5]],
                np.float32)
WAIT_S = 30.0
"""The most a test waits for a condition it polls (a busy machine is slow, never wrong)."""


def model(name: str, entry: str, options: dict[str, Any] | None = None,
          **config: Any) -> cfg.ModelConfig:
    config.setdefault("max_batch_size", 8)
    return cfg.ModelConfig(name=name, runtime="python",
                           options={"entry": entry, **(options or {})}, **config)


def held(name: str, key: str, **config: Any) -> cfg.ModelConfig:
    """A ``Recorder`` that never runs a request on the event loop (a held one would stall
    the server) nor caches."""
    return model(name, f"{PKG}.core_recorder:Recorder", {"key": key}, inline_max_ms=0.0,
                 cache=False, **config)


MODELS = (
    model("iris", IRIS, {"scale": 1.0}),
    model("iris_uncached", IRIS, cache=False),
    model("iris_fresh", IRIS, cache=False),
    held("batching", "batching", max_queue_delay_ms=20.0),
    held("queue", "queue", max_batch_size=1, max_queue_depth=2),
    held("serial", "serial", max_batch_size=1),
    held("deadline", "deadline", max_batch_size=1, default_timeout_ms=100.0),
    held("faults", "faults"),
    model("bad", f"{PKG}.core_bad:Bad", cache=False),
    model("echo", f"{PKG}.core_forms:Echo"),
    model("echo_det", f"{PKG}.core_forms:Echo", {"deterministic": True}),
    model("det_off", f"{PKG}.core_forms:Deterministic", {"deterministic": False}),
    model("described", f"{PKG}.core_forms:Described"),
    model("per_request", f"{PKG}.core_forms:PerRequest", cache=False),
    model("declared", f"{PKG}.core_forms:Echo",
          {"inputs": [{"name": "x", "datatype": "FP32", "dims": [-1, 2]}],
           "outputs": [{"name": "x", "datatype": "FP32", "dims": [-1, 2]},
                       {"name": "types", "datatype": "BYTES", "dims": [1]}],
           "max_elements": 8}),
)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    config = cfg.validate(cfg.ServerConfig(
        models=MODELS, builtin_pipelines=False, max_request_bytes=1 << 20,
        cache_dir=str(tmp_path_factory.mktemp("cache"))))
    with client_for(config) as c:
        yield c


@pytest.fixture(scope="module")
def iris() -> Any:
    """The iris class called directly, set up as the server's ``iris`` is: the reference."""
    code = entry_.load(IRIS, "iris", ROOT)
    instance = code.new()
    instance.setup({"scale": 1.0})
    return instance


def v2(name: str, datatype: str, shape: list[int], data: list[Any],
       **parameters: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"inputs": [{"name": name, "datatype": datatype, "shape": shape,
                                       "data": data}]}
    if parameters:
        doc["parameters"] = parameters
    return doc


def features(rows: np.ndarray) -> dict[str, Any]:
    return v2("features", "FP32", list(rows.shape), rows.reshape(-1).tolist())


def timing(response: Any) -> dict[str, str]:
    """``Server-Timing``'s entries: name -> the rest (``dur=...;desc=...``)."""
    out = {}
    for part in response.headers.get("server-timing", "").split(","):
        name, _, rest = part.strip().partition(";")
        out[name] = rest
    return out


def triton(client: TestClient, model: str, feeds: dict[str, np.ndarray], binary: bool,
           outputs: list[str]) -> Any:
    """One request as tritonclient.http builds it, its answer as tritonclient parses it."""
    import tritonclient.http as httpclient

    inputs = []
    for name, array in feeds.items():
        inp = httpclient.InferInput(name, list(array.shape), "FP32")
        inp.set_data_from_numpy(array, binary_data=binary)
        inputs.append(inp)
    wanted = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in outputs]
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


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def queued(client: TestClient, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'sokuji_queue_depth{{model="{name}"}}'):
            return float(line.split()[-1])
    return 0.0


class Held:
    """A ``Recorder`` model held by a request in ``predict``: what is sent meanwhile queues;
    ``release`` opens the gate and gives each request's response, in the order sent."""

    def __init__(self, client: TestClient, name: str, key: str) -> None:
        self.client, self.name, self.key = client, name, key
        self.gate = core_recorder.gate(key)
        self.gate.clear()
        self.pool = concurrent.futures.ThreadPoolExecutor(8)
        self.sent: list[concurrent.futures.Future[Any]] = []
        ran = len(core_recorder.batches(key))
        self.send(tag="holder", hold=True)
        until(lambda: len(core_recorder.batches(key)) > ran, f"{name} to run the holder")

    def send(self, headers: dict[str, str] | None = None, **parameters: Any
             ) -> concurrent.futures.Future[Any]:
        future = self.pool.submit(self.client.post, f"/v2/models/{self.name}/infer",
                                  json={"parameters": parameters}, headers=headers or {})
        self.sent.append(future)
        return future

    def wait_queued(self, depth: int) -> None:
        until(lambda: queued(self.client, self.name) >= depth, f"{depth} queued at {self.name}")

    def release(self) -> list[Any]:
        self.gate.set()
        try:
            return [f.result(timeout=WAIT_S) for f in self.sent]
        finally:
            self.pool.shutdown()

    def batches_since_holder(self) -> list[list[str]]:
        runs = core_recorder.batches(self.key)
        start = max(i for i, b in enumerate(runs) if "holder" in b)
        return runs[start:]


# -- the iris class ------------------------------------------------------------------------

def test_iris_answers_as_calling_the_class_directly(client: TestClient, iris: Any) -> None:
    r = client.post("/v2/models/iris_uncached/infer", json=features(ROWS))
    assert r.status_code == 200, r.text
    (want,) = iris.predict([{"features": ROWS}])
    outputs = {o["name"]: o for o in r.json()["outputs"]}
    assert outputs["probabilities"]["datatype"] == "FP32"
    assert outputs["probabilities"]["shape"] == [3, 3]
    np.testing.assert_array_equal(np.array(outputs["probabilities"]["data"], np.float32),
                                  want["probabilities"].reshape(-1))
    assert outputs["label"] == {"name": "label", "datatype": "BYTES", "shape": [3],
                                "data": want["label"].tolist()}
    assert want["label"].tolist() == ["setosa", "virginica", "versicolor"]  # (trained)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_iris_through_tritonclient(client: TestClient, iris: Any, binary: bool) -> None:
    got = triton(client, "iris_uncached", {"features": ROWS}, binary,
                 ["probabilities", "label"])
    (want,) = iris.predict([{"features": ROWS}])
    proba = got.as_numpy("probabilities")
    assert proba.dtype == np.float32 and proba.shape == (3, 3)
    np.testing.assert_array_equal(proba, want["probabilities"])
    labels = [v.decode() if isinstance(v, bytes) else v for v in got.as_numpy("label")]
    assert labels == want["label"].tolist()
    doc = got.get_response()
    assert {o["name"]: (o["datatype"], o["shape"]) for o in doc["outputs"]} == {
        "probabilities": ("FP32", [3, 3]), "label": ("BYTES", [3])}


def test_iris_stages_show_in_server_timing(client: TestClient) -> None:
    r = client.post("/v2/models/iris_uncached/infer", json=features(ROWS[:1]))
    assert r.status_code == 200, r.text
    stages = timing(r)
    assert stages["model.features"].startswith("dur=")
    assert stages["model.model"].startswith("dur=")
    assert "infer" in stages and "total" in stages  # beside the server's own


def test_open_metadata_shows_what_was_seen_after_the_first_call(client: TestClient) -> None:
    meta = client.get("/v2/models/iris_fresh").json()
    assert (meta["platform"], meta["inputs"], meta["outputs"]) == ("python", [], [])
    r = client.post("/v2/models/iris_fresh/infer", json=features(ROWS[:2]))
    assert r.status_code == 200, r.text
    meta = client.get("/v2/models/iris_fresh").json()
    assert meta["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, -1]}]
    assert meta["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [-1, -1]},
                               {"name": "label", "datatype": "BYTES", "shape": [-1]}]


# -- batching and policy -------------------------------------------------------------------

def test_concurrent_requests_are_batched(client: TestClient) -> None:
    """One instance, held by a request: six sent meanwhile queue, and run as one batch."""
    hold = Held(client, "batching", "batching")
    for i in range(6):
        hold.send(tag=f"r{i}")
    hold.wait_queued(6)
    answers = hold.release()
    assert [a.status_code for a in answers] == [200] * 7, [a.text for a in answers]
    runs = hold.batches_since_holder()
    assert runs[0] == ["holder"]
    assert sorted(t for b in runs[1:] for t in b) == [f"r{i}" for i in range(6)]
    assert max(len(b) for b in runs[1:]) > 1, runs  # batched, not one by one
    for answer in answers[1:]:  # each request its own result, told its batch's size
        tag = answer.json()["outputs"][0]["data"][0]
        size = answer.json()["outputs"][1]["data"][0]
        assert tag.startswith("r") and size == len(next(b for b in runs if tag in b))


def test_a_full_queue_refuses_at_once_with_retry_after(client: TestClient) -> None:
    """max_queue_depth 2, both taken behind a held request: the next is a 429 while the
    holder is still held (refused at admission, not after waiting its turn)."""
    hold = Held(client, "queue", "queue")
    hold.send(tag="q0")
    hold.send(tag="q1")
    hold.wait_queued(2)
    r = client.post("/v2/models/queue/infer", json={"parameters": {"tag": "over"}})
    assert not hold.gate.is_set()  # answered while the model was still held: fast
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["code"] == "overloaded" and "max_queue_depth 2" in r.json()["error"]
    assert [a.status_code for a in hold.release()] == [200] * 3
    assert "over" not in {t for b in core_recorder.batches("queue") for t in b}


@pytest.mark.parametrize("how", ["header", "default_timeout_ms"])
def test_a_request_past_its_deadline_gets_504_before_compute(client: TestClient,
                                                             how: str) -> None:
    name = "serial" if how == "header" else "deadline"
    hold = Held(client, name, name)
    tag = f"late-{how}"
    late = hold.send({"x-sokuji-timeout-ms": "100"} if how == "header" else None, tag=tag)
    r = late.result(timeout=WAIT_S)  # answered while the holder is still held
    assert not hold.gate.is_set()
    assert r.status_code == 504, r.text
    assert r.json()["code"] == "deadline_exceeded"
    answers = hold.release()
    assert answers[0].status_code == 200
    assert tag not in {t for b in core_recorder.batches(name) for t in b}  # never computed


def test_interactive_requests_run_before_batch_ones(client: TestClient) -> None:
    hold = Held(client, "serial", "serial")
    hold.send({"x-sokuji-priority": "batch"}, tag="batch")
    hold.wait_queued(1)
    hold.send(tag="interactive")
    hold.wait_queued(2)
    assert [a.status_code for a in hold.release()] == [200] * 3
    assert hold.batches_since_holder()[1:] == [["interactive"], ["batch"]]


# -- the response cache --------------------------------------------------------------------

def test_a_deterministic_class_is_answered_from_the_cache(client: TestClient) -> None:
    body = features(ROWS[1:2])
    first = client.post("/v2/models/iris/infer", json=body)
    again = client.post("/v2/models/iris/infer", json=body)
    assert first.status_code == again.status_code == 200, again.text
    assert timing(again)["cache"].endswith('desc="hit"'), again.headers["server-timing"]
    assert again.json()["outputs"] == first.json()["outputs"]


@pytest.mark.parametrize(("name", "cached"), [("echo", False), ("echo_det", True),
                                               ("det_off", False)])
def test_only_what_says_it_is_deterministic_is_cached(client: TestClient, name: str,
                                                      cached: bool) -> None:
    """Echo says nothing (not cached); options.deterministic = true makes it so; false
    overrides a class that says it is."""
    body = v2("x", "FP32", [1, 2], [1.0, 2.0], note=name)
    before = len(core_forms.CALLS)
    answers = [client.post(f"/v2/models/{name}/infer", json=body) for _ in range(3)]
    assert all(a.status_code == 200 for a in answers), answers[-1].text
    descs = [timing(a).get("cache", "") for a in answers]
    if cached:
        assert descs[1].endswith('desc="hit"') and descs[2].endswith('desc="hit"'), descs
        assert len(core_forms.CALLS) - before == 1
    else:
        assert not any("hit" in d for d in descs), descs
        assert len(core_forms.CALLS) - before == 3


# -- bad code ------------------------------------------------------------------------------

@pytest.mark.parametrize(("how", "code", "says"), [
    ("count", "bad_model_output", "returned 0 results for a batch of 1"),
    ("not-a-list", "bad_model_output", "returned a dict"),
    ("not-a-dict", "bad_model_output", "result 0 is a float"),
    ("set", "bad_model_output", "'y' is a set"),
    ("object-ints", "bad_model_output", "object array of int"),
    ("ragged", "bad_model_output", "no regular tensor"),
    ("complex", "bad_model_output", "complex64"),
    ("raise", "model_error", "raised ValueError"),
])
def test_code_that_breaks_its_contract_is_a_502_naming_the_model(client: TestClient,
                                                                 how: str, code: str,
                                                                 says: str) -> None:
    r = client.post("/v2/models/bad/infer", json={"parameters": {"how": how}})
    assert r.status_code == 502, r.text
    doc = r.json()
    assert doc["code"] == code and "model 'bad'" in doc["error"] and says in doc["error"], doc
    assert "secret" not in r.text and "Traceback" not in r.text and "core_bad" not in r.text
    ok = client.post("/v2/models/bad/infer", json={"parameters": {"how": "fine"}})
    assert ok.status_code == 200, ok.text  # the next request is served


def test_an_exception_fails_only_its_batch(client: TestClient) -> None:
    """A held batch raises ValueError; a request sent meanwhile (so in the next batch) is
    answered; the client of the failing one is told the type, never the text."""
    gate = core_recorder.gate("faults")
    gate.clear()
    ran = len(core_recorder.batches("faults"))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        failing = pool.submit(client.post, "/v2/models/faults/infer",
                              json={"parameters": {"tag": "bad", "hold": True, "fail": True}})
        until(lambda: len(core_recorder.batches("faults")) > ran, "the failing batch to run")
        good = pool.submit(client.post, "/v2/models/faults/infer",
                           json={"parameters": {"tag": "good"}})
        until(lambda: queued(client, "faults") >= 1, "the good request to queue")
        gate.set()
        failed, answered = failing.result(timeout=WAIT_S), good.result(timeout=WAIT_S)
    assert failed.status_code == 502 and failed.json()["code"] == "model_error", failed.text
    assert "ValueError" in failed.json()["error"] and "model 'faults'" in failed.json()["error"]
    assert "secret" not in failed.text and "Traceback" not in failed.text
    assert answered.status_code == 200, answered.text
    assert answered.json()["outputs"][0]["data"] == ["good"]
    assert core_recorder.batches("faults")[ran:] == [["bad"], ["good"]]


@pytest.mark.parametrize(("how", "status", "code"), [
    ("ok", 200, None), ("refuse", 400, "invalid_input"), ("fail", 502, "model_error")])
def test_a_request_the_class_fails_alone_gets_its_own_status(client: TestClient, how: str,
                                                             status: int, code: Any) -> None:
    r = client.post("/v2/models/per_request/infer", json={"parameters": {"how": how}})
    assert r.status_code == status, r.text
    if code is not None:
        assert r.json()["code"] == code and "secret" not in r.text, r.text


def test_a_class_that_fails_in_setup_stops_start_up(tmp_path: Path) -> None:
    config = cfg.validate(cfg.ServerConfig(
        models=(model("weightless", f"{PKG}.core_bad:FailsSetup"),),
        builtin_pipelines=False, cache_dir=str(tmp_path)))
    with pytest.raises(ConfigError) as err:
        ModelRepository.load(config)
    text = str(err.value)
    assert "model 'weightless'" in text and "RuntimeError: no weights here" in text, text


# -- forms: async, describe(), declared inputs, parameters ----------------------------------

def test_async_predict_and_describe(client: TestClient) -> None:
    meta = client.get("/v2/models/described").json()
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}]
    r = client.post("/v2/models/described/infer", json=v2("x", "FP32", [2, 2], [1, 2, 3, 4]))
    assert r.status_code == 200, r.text
    assert r.json()["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [2, 2],
                                    "data": [2.0, 4.0, 6.0, 8.0]}]


@pytest.mark.parametrize("name", ["described", "declared"])
def test_declared_inputs_are_checked_before_queueing(client: TestClient, name: str) -> None:
    wrong = client.post(f"/v2/models/{name}/infer", json=v2("x", "INT32", [1, 2], [1, 2]))
    assert wrong.status_code == 400, wrong.text
    assert "'x'" in wrong.json()["error"] and "FP32" in wrong.json()["error"]
    other = client.post(f"/v2/models/{name}/infer", json=v2("z", "FP32", [1, 2], [1, 2]))
    assert other.status_code == 400 and "'z'" in other.json()["error"], other.text
    shape = client.post(f"/v2/models/{name}/infer", json=v2("x", "FP32", [1, 3], [1, 2, 3]))
    assert shape.status_code == 400 and "shape" in shape.json()["error"], shape.text


def test_declared_outputs_are_answered(client: TestClient) -> None:
    r = client.post("/v2/models/declared/infer", json=v2("x", "FP32", [1, 2], [1.0, 2.0]))
    assert r.status_code == 200, r.text
    assert [(o["name"], o["data"]) for o in r.json()["outputs"]] == [
        ("x", [1.0, 2.0]), ("types", ["x=ndarray"])]


def test_max_elements_is_a_413_before_anything_runs(client: TestClient) -> None:
    before = len(core_forms.CALLS)
    r = client.post("/v2/models/declared/infer", json=v2("x", "FP32", [5, 2], [0.0] * 10))
    assert r.status_code == 413, r.text
    assert "options.max_elements = 8" in r.json()["error"]
    assert len(core_forms.CALLS) == before
    at = client.post("/v2/models/declared/infer", json=v2("x", "FP32", [4, 2], [0.0] * 8))
    assert at.status_code == 200, at.text


def test_parameters_alone_reach_predict_as_plain_values(client: TestClient) -> None:
    r = client.post("/v2/models/echo/infer", json={"parameters": {
        "n": 3, "s": "text", "flag": True, "items": [1, 2], "doc": {"k": None},
        "priority": "batch"}})  # (a reserved parameter is the server's, not the model's)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"] == [{"name": "types", "datatype": "BYTES", "shape": [1],
                                    "data": ["doc=dict,flag=bool,items=list,n=int,s=str"]}]


def test_a_name_both_tensor_and_parameter_is_a_400(client: TestClient) -> None:
    r = client.post("/v2/models/echo/infer", json=v2("x", "FP32", [1, 2], [1, 2], x=3))
    assert r.status_code == 400, r.text
    assert "'x' is both an input tensor and a parameter" in r.json()["error"]


# -- metrics and statistics ----------------------------------------------------------------

def _metric(text: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))


def test_metrics_and_triton_statistics_count_the_model(client: TestClient) -> None:
    def stats() -> dict[str, Any]:
        (doc,) = client.get("/v2/models/iris_uncached/stats").json()["model_stats"]
        return doc

    before = stats()["inference_stats"]["success"]["count"]
    text = client.get("/metrics").text
    ok_before = _metric(text, 'sokuji_requests_total{model="iris_uncached",status="200"}')
    for _ in range(3):
        assert client.post("/v2/models/iris_uncached/infer",
                           json=features(ROWS[:1])).status_code == 200
    until(lambda: stats()["inference_stats"]["success"]["count"] >= before + 3,
          "the statistics to count three successes")
    assert stats()["name"] == "iris_uncached"
    text = client.get("/metrics").text
    assert _metric(text, 'sokuji_requests_total{model="iris_uncached",status="200"}') \
        >= ok_before + 3
    assert _metric(text, 'sokuji_batch_size_count{model="iris_uncached"}') >= 3
    r = client.post("/v2/models/bad/infer", json={"parameters": {"how": "raise"}})
    assert r.status_code == 502
    until(lambda: _metric(client.get("/metrics").text,
                          'sokuji_requests_total{model="bad",status="502"}') >= 1,
          "the 502 counted")

