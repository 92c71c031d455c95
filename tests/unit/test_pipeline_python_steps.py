"""A pipeline's ``python`` step is a call of a Python model of its own
(``pipelines/python_step.py``): named ``<pipeline>.<step>``, batched and counted as every
model is, its own queue refusing at once when full, loaded by module or file path, each
call's outcome its own; an ``async def`` step awaited on the server's loop and cancelled
once nobody waits for it; ``workers`` running a sync step in worker processes; a ``model``
step naming a served Python model calling it with the step's arguments."""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import time
from typing import Any

import pytest

from sokuji import config as cfg
from sokuji.core.model import RequestContext
from sokuji.core.request import Priority
from sokuji.errors import ConfigError, Overloaded
from sokuji.pipelines.config import PipelineConfig, StepConfig
from sokuji.repository.models import ModelRepository
from tests.conftest import client_for

HERE = "tests.unit.test_pipeline_python_steps"
STATE: dict[str, Any] = {}


def shout(question: str) -> str:
    return question.upper()


def pid(question: str) -> int:
    return os.getpid()


def tenant(question: str, ctx: RequestContext) -> str:
    return ctx.tenant


async def wait_for_gate(question: str) -> str:
    """Waits until the test sets ``STATE['gate']``; records being cancelled."""
    try:
        await STATE["gate"].wait()
        return "opened"
    except asyncio.CancelledError:
        STATE["cancelled"] = STATE.get("cancelled", 0) + 1
        raise


def blocking(question: str) -> str:
    """Blocks its worker thread until the test sets the threading event."""
    STATE["entered"].set()
    STATE["release"].wait(30)
    return "done"


def server(*pipelines: PipelineConfig, models: tuple[cfg.ModelConfig, ...] = ()
           ) -> cfg.ServerConfig:
    return cfg.validate(cfg.ServerConfig(
        models=(cfg.ModelConfig(name="synth", runtime="synthetic",
                                options={"base_ms": 0.0}), *models),
        pipelines=pipelines, builtin_pipelines=False,
        cache_dir=tempfile.mkdtemp(prefix="sokuji-test-")))


def one(name: str, fn: str, **step: Any) -> PipelineConfig:
    function = fn if ":" in fn else f"{HERE}:{fn}"
    return PipelineConfig(name=name, steps=(StepConfig(
        name="s", kind="python", function=function, inputs={"question": "input.question"},
        **step),))


def infer(client: Any, name: str, question: str) -> Any:
    return client.post(f"/v2/models/{name}/infer", json={"inputs": [
        {"name": "question", "datatype": "BYTES", "shape": [1], "data": [question]}]})


def ctx() -> RequestContext:
    return RequestContext("t", Priority.INTERACTIVE, None, time.perf_counter_ns())


def test_a_step_is_a_model_of_its_own_counted_as_one() -> None:
    with client_for(server(one("p", "shout"))) as client:
        r = infer(client, "p", "hi")
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == ["HI"], r.text
        metrics = client.get("/metrics").text
        assert 'sokuji_batch_size_count{model="p.s"} 1.0' in metrics
        # not addressable: a client reaches the step only through its pipeline
        assert client.get("/v2/models/p.s").status_code == 404


def test_a_function_by_file_path_imports_its_siblings() -> None:
    with client_for(server(one("f", "tests/data/pipesteps/steps_file.py:shout"))) as client:
        r = infer(client, "f", "hi")
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == ["HI!"], r.text


def test_a_bad_function_names_the_steps_key() -> None:
    with pytest.raises(ConfigError, match=r"pipelines\[0\]\.steps\[0\]\.function"):
        client_for(server(one("b", "tests/data/pipesteps/nowhere.py:fn")))
    with pytest.raises(ConfigError, match=r"pipelines\[0\]\.steps\[0\]\.options\.workers"):
        client_for(server(one("b", "tenant", options={"workers": 1})))  # ctx: in-process


