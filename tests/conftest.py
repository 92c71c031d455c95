from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from sokuji import config as cfg
from sokuji.observability.metrics import Metrics
from sokuji.repository import registry
from sokuji.repository.models import ModelRepository
from sokuji.server.app import create_app
from tests.integration.ray_cluster import ray_head, stop_unless_needed  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
# With pytest-xdist (`pytest -n 2 --dist loadgroup`; `make test` runs one worker), each
# worker has its own Redis database (gw0: the configured one, gw1: the next), so one
# worker's FLUSHDB never empties the other's (files with a database of their own, 12 and
# 13, run on one worker: see the groups below).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and os.environ.get("SOKUJI_TEST_REDIS_URL"):
    _base, _, _db = os.environ["SOKUJI_TEST_REDIS_URL"].rpartition("/")
    os.environ["SOKUJI_TEST_REDIS_URL"] = f"{_base}/{int(_db or 0) + int(_WORKER[2:])}"
# One export of the built-in model per checkout, shared by every test run (it takes seconds).
CACHE_DIR = Path(os.environ.get("SOKUJI_TEST_CACHE_DIR", ROOT / ".cache" / "sokuji"))


def client_for(config: cfg.ServerConfig) -> TestClient:
    metrics = Metrics()
    repo = ModelRepository.load(config, on_batch=metrics.batch_observer)
    return TestClient(create_app(config, repo, metrics), base_url="http://localhost",
                      raise_server_exceptions=False)  # a name a loopback server answers to


def options_of(model: cfg.ModelConfig) -> Any:
    """``model``'s options as the server builds it from them: checked and completed by its
    kind when the config loads (``config.validate``: an option error raises here, naming
    ``models[0].options.<key>``), then parsed by the kind as the repository does."""
    cfg.validate(cfg.ServerConfig(models=(model,), cache_dir=str(CACHE_DIR),
                                  builtin_pipelines=False))
    return registry.get(model.runtime).parse(model, "models[0]")


def synthetic_config(**model: object) -> cfg.ServerConfig:
    base: dict[str, object] = {"name": "synth", "runtime": "synthetic", "max_batch_size": 8,
                               "options": {"base_ms": 0.0}}
    base.update(model)
    return cfg.validate(cfg.ServerConfig(models=(cfg.ModelConfig(**base),),  # type: ignore[arg-type]
                                         max_request_bytes=64 * 1024,
                                         cache_dir=tempfile.mkdtemp(prefix="sokuji-test-")))


@pytest.fixture
def synth() -> Iterator[TestClient]:
    with client_for(synthetic_config()) as client:
        yield client


@pytest.fixture(scope="session")
def minilm_config() -> cfg.ServerConfig:
    return cfg.validate(cfg.ServerConfig(models=(cfg.ModelConfig(name="minilm"),),
                                         cache_dir=str(CACHE_DIR)))


@pytest.fixture(scope="session")
def minilm(minilm_config: cfg.ServerConfig) -> Iterator[TestClient]:
    with client_for(minilm_config) as client:
        yield client


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for pytest-xdist (``--dist loadgroup``): a file's tests run on one worker, so
    its module fixtures (a served model, a server process) start once; the files that share
    a session fixture share a group: the Ray tests (one cluster, fixed ports), the hostile
    suite (one server with every kind)."""
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if "ray_head" in getattr(item, "fixturenames", ()) or "ray" in Path(path).name:
            group = "ray"
        elif path.startswith("tests/hostile/"):
            group = "hostile"
        else:
            group = path
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """The Ray tests' cluster stops as soon as the next test does not use it."""
    stop_unless_needed(item, nextitem)


REDIS_SKIP = "SOKUJI_TEST_REDIS_URL not set"
"""The start of every Redis-backed test's skip reason (counted by the summary below)."""


def pytest_report_header(config: pytest.Config) -> str:
    url = os.environ.get("SOKUJI_TEST_REDIS_URL")
    return f"redis: {url}" if url else (
        "redis: SOKUJI_TEST_REDIS_URL not set: the Redis-backed tests will be SKIPPED "
        "(`make test` starts one; or `make redis` and SOKUJI_TEST_REDIS_URL=redis://127.0.0.1:6399/0)")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config
                            ) -> None:
    """A run without Redis says so loudly at its end: how many tests it skipped for it."""
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if REDIS_SKIP in str(getattr(r, "longrepr", ""))]
    if skipped:
        terminalreporter.write_sep(
            "!", f"{len(skipped)} Redis-backed tests SKIPPED: SOKUJI_TEST_REDIS_URL not set "
            "(`make test` runs them against a real Redis)", red=True, bold=True)
