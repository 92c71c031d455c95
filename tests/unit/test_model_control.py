"""Model control in process (``repository/control.py``) over real synthetic models: what a
reload does to the requests that hold the old version (they finish on it; it stops only
after the last one lets go), that loads of one model run one at a time, that a failed load
leaves the version serving, that a model others were built over is not swapped under them,
and the poll. Over HTTP, with tritonclient and ONNX models:
tests/integration/test_model_control.py."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import msgspec
import pytest

from sokuji import config as cfg
from sokuji.core.model import RequestContext
from sokuji.core.request import Priority
from sokuji.errors import LoadFailed, ModelNotFound
from sokuji.repository.control import ModelControl
from sokuji.repository.models import ModelRepository
from sokuji.repository.sources import Source, config_source


def _config(**options: object) -> cfg.ServerConfig:
    opts: dict[str, object] = {"base_ms": 0.0}
    opts.update(options)
    return cfg.validate(cfg.ServerConfig(
        models=(cfg.ModelConfig(name="a", runtime="synthetic", options=opts),
                cfg.ModelConfig(name="b", runtime="synthetic", options={"base_ms": 0.0}),
                cfg.ModelConfig(name="c", runtime="synthetic", options={"base_ms": 0.0}),
                cfg.ModelConfig(name="r", runtime="router",
                                options={"kind": "rules", "default": "b"})),
        builtin_pipelines=False, dashboard=False,
        cache_dir=tempfile.mkdtemp(prefix="sokuji-test-")))


def _ctx() -> RequestContext:
    return RequestContext(tenant="t", priority=Priority.INTERACTIVE, deadline_ns=None,
                          arrival_ns=time.perf_counter_ns())


@pytest.fixture
async def control() -> AsyncIterator[ModelControl]:
    config = _config(base_ms=150.0)
    repo = await asyncio.to_thread(ModelRepository.load, config)
    repo.start()
    control = ModelControl(config, repo, config_source(config), drain_s=10.0)
    try:
        yield control
    finally:
        await control.stop()
        await repo.stop()


async def _infer(model: object) -> object:
    served = model.served  # type: ignore[attr-defined]
    prepared = await served.prepare(["x"], _ctx())
    return await served.submit(prepared, _ctx()).result()


async def test_requests_holding_the_old_version_finish_on_it(control: ModelControl) -> None:
    repo = control.repo
    old = repo.get_ready("a")
    old_served = old.served
    running = asyncio.create_task(_infer(old))  # a 150 ms batch in flight
    await asyncio.sleep(0.02)
    held = repo.get_ready("a")  # a request that has looked the model up, not yet submitted
    new = await control.load("a")
    assert repo.models["a"] is new and new.served is not old_served
    assert repo.ready  # ready throughout: the old one served until the swap
    del old
    assert len(await running) == 1  # the batch in flight finished on the old version
    assert old_served.alive  # still held: not stopped
    assert len(await _infer(held)) == 1  # submitted after the swap: the old one takes it
    assert control.retiring
    del held  # the last holder lets go: the old version stops, then closes
    await asyncio.wait_for(asyncio.gather(*control.retiring), 5)
    assert not old_served.alive and new.served.alive
    assert len(await _infer(repo.get_ready("a"))) == 1


async def test_loads_of_one_model_run_one_at_a_time(control: ModelControl) -> None:
    inside, most = 0, 0
    resolve = control.source.resolve
    lock = threading.Lock()

    def slow(name: str, override: object) -> cfg.ModelConfig:
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        time.sleep(0.05)
        with lock:
            inside -= 1
        return resolve(name, override)  # type: ignore[arg-type]

    control.source = replace(control.source, resolve=slow)
    await asyncio.gather(*(control.load("a") for _ in range(3)), control.load("c"))
    assert most == 2  # "a" one at a time, "c" beside it
    assert repo_versions(control) == {"a": "1", "b": "1", "c": "1", "r": "1"}


def repo_versions(control: ModelControl) -> dict[str, str]:
    return {n: m.version for n, m in control.repo.models.items() if m.ready}


async def test_a_failed_load_leaves_the_version_serving(control: ModelControl) -> None:
    before = control.repo.models["a"]
    with pytest.raises(LoadFailed, match=r"failed to load 'a': .*max_queue_size"):
        await control.load("a", '{"dynamic_batching": {"default_queue_policy": '
                                '{"max_queue_size": 0}}}')
    with pytest.raises(LoadFailed, match="field 'sequence_batching' is not one"):
        await control.load("a", {"sequence_batching": {}})
    with pytest.raises(LoadFailed, match="not JSON"):
        await control.load("a", "{max_batch_size: 4")
    assert control.repo.models["a"] is before and before.ready
    assert await control.index() == [
        {"name": n, "version": "1", "state": "READY", "reason": ""} for n in ("a", "b", "c", "r")]
    new = await control.load("a", '{"max_batch_size": 4, "instance_group": [{"count": 2}]}')
    assert (new.config.max_batch_size, new.config.instances) == (4, 2)
    with pytest.raises(ModelNotFound, match="unknown model 'nope'"):
        await control.load("nope")


async def test_a_model_others_hold_is_not_swapped_under_them(control: ModelControl) -> None:
    assert control.repo.models["r"].uses == {"b"}
    with pytest.raises(LoadFailed, match="'r' built over it"):
        await control.load("b")
    with pytest.raises(Exception, match="'r' built over it"):
        await control.unload("b")
    await control.unload("b", dependents=True)
    assert set(control.repo.models) == {"a", "c"}
    states = {e["name"]: (e["state"], e["reason"]) for e in await control.index()}
    assert states == {"a": ("READY", ""), "b": ("UNAVAILABLE", "unloaded"),
                      "c": ("READY", ""), "r": ("UNAVAILABLE", "unloaded")}
    assert [e["name"] for e in await control.index(ready_only=True)] == ["a", "c"]
    await control.load("b")
    await control.load("r")
    assert control.repo.models["r"].uses == {"b"} and control.repo.ready


async def test_poll_loads_what_the_source_adds_and_unloads_what_it_drops(
        control: ModelControl) -> None:
    names = ["a", "b", "c", "r"]
    base = control.source
    control.source = Source(lambda: list(names), base.resolve)
    assert await control.poll_once() == []  # nothing changed
    names.remove("r")
    assert await control.poll_once() == ["r"]
    assert "r" not in control.repo.models
    names.append("r")
    assert await control.poll_once() == ["r"]
    assert control.repo.models["r"].ready


def test_through_the_app_the_old_version_is_let_go_and_stopped() -> None:
    """Over the whole app (metrics, dashboard, the response cache): after a reload, nothing
    the server keeps holds the old version, so it stops as soon as its requests are done."""
    from tests.conftest import client_for

    config = cfg.validate(msgspec.structs.replace(_config(), dashboard=True))
    with client_for(config) as client:
        body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                            "data": ["hello"]}]}
        first = client.post("/v2/models/a/infer", json=body)
        assert first.status_code == 200
        control = client.app.control.control  # type: ignore[attr-defined]
        old = control.repo.models["a"].served
        assert client.post("/v2/repository/models/a/load").status_code == 200
        deadline = time.monotonic() + 5
        while (old.alive or control.retiring) and time.monotonic() < deadline:
            time.sleep(0.01)  # the retirement runs on the app's loop, in its thread
        assert not old.alive and not control.retiring
        again = client.post("/v2/models/a/infer", json=body)
        assert again.status_code == 200
        assert again.json()["outputs"] == first.json()["outputs"]
        assert 'sokuji_queue_depth{model="a"}' in client.get("/metrics").text

