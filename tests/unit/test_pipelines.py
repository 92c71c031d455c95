"""Pipelines: the graph checks, concurrency of independent steps, per-step timing, failures
named by step, timeouts and fallbacks, admission and the response cache, over HTTP (V2) with
the synthetic model and Python steps defined here."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import msgspec
import pytest
from starlette.testclient import TestClient

from sokuji import config as cfg
from sokuji.core.model import RequestContext
from sokuji.core.request import Priority
from sokuji.errors import ConfigError, InvalidInput, Overloaded
from sokuji.pipelines.config import PipelineConfig, StepConfig
from tests.conftest import client_for

HERE = "tests.unit.test_pipelines"
CALLS: dict[str, int] = {}


# -- the steps' functions ------------------------------------------------------------------------
class Meeting:
    """Two steps that can only finish if they run at the same time: each waits for the
    other to arrive (a sequential executor would wait forever: the step times out)."""

    arrived: ClassVar[dict[str, asyncio.Event]] = {}

    @classmethod
    async def meet(cls, me: str, other: str) -> None:
        cls.arrived.setdefault(me, asyncio.Event()).set()
        await cls.arrived.setdefault(other, asyncio.Event()).wait()


async def left(question: str) -> dict[str, Any]:
    await Meeting.meet("left", "right")
    return {"upper": question.upper()}


async def right(question: str) -> str:
    await Meeting.meet("right", "left")
    return question[::-1]


def join(up: str, rev: str, vec: Any) -> str:
    CALLS["join"] = CALLS.get("join", 0) + 1
    return f"{up}|{rev}|{len(vec)}"


def boom(question: str) -> str:
    raise ValueError("no answer for " + question)


def refuse(question: str) -> str:
    raise InvalidInput("this step refuses the question", param="question")


async def slow(question: str, options: dict[str, Any]) -> str:
    await asyncio.sleep(options["seconds"])
    return "late"


def echo(question: str, ctx: RequestContext) -> str:
    return f"{question}:{ctx.tenant}"


# -- configs --------------------------------------------------------------------------------------
def step(name: str, fn: str = "", **kw: Any) -> StepConfig:
    if fn:
        kw.setdefault("kind", "python")
        kw["function"] = f"{HERE}:{fn}"
    return StepConfig(name=name, **kw)


DIAMOND = (
    step("left", "left", inputs={"question": "input.question"}, timeout_ms=10_000),
    step("right", "right", inputs={"question": "input.question"}, timeout_ms=10_000),
    step("embed", kind="model", model="synth", inputs={"texts": "input.question"}),
    step("join", "join", inputs={"up": "left.upper", "rev": "right", "vec": "embed"}),
)


def server(*pipelines: PipelineConfig, cache: bool = False) -> cfg.ServerConfig:
    return cfg.validate(cfg.ServerConfig(
        models=(cfg.ModelConfig(name="synth", runtime="synthetic",
                                options={"base_ms": 0.0}),),
        pipelines=pipelines, builtin_pipelines=False, cache=cfg.CacheConfig(enabled=cache),
        cache_dir=tempfile.mkdtemp(prefix="sokuji-test-")))


def infer(client: TestClient, name: str, question: str, **headers: str) -> Any:
    return client.post(f"/v2/models/{name}/infer", headers=headers, json={
        "inputs": [{"name": "question", "datatype": "BYTES", "shape": [1],
                    "data": [question]}]})


@pytest.fixture
def diamond() -> Iterator[TestClient]:
    Meeting.arrived = {}
    CALLS.clear()
    pipes = (
        PipelineConfig(name="diamond", steps=DIAMOND, extra_outputs=("right",)),
        PipelineConfig(name="failing", steps=(step("boom", "boom", inputs={
            "question": "input.question"}),)),
        PipelineConfig(name="refusing", steps=(step("refuse", "refuse", inputs={
            "question": "input.question"}),)),
        PipelineConfig(name="slow", steps=(
            step("slow", "slow", inputs={"question": "input.question"}, timeout_ms=50,
                 options={"seconds": 5.0}),)),
        PipelineConfig(name="fallback", steps=(
            step("slow", "slow", inputs={"question": "input.question"}, timeout_ms=50,
                 options={"seconds": 5.0}, on_error="fallback", fallback="fallback text"),
            step("echo", "echo", inputs={"question": "slow"}))),
    )
    with client_for(server(*pipes, cache=True)) as client:
        yield client


# -- the graph ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("steps", "key", "why"), [
    ((step("a", "echo", inputs={"question": "b"}), step("b", "echo", inputs={"question": "a"})),
     "pipelines[0].steps[0].inputs", "cycle"),
    ((step("a", "echo", inputs={"question": "input.nope"}),),
     "pipelines[0].steps[0].inputs.question", "no such pipeline input"),
    ((step("a", "echo", inputs={"question": "ghost.x"}),),
     "pipelines[0].steps[0].inputs.question", "<step>"),
    ((step("a", "echo", inputs={"question": "a"}),),
     "pipelines[0].steps[0].inputs.question", "own output"),
    ((step("a", "echo"), step("a", "echo")), "pipelines[0].steps[1].name", "duplicate"),
    ((step("a", kind="model", model="nope"),), "pipelines[0].steps[0].model", "configured"),
    ((step("a", kind="python", function="no colon"),), "pipelines[0].steps[0].function",
     "package.module:function"),
    ((step("a", "echo", on_error="fallback"),), "pipelines[0].steps[0].fallback", "fallback"),
    ((step("a", "echo", after=("zz",)),), "pipelines[0].steps[0].after", "no such"),
])
def test_a_bad_graph_is_refused_naming_the_key(steps: tuple[StepConfig, ...], key: str,
                                               why: str) -> None:
    with pytest.raises(ConfigError) as err:
        server(PipelineConfig(name="p", steps=steps))
    assert f"'{key}'" in err.value.message and why in err.value.message


def test_a_pipeline_named_like_a_model_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"pipelines\[0\]\.name"):
        server(PipelineConfig(name="synth", steps=(step("a", "echo"),)))


def test_unknown_keys_in_a_step_are_refused_by_the_schema() -> None:
    with pytest.raises(ConfigError, match="unknown key"):
        cfg.load(env={}, overrides=None, path=_toml(
            '[[models]]\nname="synth"\nruntime="synthetic"\n'
            '[[pipelines]]\nname="p"\n[[pipelines.steps]]\nname="a"\nkind="python"\n'
            'function="x:y"\ntimeot_ms=5\n'))


def _toml(text: str) -> str:
    f = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)  # noqa: SIM115
    f.write(text)
    f.close()
    return f.name


def test_an_unimportable_function_is_refused_at_start() -> None:
    config = server(PipelineConfig(name="p", steps=(
        StepConfig(name="a", kind="python", function="tests.nowhere:fn"),)))
    with pytest.raises(ConfigError, match="cannot be imported"):
        client_for(config)


# -- running --------------------------------------------------------------------------------------
def test_independent_steps_run_concurrently_and_each_is_timed(diamond: TestClient) -> None:
    r = infer(diamond, "diamond", "abc")
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert out["join"]["data"] == ["ABC|cba|1"] and out["right"]["data"] == ["cba"]
    timing = r.headers["server-timing"]
    for name in ("decode", "step.left", "step.right", "step.embed", "step.join",
                 "critical-path", "total"):
        assert f"{name};dur=" in timing, name
    spans = {}
    for part in r.headers["x-sokuji-pipeline-steps"].split(", "):
        name, start, dur = part.split(";")
        s = float(start.removeprefix("start="))
        spans[name] = (s, s + float(dur.removeprefix("dur=")))
    (a0, a1), (b0, b1) = spans["left"], spans["right"]
    assert a0 < b1 and b0 < a1  # they overlapped
    assert spans["join"][0] >= max(a1, b1, spans["embed"][1]) - 0.01  # after all three
    critical = timing.split("critical-path;")[1].split('desc="')[1].split('"')[0]
    assert critical.endswith(">join") and critical.split(">")[0] in ("left", "right", "embed")


def test_metadata_and_metrics_of_a_pipeline(diamond: TestClient) -> None:
    meta = diamond.get("/v2/models/diamond").json()
    assert meta["platform"] == "sokuji_pipeline"
    assert [i["name"] for i in meta["inputs"]] == ["question", "user", "messages"]
    assert [o["name"] for o in meta["outputs"]] == ["join", "right"]
    assert infer(diamond, "diamond", "x").status_code == 200
    assert infer(diamond, "failing", "x").status_code == 502
    text = diamond.get("/metrics").text
    assert 'sokuji_pipeline_step_duration_seconds_count{pipeline="diamond",step="join"} 1.0' \
        in text
    assert 'sokuji_pipeline_step_outcomes_total{outcome="failed",pipeline="failing",' \
        'step="boom"} 1.0' in text


def test_a_failing_step_is_named_and_is_not_a_500(diamond: TestClient) -> None:
    """The exception's type is told, never its text: it may hold a request's data (the
    step's model answers as every Python model does)."""
    r = infer(diamond, "failing", "q")
    assert r.status_code == 502
    error = r.json()["error"]
    assert "pipeline 'failing', step 'boom'" in error and "raised ValueError" in error, error
    assert "no answer for" not in error
    r = infer(diamond, "refusing", "q")  # a step's own 4xx keeps its status
    assert r.status_code == 400 and "step 'refuse': this step refuses" in r.json()["error"]


def test_a_step_over_its_timeout_fails_with_504_or_gives_its_fallback(
        diamond: TestClient) -> None:
    t0 = time.perf_counter()
    r = infer(diamond, "slow", "q")
    assert r.status_code == 504 and "step 'slow': took longer than 50 ms (its timeout_ms)" \
        in r.json()["error"]
    assert time.perf_counter() - t0 < 4.0  # not the step's 5 s
    r = infer(diamond, "fallback", "q")
    assert r.status_code == 200
    assert r.json()["outputs"][0]["data"] == ["fallback text:anonymous"]
    assert 'step.slow;dur=' in r.headers["server-timing"]
    assert 'fallback"' in r.headers["server-timing"].split("step.slow;")[1].split(",")[0]


def test_the_request_deadline_bounds_every_step(diamond: TestClient) -> None:
    r = infer(diamond, "slow", "q", **{"X-Sokuji-Timeout-Ms": "20"})
    assert r.status_code == 504 and "the request's deadline" in r.json()["error"]
    # The slow step is cut at the deadline and falls back; the next cannot start in time.
    r = infer(diamond, "fallback", "q", **{"X-Sokuji-Timeout-Ms": "20"})
    assert r.status_code == 504
    assert "step 'echo': the request's deadline passed before this step could start" \
        in r.json()["error"]


@pytest.mark.parametrize(("body", "why"), [
    ({"inputs": []}, "needs input 'question'"),
    ({"inputs": [{"name": "question", "datatype": "BYTES", "shape": [1], "data": ["a"]},
                 {"name": "nope", "datatype": "BYTES", "shape": [1], "data": ["a"]}]},
     "unexpected input 'nope'"),
    ({"inputs": [{"name": "question", "datatype": "BYTES", "shape": [2], "data": ["a"]}]},
     "does not match"),
    ({"inputs": [{"name": "question", "datatype": "BYTES", "shape": [1], "data": [1]}]},
     "must be strings"),
    ({"inputs": [{"name": "question", "datatype": "FOO", "shape": [1], "data": ["a"]}]},
     "unsupported datatype"),
    ({"inputs": "x"}, "'inputs' must be a non-empty list"),
])
def test_bad_inputs_get_a_400_naming_them(diamond: TestClient, body: Any, why: str) -> None:
    r = diamond.post("/v2/models/diamond/infer", json=body)
    assert r.status_code == 400 and why in r.json()["error"], r.text


def test_binary_tensors_are_refused(diamond: TestClient) -> None:
    blob = b"\x01\x00\x00\x00q"
    head = b'{"inputs":[{"name":"question","datatype":"BYTES","shape":[1],' \
        b'"parameters":{"binary_data_size":5}}]}'
    r = diamond.post("/v2/models/diamond/infer", content=head + blob,
                     headers={"Inference-Header-Content-Length": str(len(head)),
                              "Content-Type": "application/octet-stream"})
    assert r.status_code == 400 and "binary" in r.json()["error"]


def test_whole_answers_come_from_the_response_cache(diamond: TestClient) -> None:
    first = infer(diamond, "diamond", "cached?")
    Meeting.arrived = {}
    second = infer(diamond, "diamond", "cached?")
    assert first.json()["outputs"] == second.json()["outputs"]
    assert CALLS["join"] == 1 and 'cache;dur=' in second.headers["server-timing"]
    assert 'desc="hit"' in second.headers["server-timing"]
    Meeting.arrived = {}
    infer(diamond, "diamond", "cached?", **{"Cache-Control": "no-cache"})
    assert CALLS["join"] == 2


def test_two_tenants_sending_the_same_input_get_their_own_cached_answers() -> None:
    """Kills the mutant: keying the response cache of pipelines as one tenant for everyone
    (``server/inference.py`` ``_cached``: ``cache_key("", ...)`` when the model is a
    pipeline). The step answers with the caller's tenant, so a shared entry would hand
    tenant ``bolt`` what ``acme`` was answered; the hit marker shows the second is a miss."""
    keys = (cfg.ApiKey(key="key-of-acme-0001", tenant="acme"),
            cfg.ApiKey(key="key-of-bolt-0002", tenant="bolt"))
    config = cfg.validate(cfg.ServerConfig(
        models=(cfg.ModelConfig(name="synth", runtime="synthetic", options={"base_ms": 0.0}),),
        pipelines=(PipelineConfig(name="whoami", steps=(
            step("echo", "echo", inputs={"question": "input.question"}),)),),
        builtin_pipelines=False, cache=cfg.CacheConfig(enabled=True), api_keys=keys,
        cache_dir=tempfile.mkdtemp(prefix="sokuji-test-")))
    with client_for(config) as client:
        def ask(key: str) -> tuple[str, str]:
            r = infer(client, "whoami", "same question", Authorization=f"Bearer {key}")
            assert r.status_code == 200, r.text
            timing = r.headers["server-timing"]
            return r.json()["outputs"][0]["data"][0], timing

        assert ask(keys[0].key)[0] == "same question:acme"
        answer, timing = ask(keys[0].key)
        assert answer == "same question:acme" and 'desc="hit"' in timing  # the cache is on
        answer, timing = ask(keys[1].key)
        assert 'desc="miss"' in timing, timing
        assert answer == "same question:bolt"  # its own answer, not acme's
        answer, timing = ask(keys[1].key)
        assert answer == "same question:bolt" and 'desc="hit"' in timing  # its own entry


def test_a_pipeline_is_not_an_encoder_or_a_generator(diamond: TestClient) -> None:
    r = diamond.post("/v1/embeddings", json={"model": "diamond", "input": "x"})
    assert r.status_code == 400 and "does not serve /v1/embeddings" in \
        r.json()["error"]["message"]
    r = diamond.post("/v1/chat/completions", json={
        "model": "diamond", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "does not serve /v1/chat/completions" in \
        r.json()["error"]["message"]


async def test_admission_bounds_the_requests_in_flight() -> None:
    from sokuji.repository.models import ModelRepository

    Meeting.arrived = {}
    config = server(PipelineConfig(name="one", steps=DIAMOND[:2], max_concurrency=1,
                                       output="right"))
    repo = ModelRepository.load(config)
    repo.start()
    try:
        pipe = repo.models["one"].served
        ctx = RequestContext("t", Priority.INTERACTIVE, None, time.perf_counter_ns())
        prepared = await pipe.prepare({"question": "q"}, ctx)
        Meeting.arrived["right"] = asyncio.Event()  # right waits for left; left ...
        handle = pipe.submit(prepared, ctx)
        with pytest.raises(Overloaded):
            pipe.check_admission()
        assert await handle.result() == "q"
        pipe.check_admission()  # done: room again
        assert pipe.in_flight == 0
    finally:
        await repo.stop()


def test_an_oversized_input_is_refused_before_any_step(diamond: TestClient) -> None:
    r = infer(diamond, "diamond", "x" * (64 * 1024 + 1))
    assert r.status_code == 413 and "characters" in r.json()["error"]
    assert "join" not in CALLS


class _Store:
    """A stand-in feature store holding rows by id and recording the ids it is asked for
    (the real Feast store is tested in tests/integration/test_features.py and through the
    rag pipeline)."""

    def __init__(self, rows: dict[str, str]) -> None:
        self.rows = rows
        self.asked: list[str] = []

    def entities(self) -> dict[str, list[str]]:
        return {"user": ["plan"]}

    def get(self, entity: str, entity_id: str, features: list[str]) -> dict[str, object]:
        self.asked.append(entity_id)
        return {"plan": self.rows.get(entity_id)}


def _feature_step(store: _Store, *, keyed: bool) -> Any:
    from sokuji.pipelines.steps import Resources, build_step

    res = Resources(models={}, cache_dir="", stores={"users": store}, keyed=keyed)
    return build_step(StepConfig(name="f", kind="features", options={"features": ["plan"]}),
                      "at", res)


def _ctx(tenant: str) -> RequestContext:
    return RequestContext(tenant, Priority.INTERACTIVE, None, time.perf_counter_ns())


async def test_feature_ids_are_namespaced_by_tenant_when_keys_exist() -> None:
    """One tenant cannot read another's users' features by guessing their ids."""
    store = _Store({"acme:ada": "pro"})
    step = _feature_step(store, keyed=True)
    assert await step({"entity_id": "ada"}, _ctx("acme"), None) == {"plan": "pro"}
    assert await step({"entity_id": "ada"}, _ctx("globex"), None) == {"plan": None}
    assert await step({"entity_id": "acme:ada"}, _ctx("globex"), None) == {"plan": None}
    assert store.asked == ["acme:ada", "globex:ada", "globex:acme:ada"]
    with pytest.raises(InvalidInput):
        await step({"entity_id": "x" * 257}, _ctx("acme"), None)


async def test_a_separator_in_the_id_does_not_reach_another_tenants_row() -> None:
    """The replay of finding 2: tenant ``acme`` sending ``corp:user-0001`` read tenant
    ``acme:corp``'s row ``user-0001`` when ids were joined as ``f"{tenant}:{id}"``."""
    from sokuji.features.tenant_ids import scoped

    store = _Store({scoped("acme:corp", "user-0001"): "enterprise"})
    step = _feature_step(store, keyed=True)
    assert await step({"entity_id": "user-0001"}, _ctx("acme:corp"), None) == \
        {"plan": "enterprise"}
    assert await step({"entity_id": "corp:user-0001"}, _ctx("acme"), None) == {"plan": None}
    assert store.asked[0] != store.asked[1]
    assert scoped("a%3Ab", "c") != scoped("a:b", "c")  # the escape is escaped too


async def test_a_keyed_tenant_named_anonymous_does_not_read_the_open_rows() -> None:
    """With keys, every tenant's ids are scoped, whatever it is called: a tenant named
    ``anonymous`` (the open server's one tenant) reads neither the built-in rows nor what an
    open server stored; the open server itself reads ids as given (the built-in demo)."""
    store = _Store({"user-0001": "free"})
    keyed = _feature_step(store, keyed=True)
    assert await keyed({"entity_id": "user-0001"}, _ctx("anonymous"), None) == {"plan": None}
    assert store.asked == ["anonymous:user-0001"]
    open_server = _feature_step(store, keyed=False)
    assert await open_server({"entity_id": "user-0001"}, _ctx("anonymous"), None) == \
        {"plan": "free"}


@pytest.mark.skipif(not os.environ.get("SOKUJI_TEST_REDIS_URL"),
                    reason="SOKUJI_TEST_REDIS_URL not set")
def test_whole_answers_are_cached_in_redis_too() -> None:
    """A pipeline's packed output tensors round-trip through the Redis backend."""
    Meeting.arrived = {}
    CALLS.clear()
    url = os.environ["SOKUJI_TEST_REDIS_URL"]
    config = cfg.validate(msgspec.structs.replace(
        server(PipelineConfig(name="diamond", steps=DIAMOND, extra_outputs=("right",)),
               cache=True),
        cache=cfg.CacheConfig(backend="redis", redis_url=url)))
    question = f"redis {time.time_ns()}?"
    with client_for(config) as c:
        first = infer(c, "diamond", question)
        Meeting.arrived = {}
        second = infer(c, "diamond", question)
    assert first.status_code == second.status_code == 200, first.text
    assert first.json()["outputs"] == second.json()["outputs"]
    assert CALLS["join"] == 1 and 'desc="hit"' in second.headers["server-timing"]