def test_a_step_that_takes_ctx_gets_the_requests_context() -> None:
    with client_for(server(one("c", "tenant"))) as client:
        r = infer(client, "c", "hi")
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == ["anonymous"], r.text


async def test_an_async_step_nobody_waits_for_is_cancelled() -> None:
    """Mutant: ``LoopRuns.drop_unwanted`` never cancelling: the coroutine would wait on (the
    gate is never opened) and ``cancelled`` stay unset."""
    STATE.clear()
    STATE["gate"] = asyncio.Event()
    repo = ModelRepository.load(server(one("a", "wait_for_gate", timeout_ms=50)))
    repo.start()
    try:
        pipe = repo.models["a"].served
        handle = pipe.submit(await pipe.prepare({"question": "q"}, ctx()), ctx())
        with pytest.raises(Exception, match="took longer than 50 ms"):
            await handle.result()
        batcher = pipe.owned[0].batcher
        for _ in range(200):
            if STATE.get("cancelled") and not batcher.num_running_batches:
                break
            await asyncio.sleep(0.01)
        assert STATE.get("cancelled") == 1
        assert batcher.num_running_batches == 0  # its slot is free again
    finally:
        STATE["gate"].set()  # (the mutant's coroutine ends: stop waits for running batches)
        await repo.stop()


async def test_async_steps_run_concurrently_on_the_servers_loop() -> None:
    """Three requests wait on one gate at once: sequential runs would never all start."""
    STATE.clear()
    STATE["gate"] = asyncio.Event()
    repo = ModelRepository.load(server(one("a", "wait_for_gate")))
    repo.start()
    try:
        pipe = repo.models["a"].served
        handles = [pipe.submit(await pipe.prepare({"question": "q"}, ctx()), ctx())
                   for _ in range(3)]
        model = pipe.owned[0]
        for _ in range(200):
            if model.batcher.num_running_batches == 3:
                break
            await asyncio.sleep(0.01)
        assert model.batcher.num_running_batches == 3
        STATE["gate"].set()
        assert [await h.result() for h in handles] == ["opened"] * 3
    finally:
        await repo.stop()


async def test_a_full_steps_queue_refuses_at_once() -> None:
    """A sync step held in its one worker thread; its queue of one fills; the next request
    is refused by the step's model (429 semantics), not queued without bound."""
    STATE.clear()
    STATE["entered"], STATE["release"] = threading.Event(), threading.Event()
    pipe_cfg = one("q", "blocking", options={"thread": True, "max_batch_size": 1,
                                             "max_queue_depth": 1})
    repo = ModelRepository.load(server(pipe_cfg))
    repo.start()
    try:
        pipe = repo.models["q"].served
        model = pipe.owned[0]
        first = pipe.submit(await pipe.prepare({"question": "1"}, ctx()), ctx())
        await asyncio.to_thread(STATE["entered"].wait, 30)
        second = pipe.submit(await pipe.prepare({"question": "2"}, ctx()), ctx())
        for _ in range(200):
            if model.batcher.num_waiting == 1:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(Overloaded):
            pipe.check_admission()
        STATE["release"].set()
        assert await first.result() == "done" and await second.result() == "done"
    finally:
        STATE["release"].set()
        await repo.stop()


def test_workers_run_a_sync_step_in_worker_processes() -> None:
    with client_for(server(one("w", "pid", options={"workers": 1}))) as client:
        r = infer(client, "w", "hi")
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["data"] != [os.getpid()]


def test_a_model_step_calls_a_served_python_model_with_its_arguments() -> None:
    served = cfg.ModelConfig(name="shouter", runtime="python", max_batch_size=4,
                             options={"entry": f"{HERE}:shout"})
    pipe = PipelineConfig(name="m", steps=(StepConfig(
        name="call", kind="model", model="shouter", inputs={"question": "input.question"}),))
    with client_for(server(pipe, models=(served,))) as client:
        r = infer(client, "m", "hey")
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == ["HEY"], r.text
