"""A Triton model repository served unchanged (``model_repository``): real scikit-learn models
trained on its bundled datasets, exported by skl2onnx into Triton's layout, served by a real
``sokuji serve`` process and driven by the official ``tritonclient.http``; every answer
compared with ONNX Runtime run directly on the same file and inputs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sokuji import config as cfg
from sokuji.errors import ConfigError
from tests.integration.serving import free_port, wait_ready

pytest.importorskip("skl2onnx")
pytest.importorskip("tritonclient.grpc.model_config_pb2")

IRIS_CONFIG = """
name: "iris"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: { all { } }
input [ { name: "float_input", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [
  { name: "label", data_type: TYPE_INT64, dims: [ 1 ], reshape: { shape: [ ] } },
  { name: "probabilities", data_type: TYPE_FP32, dims: [ 3 ] }
]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 500
  default_queue_policy { default_timeout_microseconds: 2000000, max_queue_size: 64 }
}
instance_group [ { count: 2, kind: KIND_CPU } ]
optimization { graph { level: 1 } }
parameters { key: "intra_op_thread_count" value { string_value: "1" } }
parameters { key: "custom_key" value { string_value: "kept" } }
model_warmup [ {
  name: "zeros", batch_size: 2,
  inputs { key: "float_input" value { data_type: TYPE_FP32, dims: [ 4 ], zero_data: true } }
} ]
"""
DIABETES_CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "float_input", data_type: TYPE_FP32, dims: [ -1, 10 ] } ]
output [ { name: "variable", data_type: TYPE_FP32, dims: [ -1, 1 ] } ]
instance_group [ { kind: KIND_GPU } ]
"""
ENSEMBLE_CONFIG = """
name: "iris_ensemble"
platform: "ensemble"
max_batch_size: 8
input [ { name: "raw", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "probs", data_type: TYPE_FP32, dims: [ 3 ] } ]
ensemble_scheduling { step [
  { model_name: "iris_scaler", model_version: -1,
    input_map { key: "float_input" value: "raw" },
    output_map { key: "variable" value: "scaled" } },
  { model_name: "iris_scaled", model_version: -1,
    input_map { key: "float_input" value: "scaled" },
    output_map { key: "probabilities" value: "probs" } }
] }
"""
PARTIAL_CONFIG = """
backend: "onnxruntime"
dynamic_batching { }
"""


def _onnx(model: Any, features: int, zipmap: bool | None = False) -> bytes:
    """``zipmap``: a classifier's option (None for a regressor)."""
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType

    options = None if zipmap is not False else {id(model): {"zipmap": False}}
    onx = convert_sklearn(model, initial_types=[("float_input", FloatTensorType([None,
                                                                                 features]))],
                          options=options, target_opset=17)
    return bytes(onx.SerializeToString())


def _put(root: Path, name: str, config: str | None, versions: dict[int, bytes]) -> None:
    home = root / name
    home.mkdir(parents=True)
    if config is not None:
        (home / "config.pbtxt").write_text(textwrap.dedent(config))
    for v, raw in versions.items():
        (home / str(v)).mkdir()
        (home / str(v) / "model.onnx").write_bytes(raw)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sklearn.datasets import load_diabetes, load_iris
    from sklearn.linear_model import LinearRegression, LogisticRegression
    from sklearn.preprocessing import StandardScaler
    from sklearn.tree import DecisionTreeClassifier

    x, y = load_iris(return_X_y=True)
    dx, dy = load_diabetes(return_X_y=True)
    root = tmp_path_factory.mktemp("triton") / "models"
    # Two versions of iris: different models, so their answers differ.
    v1 = DecisionTreeClassifier(max_depth=1, random_state=0).fit(x, y)
    v2 = LogisticRegression(max_iter=500).fit(x, y)
    _put(root, "iris", IRIS_CONFIG, {1: _onnx(v1, 4), 2: _onnx(v2, 4)})
    # No config.pbtxt at all, the default ZipMap output: auto-completed from the graph.
    _put(root, "iris_zipmap", None, {1: _onnx(LogisticRegression(max_iter=500).fit(x, y),
                                              4, zipmap=True)})
    # An ensemble: a scaler, then a classifier trained on the scaled features.
    scaler = StandardScaler().fit(x)
    _put(root, "iris_scaler", "max_batch_size: 8\n", {1: _onnx(scaler, 4, None)})
    _put(root, "iris_scaled", "max_batch_size: 8\n",
         {1: _onnx(LogisticRegression(max_iter=500).fit(scaler.transform(x), y), 4)})
    _put(root, "iris_ensemble", ENSEMBLE_CONFIG, {1: b""})
    (root / "iris_ensemble" / "1" / "model.onnx").unlink()  # an ensemble's version: empty
    _put(root, "diabetes", DIABETES_CONFIG, {1: _onnx(LinearRegression().fit(dx, dy), 10, None)})
    # A partial config.pbtxt (no inputs, outputs, max_batch_size): completed too.
    _put(root, "diabetes_partial", PARTIAL_CONFIG,
         {3: _onnx(LinearRegression().fit(dx[:200], dy[:200]), 10, None)})
    return root


def _ort(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[str]:
    """``sokuji serve --model-repository`` (the flag; the TOML key is the same setting,
    ``test_warmup_data_file_and_models_beside`` loads it)."""
    port = free_port()
    toml = repo.parent / "sokuji.toml"
    toml.write_text(f'port = {port}\ngrpc_port = 0\nlog_level = "warning"\n'
                    f'cache_dir = "{repo.parent}"\n')
    proc = subprocess.Popen([sys.executable, "-m", "sokuji", "serve", "--config", str(toml),
                             "--model-repository", str(repo)], stdout=subprocess.DEVNULL)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/v2/health/ready")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def client(server: str) -> Any:
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(server.removeprefix("http://"))


def _infer(client: Any, model: str, x: np.ndarray, outputs: list[str],
           version: str = "") -> Any:
    import tritonclient.http as httpclient

    inp = httpclient.InferInput("float_input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp], model_version=version,
                        outputs=[httpclient.InferRequestedOutput(o) for o in outputs])


def test_every_model_of_the_repository_is_served(client: Any) -> None:
    for name in ("iris", "iris_zipmap", "diabetes", "diabetes_partial"):
        assert client.is_model_ready(name), name
    assert client.is_model_ready("iris", "1") and client.is_model_ready("iris", "2")


def test_versions_answer_their_own_model(client: Any, repo: Path) -> None:
    from sklearn.datasets import load_iris

    x = load_iris().data[::10].astype(np.float32)  # 15 rows, all three classes
    meta = client.get_model_metadata("iris")
    assert meta["versions"] == ["2", "1"]
    assert meta["platform"] == "onnxruntime_onnx"
    got: dict[str, np.ndarray] = {}
    for version in ("1", "2"):
        want = _ort(repo / "iris" / version / "model.onnx", {"float_input": x})
        for part in (x[:8], x[8:]):  # max_batch_size 8
            result = _infer(client, "iris", part, ["label", "probabilities"], version)
            assert result.get_response()["model_version"] == version
        result = _infer(client, "iris", x[:8], ["label", "probabilities"], version)
        np.testing.assert_allclose(result.as_numpy("probabilities"), want["probabilities"][:8],
                                   rtol=1e-6, atol=1e-6)
        assert result.as_numpy("label").shape == (8, 1)  # dims [1] reshaped from []
        np.testing.assert_array_equal(result.as_numpy("label")[:, 0], want["label"][:8])
        got[version] = result.as_numpy("probabilities")
    assert not np.allclose(got["1"], got["2"])  # two models, two answers
    latest = _infer(client, "iris", x[:8], ["probabilities"])  # no version: the latest
    assert latest.get_response()["model_version"] == "2"
    np.testing.assert_allclose(latest.as_numpy("probabilities"), got["2"], rtol=1e-6)


def test_config_is_the_repository_config_completed(client: Any, server: str) -> None:
    import urllib.request

    config = client.get_model_config("iris")
    assert config["name"] == "iris" and config["backend"] == "onnxruntime"
    assert config["max_batch_size"] == 8
    assert config["input"][0]["dims"] == [4]  # numbers, as Triton writes int64s
    assert config["dynamic_batching"]["preferred_batch_size"] == [4, 8]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 500
    assert config["version_policy"] == {"all": {}}
    assert config["parameters"]["custom_key"] == {"string_value": "kept"}
    assert config["parameters"]["sokuji_runtime"] == {"string_value": "tensor"}
    assert config["parameters"]["max_queue_depth"] == {"string_value": "64"}
    assert any(k.startswith("limit.") for k in config["parameters"])
    assert config["instance_group"][0]["count"] == 2
    with urllib.request.urlopen(f"{server}/v2/models/iris/versions/1/config") as r:
        assert json.loads(r.read())["name"] == "iris"
    # No config.pbtxt: Triton's auto-complete (every first dimension dynamic: batch 4).
    auto = client.get_model_config("iris_zipmap")
    assert auto["max_batch_size"] == 4
    assert [i["name"] for i in auto["input"]] == ["float_input"]
    assert auto["input"][0]["dims"] == [4] and auto["input"][0]["data_type"] == "TYPE_FP32"
    assert {o["name"] for o in auto["output"]} == {"output_label", "output_probability"}
    assert "dynamic_batching" in auto
    partial = client.get_model_config("diabetes_partial")
    assert partial["max_batch_size"] == 4 and partial["input"][0]["dims"] == [10]
    assert partial["output"][0]["name"] == "variable"


def test_autocompleted_zipmap_and_unbatched_models_answer_as_onnxruntime(
        client: Any, repo: Path) -> None:
    from sklearn.datasets import load_diabetes, load_iris

    x = load_iris().data[:4].astype(np.float32)
    result = _infer(client, "iris_zipmap", x, ["output_probability", "output_label"])
    want = _ort(repo / "iris_zipmap" / "1" / "model.onnx", {"float_input": x})
    dense = np.array([[row[k] for k in sorted(row)] for row in want["output_probability"]],
                     dtype=np.float32)
    np.testing.assert_allclose(result.as_numpy("output_probability"), dense, rtol=1e-6)
    np.testing.assert_array_equal(result.as_numpy("output_label").reshape(-1),
                                  want["output_label"])
    dx = load_diabetes().data[:20].astype(np.float32)  # unbatched: 20 rows in one request
    result = _infer(client, "diabetes", dx, ["variable"])
    want = _ort(repo / "diabetes" / "1" / "model.onnx", {"float_input": dx})
    np.testing.assert_allclose(result.as_numpy("variable"), want["variable"], rtol=1e-5)
    assert client.get_model_config("diabetes")["max_batch_size"] == 0
    result = _infer(client, "diabetes_partial", dx[:4], ["variable"])
    assert result.get_response()["model_version"] == "3"
    want = _ort(repo / "diabetes_partial" / "3" / "model.onnx", {"float_input": dx[:4]})
    np.testing.assert_allclose(result.as_numpy("variable"), want["variable"], rtol=1e-5)


def test_ensemble_runs_its_steps_in_order(client: Any, repo: Path) -> None:
    from sklearn.datasets import load_iris

    x = load_iris().data[::20].astype(np.float32)  # 8 rows
    import tritonclient.http as httpclient

    inp = httpclient.InferInput("raw", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("iris_ensemble", [inp])
    scaled = _ort(repo / "iris_scaler" / "1" / "model.onnx", {"float_input": x})["variable"]
    want = _ort(repo / "iris_scaled" / "1" / "model.onnx", {"float_input": scaled})
    np.testing.assert_allclose(result.as_numpy("probs"), want["probabilities"], rtol=1e-6,
                               atol=1e-7)
    config = client.get_model_config("iris_ensemble")
    assert config["platform"] == "ensemble"
    assert [s["model_name"] for s in config["ensemble_scheduling"]["step"]] == \
        ["iris_scaler", "iris_scaled"]
    meta = client.get_model_metadata("iris_ensemble")
    assert meta["inputs"][0]["shape"] == [-1, 4] and meta["outputs"][0]["name"] == "probs"


def test_ensemble_naming_a_tensor_no_step_makes_is_refused(tmp_path: Path, repo: Path) -> None:
    import shutil

    root = tmp_path / "r"
    root.mkdir()
    for name in ("iris_scaler", "iris_scaled"):
        shutil.copytree(repo / name, root / name)
    _put(root, "iris_ensemble", ENSEMBLE_CONFIG.replace('value: "scaled" } }',
                                                        'value: "nowhere" } }'), {})
    loaded = _load(root)  # the flow is checked when the ensemble is built, after its steps
    from sokuji.repository.models import ModelRepository

    with pytest.raises(ConfigError, match="reads 'scaled', which no earlier step"):
        ModelRepository.load(loaded)


def test_a_batch_over_max_batch_size_is_a_clear_400(client: Any) -> None:
    from tritonclient.utils import InferenceServerException

    x = np.zeros((9, 4), dtype=np.float32)
    with pytest.raises(InferenceServerException) as err:
        _infer(client, "iris", x, ["label"])
    assert "max_batch_size" in str(err.value) and "400" in str(err.value)


# -- start-up refusals (config load only: nothing served) ---------------------------------

@pytest.fixture(scope="module")
def iris_file(repo: Path) -> bytes:
    return (repo / "iris" / "2" / "model.onnx").read_bytes()


def _load(root: Path) -> cfg.ServerConfig:
    return cfg.load(env={}, overrides={"model_repository": str(root),
                                       "cache_dir": str(root.parent)})


def test_refused_platform_names_the_model_and_what_is_supported(tmp_path: Path,
                                                                 iris_file: bytes) -> None:
    _put(tmp_path / "r", "engine", 'platform: "tensorrt_plan"\nmax_batch_size: 8\n',
         {1: b"plan"})
    with pytest.raises(ConfigError) as err:
        _load(tmp_path / "r")
    text = str(err.value)
    assert "'engine'" in text and "tensorrt_plan" in text and "onnxruntime_onnx" in text


def test_broken_config_names_the_file(tmp_path: Path, iris_file: bytes) -> None:
    _put(tmp_path / "r", "iris", 'name: "iris"\nmax_batch_size: [oops\n', {1: iris_file})
    with pytest.raises(ConfigError) as err:
        _load(tmp_path / "r")
    assert str(tmp_path / "r" / "iris" / "config.pbtxt") in str(err.value)


def test_name_must_be_the_directory(tmp_path: Path, iris_file: bytes) -> None:
    _put(tmp_path / "r", "iris", 'name: "other"\n', {1: iris_file})
    with pytest.raises(ConfigError, match="directory name, 'iris'"):
        _load(tmp_path / "r")


def test_missing_version_and_file_are_named(tmp_path: Path, iris_file: bytes) -> None:
    _put(tmp_path / "a", "iris", "version_policy: { specific { versions: [1, 5] } }\n",
         {1: iris_file})
    with pytest.raises(ConfigError, match="version"):
        _load(tmp_path / "a")
    _put(tmp_path / "b", "iris", 'default_model_filename: "net.onnx"\n', {1: iris_file})
    with pytest.raises(ConfigError, match=r"net\.onnx"):
        _load(tmp_path / "b")


def test_batching_config_on_a_graph_that_cannot_batch_is_refused(tmp_path: Path) -> None:
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    x, y = load_iris(return_X_y=True)
    clf = LogisticRegression(max_iter=300).fit(x, y)
    onx = convert_sklearn(clf, initial_types=[("float_input", FloatTensorType([1, 4]))],
                          options={id(clf): {"zipmap": False}}, target_opset=17)
    _put(tmp_path / "r", "fixed", "max_batch_size: 8\n", {1: onx.SerializeToString()})
    with pytest.raises(ConfigError, match="does not support batching"):
        _load(tmp_path / "r")


def test_interface_for_model_control(repo: Path) -> None:
    from sokuji.repository import triton_repo

    assert triton_repo.names(repo) == ["diabetes", "diabetes_partial", "iris", "iris_ensemble",
                                       "iris_scaled", "iris_scaler", "iris_zipmap"]
    mc = triton_repo.model_config(repo, "iris")
    assert mc.runtime == "tensor" and mc.version == "2" and mc.max_batch_size == 8
    assert mc.options["versions"] == {"1": str(repo / "iris" / "1" / "model.onnx")}
    assert mc.max_queue_delay_ms == 0.5 and mc.instances == 2 and mc.max_queue_depth == 64
    assert mc.default_timeout_ms == 2000.0 and mc.intra_op_threads == 1
    assert mc.options["graph_optimization_level"] == "extended"
    # A load API override (JSON) in place of config.pbtxt, completed from the graph.
    over = triton_repo.model_config(repo, "iris", {"max_batch_size": 2,
                                                   "version_policy": {"latest": {}}})
    assert over.max_batch_size == 2 and "versions" not in over.options
    assert [i["name"] for i in over.options["inputs"]] == ["float_input"]
    ensemble = triton_repo.model_config(repo, "iris_ensemble")
    assert ensemble.runtime == "ensemble"
    assert [st["model"] for st in ensemble.options["steps"]] == ["iris_scaler", "iris_scaled"]
    with pytest.raises(ConfigError, match="not a Triton model configuration"):
        triton_repo.model_config(repo, "iris", '{"max_batch_size": "many"}')


def test_warmup_data_file_and_models_beside(tmp_path: Path, iris_file: bytes) -> None:
    warm = """max_batch_size: 4
model_warmup [ { name: "file", batch_size: 2, inputs { key: "float_input"
  value { data_type: TYPE_FP32, dims: [ 4 ], input_data_file: "x.bin" } } } ]
"""
    _put(tmp_path / "r", "iris", warm, {1: iris_file})
    with pytest.raises(ConfigError, match=r"no file .*warmup/x\.bin"):
        _load(tmp_path / "r")
    (tmp_path / "r" / "iris" / "warmup").mkdir()
    (tmp_path / "r" / "iris" / "warmup" / "x.bin").write_bytes(
        np.ones((2, 4), dtype="<f4").tobytes())
    toml = tmp_path / "sokuji.toml"
    toml.write_text(f'model_repository = "{tmp_path / "r"}"\n'
                    '[[models]]\nname = "s"\nruntime = "synthetic"\n')
    loaded = cfg.load(toml, env={})
    assert [m.name for m in loaded.models] == ["s", "iris"]
    (iris,) = [m for m in loaded.models if m.name == "iris"]
    (sample,) = iris.options["warmup"]
    assert sample["inputs"]["float_input"]["fill"] == "file" and sample["batch_size"] == 2
    from sokuji.repository.models import ModelRepository

    repo = ModelRepository.load(loaded)  # the warm-up sample runs at load: its shape fits
    try:
        assert repo.get("iris").served.metadata.inputs[0].shape == (-1, 4)
    finally:
        for m in repo.every():
            m.served.close()
