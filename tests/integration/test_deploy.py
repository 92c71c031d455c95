"""The deployment files (Dockerfile, deploy/kserve/*.yaml) against the code they deploy: the
manifests carry what KServe reads, their ports are Sokuji's defaults, the image installs what
``make install`` installs, and the image's own command line (ENTRYPOINT + CMD, and the
ServingRuntime's args) serves a real Triton model repository when run here with the venv's
``sokuji``. No image is built here (docs/deploy.md: no registry is reachable)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sokuji import config as cfg

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
KSERVE = ROOT / "deploy" / "kserve"
MODEL_DIR = "/mnt/models"  # where KServe's storage initializer puts storageUri's files


def _instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def _exec_form(name: str) -> list[str]:
    values = [rest for word, rest in _instructions() if word == name]
    assert len(values) == 1, f"one {name} expected, found {values}"
    argv = json.loads(values[0])  # exec form: a JSON array (shell form would wrap it in sh -c)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    return argv


def _yaml(name: str) -> dict[str, Any]:
    docs = list(yaml.safe_load_all((KSERVE / name).read_text()))
    assert len(docs) == 1
    doc = docs[0]
    assert isinstance(doc, dict)
    return doc


def _runtime_container() -> dict[str, Any]:
    containers = _yaml("servingruntime.yaml")["spec"]["containers"]
    assert [c["name"] for c in containers] == ["kserve-container"]
    return dict(containers[0])


# --- the manifests ---------------------------------------------------------------------------


def test_serving_runtime_carries_what_kserve_reads() -> None:
    rt = _yaml("servingruntime.yaml")
    assert rt["apiVersion"] == "serving.kserve.io/v1alpha1"
    assert rt["kind"] == "ServingRuntime"
    assert rt["metadata"]["name"]
    spec = rt["spec"]
    formats = {f["name"]: f for f in spec["supportedModelFormats"]}
    assert {"onnx", "triton"} <= set(formats)
    assert all(isinstance(f.get("version", ""), str) for f in formats.values())  # quoted
    assert set(spec["protocolVersions"]) == {"v2", "grpc-v2"}
    container = _runtime_container()
    assert container["image"]
    assert MODEL_DIR in container["args"]


def test_runtime_ports_and_probes_are_sokujis_defaults() -> None:
    defaults = cfg.ServerConfig()
    container = _runtime_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    # Knative's names: http1 for HTTP/1.1, h2c for gRPC (HTTP/2 cleartext)
    assert ports == {"http1": defaults.port, "h2c": defaults.grpc_port}
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    assert int(env.get("SOKUJI_GRPC_PORT", defaults.grpc_port)) == defaults.grpc_port
    assert "--port" not in container["args"] and "--host" not in container["args"]
    probe = container["readinessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/v2/health/ready", defaults.port)
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"


def test_inference_service_uses_the_runtime() -> None:
    isvc = _yaml("inferenceservice.yaml")
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    assert isvc["kind"] == "InferenceService"
    model = isvc["spec"]["predictor"]["model"]
    runtime = _yaml("servingruntime.yaml")
    assert model["runtime"] == runtime["metadata"]["name"]
    supported = {(f["name"], f["version"]) for f in runtime["spec"]["supportedModelFormats"]}
    assert (model["modelFormat"]["name"], model["modelFormat"]["version"]) in supported
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    assert re.match(r"^(gs|s3|pvc|https?|hdfs|webhdfs|oci)://", model["storageUri"])


# --- the Dockerfile --------------------------------------------------------------------------


def test_dockerfile_base_user_ports_healthcheck() -> None:
    ins = _instructions()
    assert ins[0] == ("FROM", "python:3.11-slim")
    users = [rest for word, rest in ins if word == "USER"]
    assert users and users[-1] not in ("root", "0")
    exposed = {int(p) for word, rest in ins if word == "EXPOSE" for p in rest.split()}
    defaults = cfg.ServerConfig()
    assert exposed == {defaults.port, defaults.grpc_port}
    (health,) = [rest for word, rest in ins if word == "HEALTHCHECK"]
    assert "/v2/health/ready" in health
    assert _exec_form("ENTRYPOINT")[:2] == ["sokuji", "serve"]


def _pip_installs(lines: list[str]) -> list[tuple[str, ...]]:
    """Each ``pip install``'s package arguments (options dropped; extras kept sorted)."""
    out = []
    for line in lines:
        for command in re.split(r"&&|;", line):
            words = shlex.split(command)
            if "pip" not in words or "install" not in words:
                continue
            args = words[words.index("install") + 1:]
            pkgs: list[str] = []
            skip = False
            for a in args:
                if skip:
                    skip = False
                elif a in ("--extra-index-url", "--index-url", "-i"):
                    skip = True
                elif not a.startswith("-"):
                    pkgs.append(a)
            if pkgs == ["pip"]:  # the upgrade of pip itself
                continue
            out.append(tuple(_normal(p) for p in pkgs))
    return out


def _normal(spec: str) -> str:
    m = re.fullmatch(r"\.\[([^\]]*)\]", spec)
    return f".[{','.join(sorted(m.group(1).split(',')))}]" if m else spec


