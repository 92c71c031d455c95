"""Model control over HTTP (Triton's model repository extension), with tritonclient.http as
it is, against a real ``sokuji serve`` of two iris classifiers (scikit-learn, exported by
skl2onnx, runtime tensor):

- a reload under load: four threads infer without pause while the model file is replaced
  and loaded again six times (two classifiers in turn, labels 0-2 and 3-5, so every answer
  says which one computed it): every answer is a 200 and exactly that classifier's labels,
  and once a load has returned, requests that start after it get the new one; the server
  and the other model stay ready throughout;
- a broken model file fails its load with 400 and the reason, and the version serving
  still serves; a config override (``max_batch_size``) holds until the next plain load;
- unload: not ready, UNAVAILABLE "unloaded" in the index, 404 to infer; loaded back;
- only an admin key may list, load or unload (another tenant's key: 403, none: 401).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

ADMIN = {"Authorization": "Bearer admin-key-0001"}
TENANT = {"Authorization": "Bearer tenant-key-0001"}


def _export(clf: Any, x: np.ndarray) -> bytes:
    from skl2onnx import to_onnx

    return to_onnx(clf, x[:1], options={id(clf): {"zipmap": False}},
                   target_opset=17).SerializeToString()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression
    from sklearn.tree import DecisionTreeClassifier

    x, y = load_iris(return_X_y=True)
    x = x.astype(np.float32)
    a = LogisticRegression(max_iter=500).fit(x, y)
    b = DecisionTreeClassifier(max_depth=3, random_state=0).fit(x, y + 3)  # labels 3..5
    root = tmp_path_factory.mktemp("iris")
    files = {"a": _export(a, x), "b": _export(b, x)}
    (root / "iris.onnx").write_bytes(files["a"])
    (root / "other.onnx").write_bytes(files["b"])
    return {"root": root, "x": x, "files": files,
            "labels": {"a": a.predict(x).astype(np.int64), "b": b.predict(x).astype(np.int64)}}


@pytest.fixture(scope="module")
def url(models: dict[str, Any]) -> Iterator[str]:
    root = models["root"]
    body = f"""builtin_pipelines = false
