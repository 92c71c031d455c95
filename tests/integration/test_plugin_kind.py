"""A kind from a package outside Sokuji's tree (``tests/plugin_kind``: ``runtime = "echo"``,
``y = x * scale`` after ``delay_ms``), installed for real (pip, offline, into a temporary
directory) and served by ``sokuji serve``: found through the ``sokuji.kinds`` entry points,
its options checked when the config loads, its model answering V2 infer, metadata, readiness
and statistics like a built-in one."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import requests

from tests.conftest import ROOT
from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

PLUGIN = ROOT / "tests" / "plugin_kind"
SCALE = 2.5
CONFIG = f"""
builtin_pipelines = false
[[models]]
name = "echo"
runtime = "echo"
[models.options]
scale = {SCALE}
delay_ms = 5

[[models]]
name = "slow"
runtime = "echo"
max_concurrency = 1
[models.options]
delay_ms = 400
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plug-in installed by pip (no index, no build isolation: offline) into a directory
    of its own, as a user's environment would hold it: its dist-info names the entry point."""
    tmp = tmp_path_factory.mktemp("plugin")
    src = tmp / "src"  # (a build writes build/ and *.egg-info beside its sources: a copy)
    shutil.copytree(PLUGIN, src, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                    "--no-build-isolation", "--disable-pip-version-check", "--quiet",
                    "--target", str(tmp / "site"), str(src)],
                   check=True, capture_output=True, timeout=120)
    assert (tmp / "site" / "sokuji_echo_kind-0.1.0.dist-info" / "entry_points.txt").is_file()
    return tmp / "site"


@pytest.fixture(scope="module")
def plugin_path(site: Path) -> Iterator[dict[str, str]]:
    """The environment of a ``sokuji serve`` that sees the plug-in (set for the module's
    servers too: they inherit it)."""
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", path)
        yield {**os.environ}


@pytest.fixture(scope="module")
def url(plugin_path: dict[str, str]) -> Iterator[str]:
    with sokuji_server(CONFIG) as base:
        yield base


def infer(url: str, model: str, x: list[float]) -> requests.Response:
    return requests.post(f"{url}/v2/models/{model}/infer", timeout=30, json={
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [len(x)], "data": x}]})


def test_v2_infer_answers_x_times_scale(url: str) -> None:
    x = [1.0, -2.0, 0.3, 1e6, 0.0]
    r = infer(url, "echo", x)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model_name"] == "echo"
    [y] = out["outputs"]
    assert (y["name"], y["datatype"], y["shape"]) == ("y", "FP32", [len(x)])
    expected = np.asarray(x, dtype=np.float32) * np.float32(SCALE)
    np.testing.assert_array_equal(np.asarray(y["data"], dtype=np.float32), expected)


def test_its_report_reaches_the_response(url: str) -> None:
    r = infer(url, "echo", [4.0, 5.0])
    assert r.headers["x-echo-scale"] == "2.5"
    timing = r.headers["server-timing"]
    echo = next(p.strip() for p in timing.split(",") if p.strip().startswith("echo;"))
    assert 'desc="scale 2.5"' in echo
    assert float(echo.split("dur=")[1].split(";")[0]) >= 5.0  # its delay_ms
    assert "infer;dur=" in timing


def test_binary_input_and_what_only_the_model_refuses(url: str) -> None:
    def binary(x: np.ndarray) -> requests.Response:
        head = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32",
                                         "shape": [len(x)],
                                         "parameters": {"binary_data_size": x.nbytes}}]})
        return requests.post(f"{url}/v2/models/echo/infer", data=head + x.tobytes(),
                             timeout=30, headers={
                                 "content-type": "application/octet-stream",
                                 "inference-header-content-length": str(len(head))})

    ok = binary(np.array([7.0, 8.5], dtype=np.float32))
    assert ok.status_code == 200, ok.text
    assert ok.json()["outputs"][0]["data"] == [17.5, 21.25]
    nan = binary(np.array([1.0, np.nan], dtype=np.float32))  # (JSON cannot carry a NaN)
    assert nan.status_code == 400
    assert nan.json()["code"] == "invalid_input" and "finite" in nan.json()["error"]