def test_dockerfile_installs_what_make_install_installs() -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # `make -n -B install`: the Makefile's install recipe with its $(foreach ...) expanded
    made = subprocess.run(["make", "-n", "-B", "-C", str(ROOT), "install"], check=True,
                          capture_output=True, text=True).stdout.splitlines()
    want = _pip_installs([line for line in made if not line.lstrip().startswith("#")])
    got = _pip_installs([rest for word, rest in _instructions() if word == "RUN"])
    assert any(p[0].startswith(".[") for p in want), want  # the parse found the extras
    assert got == want
    (run,) = [rest for word, rest in _instructions() if word == "RUN" and "'.[" in rest]
    assert 'CMAKE_ARGS="-DGGML_NATIVE=OFF"' in run  # a portable llama.cpp build


def test_dockerignore_keeps_local_state_out() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".venv", ".cache", "benchmarks/results", "site"} <= ignored


# --- the image's command line, run here ------------------------------------------------------


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real model in Triton's layout: iris, the Triton-repository tests' own config."""
    pytest.importorskip("skl2onnx")
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    from tests.integration.test_triton_repository import IRIS_CONFIG, _onnx, _put

    x, y = load_iris(return_X_y=True)
    root = tmp_path_factory.mktemp("deploy") / "models"
    model = LogisticRegression(max_iter=500).fit(x, y)
    _put(root, "iris", IRIS_CONFIG, {1: _onnx(model, 4), 2: _onnx(model, 4)})
    return root


def _sokuji_argv(argv: list[str], repository: Path) -> list[str]:
    """The container's argv as it would run, with only two substitutions: the venv's
    ``sokuji`` for the image's, and the test repository for /mnt/models."""
    assert argv[0] == "sokuji" and argv.count(MODEL_DIR) == 1, argv
    sokuji = Path(sys.executable).with_name("sokuji")
    assert sokuji.exists(), sokuji
    return [str(sokuji), *(str(repository) if a == MODEL_DIR else a for a in argv[1:])]


@pytest.fixture(params=["dockerfile", "servingruntime"])
def served(request: pytest.FixtureRequest, repository: Path,
           tmp_path: Path) -> Iterator[tuple[str, int]]:
    """``sokuji serve`` from the Dockerfile's ENTRYPOINT + CMD, or from its ENTRYPOINT + the
    ServingRuntime's args (which replace CMD, as Kubernetes does), on free ports (the
    environment the container would get: SOKUJI_PORT and SOKUJI_GRPC_PORT, as a user sets
    them with -e)."""
    from tests.integration.serving import free_port, wait_ready

    tail = (_exec_form("CMD") if request.param == "dockerfile"
            else [str(a) for a in _runtime_container()["args"]])
    argv = _sokuji_argv(_exec_form("ENTRYPOINT") + tail, repository)
    port, grpc_port = free_port(), free_port()
    env = {**os.environ, "SOKUJI_PORT": str(port), "SOKUJI_GRPC_PORT": str(grpc_port),
           "SOKUJI_CACHE_DIR": str(tmp_path), "SOKUJI_LOG_LEVEL": "warning"}
    env.pop("SOKUJI_CONFIG", None)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/v2/health/ready")
        yield f"http://127.0.0.1:{port}", grpc_port
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=20)


@pytest.mark.integration
def test_the_images_command_serves_a_model_repository(served: tuple[str, int]) -> None:
    url, grpc_port = served
    with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=5) as r:
        assert r.status == 200
    with urllib.request.urlopen(f"{url}/v2/models/iris", timeout=5) as r:
        meta = json.loads(r.read())
    assert meta["name"] == "iris" and meta["platform"] == "onnxruntime_onnx"
    assert meta["versions"] == ["2", "1"]
    assert [i["name"] for i in meta["inputs"]] == ["float_input"]
    # The gRPC port answers too (KServe's grpc-v2): Triton's own client
    grpcclient = pytest.importorskip("tritonclient.grpc")
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        assert client.is_server_ready()
        assert client.get_model_metadata("iris").name == "iris"
    finally:
        client.close()


def _healthcheck(port: int) -> int:
    """The Dockerfile's HEALTHCHECK command (shell form, as the runtime runs it with sh -c),
    with the venv's python for the image's; its exit status."""
    (health,) = [rest for word, rest in _instructions() if word == "HEALTHCHECK"]
    command = health.split(" CMD ", 1)[1].strip()
    assert command.startswith("python ")
    command = shlex.quote(sys.executable) + command.removeprefix("python")
    env = {**os.environ, "SOKUJI_PORT": str(port)}
    return subprocess.run(["sh", "-c", command], env=env, capture_output=True,
                          timeout=30).returncode


@pytest.mark.integration
def test_the_healthcheck_passes_on_a_ready_server_only(served: tuple[str, int]) -> None:
    from tests.integration.serving import free_port

    url, _ = served
    assert _healthcheck(int(url.rsplit(":", 1)[1])) == 0
    assert _healthcheck(free_port()) != 0  # nothing listening: unhealthy