[[api_keys]]
key = "admin-key-0001"
tenant = "ops"
admin = true
[[api_keys]]
key = "tenant-key-0001"
tenant = "app"
models = ["iris", "other"]
[[models]]
name = "iris"
runtime = "tensor"
path = "{root / 'iris.onnx'}"
max_batch_size = 16
[[models]]
name = "other"
runtime = "tensor"
path = "{root / 'other.onnx'}"
max_batch_size = 16
"""
    with sokuji_server(body) as base:
        yield base.removeprefix("http://")


def _client(url: str) -> Any:
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(url, network_timeout=30)


def _infer(client: Any, name: str, rows: np.ndarray) -> np.ndarray:
    import tritonclient.http as httpclient

    inp = httpclient.InferInput("X", list(rows.shape), "FP32")
    inp.set_data_from_numpy(rows, binary_data=True)
    out = client.infer(name, [inp], headers=TENANT,
                       outputs=[httpclient.InferRequestedOutput("label", binary_data=True)])
    return out.as_numpy("label")


def _replace(path: Path, data: bytes) -> None:
    """A new model file at the same path, as a deploy drops it (written, then renamed)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_reload_under_load_fails_no_request(url: str, models: dict[str, Any]) -> None:
    x, labels = models["x"], models["labels"]
    path = models["root"] / "iris.onnx"
    stop = threading.Event()
    answers: list[tuple[float, str]] = []  # (when the request started, which answered)
    failures: list[str] = []

    def load_generator(seed: int) -> None:
        client, rng = _client(url), np.random.default_rng(seed)
        while not stop.is_set():
            idx = rng.choice(len(x), size=int(rng.integers(1, 9)), replace=False)
            started = time.monotonic()
            try:
                got = _infer(client, "iris", x[idx])
            except Exception as exc:  # noqa: BLE001 - every failure is recorded, then asserted
                failures.append(repr(exc))
                continue
            which = [k for k in ("a", "b") if np.array_equal(got, labels[k][idx])]
            if len(which) != 1 and not np.array_equal(labels["a"][idx], labels["b"][idx]):
                failures.append(f"rows {idx.tolist()}: {got.tolist()} is neither's answer")
            else:
                answers.append((started, which[0] if len(which) == 1 else "either"))

    threads = [threading.Thread(target=load_generator, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    admin = _client(url)
    loaded: list[tuple[float, float, str]] = []  # (load called, load returned, which)
    try:
        time.sleep(0.3)
        for which in ["b", "a"] * 3:
            _replace(path, models["files"][which])
            called = time.monotonic()
            admin.load_model("iris", headers=ADMIN)
            loaded.append((called, time.monotonic(), which))
            assert admin.is_server_ready() and admin.is_model_ready("other", headers=ADMIN)
            time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert failures == []
    assert len(answers) > 200, len(answers)
    seen = {w for _, w in answers}
    assert {"a", "b"} <= seen, seen
    # After a load returned, a request that starts later (before the next load was called)
    # is answered by the new classifier.
    for i, (_, returned, which) in enumerate(loaded):
        until = loaded[i + 1][0] if i + 1 < len(loaded) else float("inf")
        after = [w for t, w in answers if returned < t < until and w != "either"]
        assert after and set(after) == {which}, (i, which, set(after))
    index = {e["name"]: e for e in admin.get_model_repository_index(headers=ADMIN)}
    assert index["iris"]["state"] == "READY" and index["other"]["state"] == "READY"


def test_a_broken_file_fails_its_load_and_the_version_serving_stays(
        url: str, models: dict[str, Any]) -> None:
    from tritonclient.utils import InferenceServerException

    x, path = models["x"], models["root"] / "other.onnx"
    client = _client(url)
    good = _infer(client, "other", x[:5])
    _replace(path, b"this is not an ONNX graph")
    try:
        with pytest.raises(InferenceServerException) as err:
            client.load_model("other", headers=ADMIN)
        assert err.value.status() == "400"
        assert "failed to load 'other'" in err.value.message()
        assert "onnx" in err.value.message().lower() or "protobuf" in err.value.message().lower()
        assert np.array_equal(_infer(client, "other", x[:5]), good)
        assert client.is_model_ready("other", headers=ADMIN)
    finally:
        _replace(path, models["files"]["b"])
    client.load_model("other", headers=ADMIN)
    assert np.array_equal(_infer(client, "other", x[:5]), good)


def test_a_config_override_holds_until_the_next_load(url: str, models: dict[str, Any]) -> None:
    from tritonclient.utils import InferenceServerException

    client, x = _client(url), models["x"]
    client.load_model("iris", headers=ADMIN, config=json.dumps({"max_batch_size": 4}))
    assert client.get_model_config("iris", headers=ADMIN)["max_batch_size"] == 4
    with pytest.raises(InferenceServerException, match="max_batch_size = 4"):
        _infer(client, "iris", x[:8])
    assert len(_infer(client, "iris", x[:4])) == 4
    with pytest.raises(InferenceServerException, match="sequence_batching") as err:
        client.load_model("iris", headers=ADMIN, config='{"sequence_batching": {}}')
    assert err.value.status() == "400"
    client.load_model("iris", headers=ADMIN)  # the config as it is again
    assert client.get_model_config("iris", headers=ADMIN)["max_batch_size"] == 16
    assert len(_infer(client, "iris", x[:8])) == 8


def test_unload_then_load(url: str, models: dict[str, Any]) -> None:
    from tritonclient.utils import InferenceServerException

    client, x = _client(url), models["x"]
    client.unload_model("other", headers=ADMIN)
    assert not client.is_model_ready("other", headers=ADMIN)
    entry = {e["name"]: e for e in client.get_model_repository_index(headers=ADMIN)}["other"]
    assert (entry["state"], entry["reason"]) == ("UNAVAILABLE", "unloaded")
    assert [e["name"] for e in client.get_model_repository_index(headers=ADMIN) if
            e.get("state") == "READY"] == ["iris"]
    with pytest.raises(InferenceServerException) as err:
        _infer(client, "other", x[:2])
    assert err.value.status() == "404"
    assert client.is_server_ready()  # the models served are ready
    client.load_model("other", headers=ADMIN)
    assert client.is_model_ready("other", headers=ADMIN)
    assert np.array_equal(_infer(client, "other", x[:6]), models["labels"]["b"][:6])


def test_only_an_admin_key_controls_the_repository(url: str) -> None:
    import httpx
    from tritonclient.utils import InferenceServerException

    client = _client(url)
    for call in (lambda h: client.get_model_repository_index(headers=h),
                 lambda h: client.load_model("iris", headers=h),
                 lambda h: client.unload_model("iris", headers=h)):
        with pytest.raises(InferenceServerException) as err:
            call(TENANT)
        assert err.value.status() == "403" and "admin" in err.value.message()
        with pytest.raises(InferenceServerException) as err:
            call({})
        assert err.value.status() == "401"
    # An unknown name: 404 that lists no model (keys are configured).
    r = httpx.post(f"http://{url}/v2/repository/models/nope/load", headers=ADMIN)
    assert r.status_code == 404 and r.json()["error"] == "unknown model 'nope'"
    r = httpx.post(f"http://{url}/v2/repository/index", headers=ADMIN, json={"ready": "yes"})
    assert r.status_code == 400 and "'ready'" in r.json()["error"]
    r = httpx.post(f"http://{url}/v2/repository/models/iris/load", headers=ADMIN,
                   json={"parameters": {"file:1/model.onnx": "AAAA"}})
    assert r.status_code == 400 and "parameters.file:1/model.onnx" in r.json()["error"]
    assert client.is_model_ready("iris", headers=ADMIN)


async def test_poll_loads_a_model_file_dropped_at_the_same_path(
        tmp_path: Path, models: dict[str, Any]) -> None:
    """In process, ``repository_poll_s``: a new file at the model's path is loaded by the next
    poll and answers; a broken one fails (its reason logged) and changes nothing."""
    import asyncio
    import tempfile

    from sokuji import config as cfg
    from sokuji.core.model import RequestContext
    from sokuji.core.request import Priority
    from sokuji.repository.control import ModelControl
    from sokuji.repository.models import ModelRepository
    from sokuji.repository.sources import config_source

    x, labels, path = models["x"], models["labels"], tmp_path / "iris.onnx"
    path.write_bytes(models["files"]["a"])
    config = cfg.validate(cfg.ServerConfig(
        models=(cfg.ModelConfig(name="iris", runtime="tensor", path=str(path)),),
        builtin_pipelines=False, dashboard=False, repository_poll_s=0.05,
        cache_dir=tempfile.mkdtemp(prefix="sokuji-test-")))
    repo = await asyncio.to_thread(ModelRepository.load, config)
    repo.start()
    control = ModelControl(config, repo, config_source(config), drain_s=5.0)
    control.start(config.repository_poll_s)
    ctx = RequestContext(tenant="t", priority=Priority.INTERACTIVE, deadline_ns=None,
                         arrival_ns=0)

    async def answer() -> np.ndarray:
        served = repo.get_ready("iris").served
        out = await served.submit(await served.prepare({"X": x[:20]}, ctx), ctx).result()
        return np.asarray(out["label"])

    async def until(check: Any) -> None:
        for _ in range(250):
            if check():
                return
            await asyncio.sleep(0.02)
        raise AssertionError("the poll did not act")

    try:
        assert np.array_equal(await answer(), labels["a"][:20])
        first = repo.models["iris"]
        broken = b"not an ONNX graph"
        path.write_bytes(broken)
        await until(lambda: control._seen.get("iris", (0, (0, 0)))[1][1] == len(broken))
        await asyncio.sleep(0.2)  # (polls that find it as it was: nothing more to do)
        assert repo.models["iris"] is first
        assert np.array_equal(await answer(), labels["a"][:20])
        path.write_bytes(models["files"]["b"])
        await until(lambda: repo.models["iris"] is not first)
        assert np.array_equal(await answer(), labels["b"][:20])
    finally:
        await control.stop()
        await repo.stop()


async def test_a_triton_repository_new_version_and_new_model(
        tmp_path: Path, models: dict[str, Any]) -> None:
    """In process, over a Triton model repository (``model_repository``): a version dropped
    into the model's directory is what the next load serves (version 2, its answers); the
    poll loads a model directory added and unloads one removed."""
    import asyncio
    import shutil

    from sokuji import config as cfg
    from sokuji.core.model import RequestContext
    from sokuji.core.request import Priority
    from sokuji.repository.control import ModelControl
    from sokuji.repository.models import ModelRepository
    from sokuji.repository.sources import source_for

    x, labels, files = models["x"], models["labels"], models["files"]
    root = tmp_path / "repo"
    (root / "iris" / "1").mkdir(parents=True)
    (root / "iris" / "config.pbtxt").write_text('backend: "onnxruntime"\nmax_batch_size: 8\n')
    (root / "iris" / "1" / "model.onnx").write_bytes(files["a"])
    toml = tmp_path / "sokuji.toml"
    toml.write_text(f'model_repository = "{root}"\nbuiltin_pipelines = false\n'
                    f'dashboard = false\ncache_dir = "{tmp_path}"\n')
    config = cfg.load(toml, env={})
    repo = await asyncio.to_thread(ModelRepository.load, config)
    repo.start()
    control = ModelControl(config, repo, source_for(config), drain_s=5.0)
    ctx = RequestContext(tenant="t", priority=Priority.INTERACTIVE, deadline_ns=None,
                         arrival_ns=0)

    async def answer(name: str) -> np.ndarray:
        served = repo.get_ready(name).served
        out = await served.submit(await served.prepare({"X": x[:8]}, ctx), ctx).result()
        return np.asarray(out["label"]).reshape(-1)

    try:
        assert repo.models["iris"].version == "1"
        assert np.array_equal(await answer("iris"), labels["a"][:8])
        (root / "iris" / "2").mkdir()
        (root / "iris" / "2" / "model.onnx").write_bytes(files["b"])
        new = await control.load("iris")
        assert new.version == "2" and repo.models["iris"] is new
        assert np.array_equal(await answer("iris"), labels["b"][:8])
        shutil.copytree(root / "iris", root / "iris_copy")
        assert await control.poll_once() == ["iris_copy"]
        assert np.array_equal(await answer("iris_copy"), labels["b"][:8])
        shutil.rmtree(root / "iris_copy")
        assert await control.poll_once() == ["iris_copy"]
        assert "iris_copy" not in repo.models
        index = {e["name"]: e["state"] for e in await control.index()}
        assert index == {"iris": "READY", "iris_copy": "UNAVAILABLE"}
    finally:
        await control.stop()
        await repo.stop()