def test_the_codec_checks_its_metadata(url: str) -> None:
    r = requests.post(f"{url}/v2/models/echo/infer", timeout=30, json={
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3, 4]}]})
    assert r.status_code == 400 and "shape" in r.json()["error"]


def test_a_repeated_request_is_answered_by_the_cache(url: str) -> None:
    x = [0.125, 9.0, -3.5]
    first, again = infer(url, "echo", x), infer(url, "echo", x)
    assert again.json()["outputs"] == first.json()["outputs"]
    assert "x-sokuji-served-by" not in first.headers
    assert again.headers["x-sokuji-served-by"] == "cache"


def test_admission_is_the_models(url: str) -> None:
    """``slow`` takes one request at a time (``max_concurrency = 1``) for 400 ms: of two at
    once, one is answered and one refused with 429 and a Retry-After."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda v: infer(url, "slow", [v]), [1.0, 2.0]))
    assert sorted(r.status_code for r in both) == [200, 429], [r.text for r in both]
    refused = next(r for r in both if r.status_code == 429)
    assert refused.headers["retry-after"] == "1"


def test_metadata_ready_config_and_stats(url: str) -> None:
    meta = requests.get(f"{url}/v2/models/echo", timeout=10).json()
    assert meta == {"name": "echo", "versions": ["1"], "platform": "echo",
                    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
                    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}]}
    assert requests.get(f"{url}/v2/models/echo/ready", timeout=10).status_code == 200
    assert requests.get(f"{url}/v2/health/ready", timeout=10).status_code == 200
    config = requests.get(f"{url}/v2/models/echo/config", timeout=10).json()
    assert config["backend"] == "echo" and config["max_batch_size"] == 0
    assert config["parameters"]["sokuji_runtime"] == {"string_value": "echo"}

    assert infer(url, "echo", [11.0, 12.0, 13.0]).status_code == 200
    stats: dict[str, Any] = {}
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # (counted just after the reply is written)
        [stats] = requests.get(f"{url}/v2/models/echo/stats", timeout=10).json()["model_stats"]
        if stats["inference_stats"]["success"]["count"] >= 1:
            break
        time.sleep(0.05)
    assert stats["name"] == "echo"
    infer_stage = stats["inference_stats"]["compute_infer"]
    assert infer_stage["count"] >= 1 and infer_stage["ns"] >= 5_000_000  # delay_ms each


def start_fails(env: dict[str, str], tmp_path: Path, config: str) -> str:
    """``sokuji serve`` of ``config``: it must exit before serving; its stderr."""
    path = tmp_path / "sokuji.toml"
    path.write_text(f'cache_dir = "{tmp_path}"\nbuiltin_pipelines = false\n{config}')
    done = subprocess.run([sys.executable, "-m", "sokuji", "serve", "--config", str(path)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.returncode, done.stderr)
    return done.stderr


@pytest.mark.parametrize(("options", "key", "why"), [
    ('scale = "big"', "models[0].options.scale", "not a valid number"),
    ("delay_ms = -1", "models[0].options.delay_ms", "must be zero or more"),
    ("delay = 5", "models[0].options.delay", "unknown"),
    ("delay_ms = 500", "models[0].options.delay_ms", "default_timeout_ms"),  # kind.check
])
def test_a_wrong_option_stops_start_up_naming_it(plugin_path: dict[str, str], tmp_path: Path,
                                                 options: str, key: str, why: str) -> None:
    stderr = start_fails(plugin_path, tmp_path, "[[models]]\nname = \"e\"\nruntime = \"echo\"\n"
                         f"default_timeout_ms = 100\noptions = {{ {options} }}\n")
    assert f"'{key}'" in stderr and why in stderr, stderr


def test_an_unknown_runtime_lists_the_plugins(plugin_path: dict[str, str],
                                              tmp_path: Path) -> None:
    stderr = start_fails(plugin_path, tmp_path, '[[models]]\nname = "e"\nruntime = "ehco"\n')
    assert "'models[0].runtime'" in stderr, stderr
    known = stderr.split("must be one of:")[1]
    assert "echo" in [name.strip() for name in known.split(",")] and "onnx" in known, stderr
