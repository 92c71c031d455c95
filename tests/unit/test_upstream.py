"""The upstream runtime (``sokuji/routing/upstream*.py``) against a small aiohttp server in the
test's own loop that answers exactly the faults to test: statuses with Retry-After, a hang
after the headers, a stream that drops, a keep-alive connection closed under a reused
request, a redirect, a huge body; the bearer key from the environment."""

from __future__ import annotations

import asyncio
import base64
import email.utils
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson
import pytest
from aiohttp import web

from sokuji.config import ModelConfig
from sokuji.core.model import RequestContext
from sokuji.core.request import Priority, Stage, Timeline
from sokuji.errors import ConfigError, DeadlineExceeded, Overloaded, SokujiError
from sokuji.llm.request import Delta, Finish
from sokuji.routing.config import UpstreamOptions
from sokuji.routing.upstream import UpstreamModel
from sokuji.routing.upstream_codec import (
    SseParser,
    completion_request,
    embeddings,
    v2_output,
)
from sokuji.server import llm_codec

TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Stub:
    def __init__(self) -> None:
        self.mode = "ok"
        self.retry_after = "7"
        self.timeouts: list[int | None] = []
        self.seen: list[Any] = []
        self.elsewhere = 0
        self.release = asyncio.Event()
        self.gone = asyncio.Event()
        self.url = ""

    async def meta(self, request: web.Request) -> web.Response:
        return web.json_response({
            "name": "m", "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [-1]}],
            "outputs": [{"name": "emb", "datatype": "FP32", "shape": [-1, 3]}]})

    async def infer(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(request.headers.copy())
        doc = await request.json()
        mode = self.mode
        if mode == "ok":
            texts = doc["inputs"][0]["data"]
            assert doc["inputs"][0]["name"] == "TEXT" and doc["id"] == "r-1"
            self.timeouts.append(doc.get("parameters", {}).get("timeout"))
            rows = np.asarray([[len(t), 1, 2] for t in texts], dtype="<f4")
            head = orjson.dumps({"outputs": [{"name": "emb", "datatype": "FP32",
                                              "shape": list(rows.shape),
                                              "parameters": {"binary_data_size": rows.nbytes}}]})
            return web.Response(body=head + rows.tobytes(), headers={
                "inference-header-content-length": str(len(head)),
                "server-timing": "infer;dur=0.2, total;dur=0.28"})
        if mode.isdigit():
            status = int(mode)
            headers = {"retry-after": self.retry_after} if status in (429, 503) else {}
            body = {"error": {"message": "bad field 'x' " + "y" * 2000, "param": "x"}} \
                if status == 400 else {"error": "secret-token-in-body"}
            return web.json_response(body, status=status, headers=headers)
        if mode == "redirect":
            raise web.HTTPFound("/elsewhere")
        if mode == "huge":
            return web.Response(body=b"x" * 100_000)
        if mode == "huge_chunked":
            resp = web.StreamResponse()
            await resp.prepare(request)
            for _ in range(10):
                await resp.write(b"x" * 10_000)
            return resp
        assert mode == "hang"
        resp = web.StreamResponse()
        await resp.prepare(request)
        await self.release.wait()
        return resp

    async def bounce(self, request: web.Request) -> web.Response:
        self.elsewhere += 1
        return web.json_response({})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(request.headers.copy())
        doc = await request.json()
        assert doc["stream"] is True and doc["stream_options"] == {"include_usage": True}
        if self.mode.isdigit():
            return web.json_response({"error": {"message": "slow down"}},
                                     status=int(self.mode), headers={"retry-after": "3"})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        chat = request.path == "/v1/chat/completions"

        def part(text: str | None) -> dict[str, Any]:
            return ({"delta": {"content": text} if text else {}} if chat else
                    {"text": text or ""})

        events: list[dict[str, Any]] = [
            {"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]}]
        events += [{"choices": [{**part(t), "finish_reason": None}]} for t in ("Hel", "lo", " you")]
        events += [{"choices": [{**part(None), "finish_reason": "stop"}]},
                   {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                                             "prompt_tokens_details": {"cached_tokens": 7}}}]
        raw = b"".join(b"data: " + orjson.dumps(e) + b"\r\n\r\n" for e in events)
        if self.mode == "ok":  # one byte at a time through an event, then the rest at once
            for i in range(40):
                await resp.write(raw[i:i + 1])
            await resp.write(raw[40:] + b": server-timing x\n\ndata: [DONE]\n\n")
            return resp
        await resp.write(raw[:raw.rindex(b"data: ", 0, raw.index(b" you"))])  # two deltas
        if self.mode == "drop":
            assert request.transport is not None
            request.transport.close()
            return resp
        if self.mode == "error_event":
            await resp.write(b'event: error\ndata: {"error": {"message": "engine died"}}\n\n')
            return resp
        try:  # "slow" / "stall": keep the stream open; note when the client leaves
            while self.mode == "slow":
                await resp.write(b": keep-alive\n\n")
                await asyncio.sleep(0.02)
            await self.release.wait()
        except (ConnectionError, RuntimeError):
            self.gone.set()
        return resp


@pytest.fixture
async def stub() -> AsyncIterator[Stub]:
    s = Stub()
    app = web.Application()
    app.add_routes([web.get("/v2/models/m", s.meta), web.post("/v2/models/m/infer", s.infer),
                    web.get("/elsewhere", s.bounce), web.post("/v1/chat/completions", s.chat),
                    web.post("/v1/completions", s.chat)])
    runner = web.AppRunner(app, shutdown_timeout=0.2, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    s.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield s
    s.release.set()
    await runner.cleanup()


def ctx(tenant: str = "t1", deadline_ms: float | None = None,
        traceparent: str | None = TRACE, timeline: Timeline | None = None) -> RequestContext:
    now = time.perf_counter_ns()
    return RequestContext(tenant=tenant, priority=Priority.BATCH, arrival_ns=now,
                          deadline_ns=None if deadline_ms is None else now + int(deadline_ms * 1e6),
                          request_id="r-1", traceparent=traceparent, timeline=timeline)


async def started(url: str, max_queue_depth: int = 64, tenants: tuple[str, ...] = (),
                  **options: Any) -> UpstreamModel:
    options.setdefault("protocol", "v2")
    opts = UpstreamOptions(url=url, upstream_model="m", **options)
    model = UpstreamModel(ModelConfig(name="far", runtime="upstream",
                                      max_queue_depth=max_queue_depth), opts, tenants)
    await asyncio.to_thread(model.load)
    model.start()
    return model


async def infer(model: UpstreamModel, texts: list[str], c: RequestContext | None = None
                ) -> np.ndarray:
    c = c or ctx()
    return await model.submit(await model.prepare(texts, c), c).result()


async def failure(model: UpstreamModel, c: RequestContext | None = None) -> SokujiError:
    with pytest.raises(SokujiError) as exc:
        await infer(model, ["hello"], c)
    return exc.value


def test_sse_parser_and_completion_body() -> None:
    parser = SseParser()
    raw = b'data: {"a": 1}\r\n\r\n: comment\n\nevent: error\ndata: x\ndata: y\n\ndata: [DO'
    out = [e for i in range(len(raw)) for e in parser.feed(raw[i:i + 1])]
    assert out == [("message", '{"a": 1}'), ("error", "x\ny")]
    assert parser.feed(b"NE]\n\n") == [("message", "[DONE]")]
    req = llm_codec.decode(orjson.dumps({"model": "ours", "prompt": "Hi", "max_tokens": 5,
                                         "stop": ["\n"], "seed": 3, "temperature": 0}), False)
    path, body = completion_request(req, "theirs")
    doc = orjson.loads(body)
    assert path == "/v1/completions" and doc["model"] == "theirs" and doc["prompt"] == "Hi"
    assert (doc["max_tokens"], doc["stop"], doc["seed"], doc["temperature"]) == (5, ["\n"], 3, 0)


def test_answers_as_rows() -> None:
    doc = {"outputs": [{"name": "other", "datatype": "INT64", "shape": [2],
                        "parameters": {"binary_data_size": 16}},
                       {"name": "emb", "datatype": "FP16", "shape": [2, 2],
                        "data": [1, 2, 3, 4]}]}
    head = orjson.dumps(doc)
    rows = v2_output(head + bytes(16), str(len(head)), "emb")
    assert rows.dtype == np.float32 and rows.tolist() == [[1, 2], [3, 4]]
    vec = np.asarray([0.5, -1.0], "<f4")
    answer = {"data": [{"index": 1, "embedding": [1.0, 2.0]},
                       {"index": 0, "embedding": base64.b64encode(vec.tobytes()).decode()}]}
    assert embeddings(answer, 2, "far").tolist() == [[0.5, -1.0], [1.0, 2.0]]
    with pytest.raises(ValueError, match="1 embeddings for 2"):
        embeddings({"data": [{"embedding": [1.0]}]}, 2, "far")


async def test_v2_answers_with_metadata_headers_and_keys(stub: Stub,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UP_KEY", "up-secret")
    monkeypatch.setenv("T2_KEY", "t2-secret")
    model = await started(stub.url, api_key_env="UP_KEY", tenant_keys_env={"t2": "T2_KEY"})
    codes: list[Any] = []
    model.on_attempt = lambda name, code, s: codes.append((name, code))
    assert model.metadata.inputs[0].name == "text"
    assert (model.metadata.outputs[0].name, model.metadata.outputs[0].shape) == ("emb", (-1, 3))
    out = await infer(model, ["a", "hello"], ctx(deadline_ms=5000))
    assert out.dtype == np.float32 and out.tolist() == [[1, 1, 2], [5, 1, 2]]
    await infer(model, ["a"], ctx("t2", traceparent="not-a-trace"))
    first, second = stub.seen
    assert first["Authorization"] == "Bearer up-secret"  # never the client's key
    assert second["Authorization"] == "Bearer t2-secret" and "traceparent" not in second
    assert first["traceparent"] == TRACE and first["X-Sokuji-Priority"] == "batch"
    assert 0 < float(first["X-Sokuji-Timeout-Ms"]) <= 5000 and first["X-Request-Id"] == "r-1"
    assert codes == [("far", 200), ("far", 200)] and model.in_flight == 0
    assert stub.timeouts[1] is None and 0 < (stub.timeouts[0] or 0) <= 5_000_000  # us
    await model.stop()


@pytest.mark.parametrize(("mode", "retry_after", "status", "retry"), [
    ("429", "7", 429, 7), ("429", "", 429, 1),
    ("429", "date+60", 429, 60),
    ("503", "5", 503, 5), ("500", "", 502, None), ("401", "", 502, None),
    ("400", "", 400, None), ("404", "", 404, None), ("422", "", 422, None)])
async def test_status_mapping(stub: Stub, mode: str, retry_after: str, status: int,
                              retry: int | None) -> None:
    model = await started(stub.url)
    if retry_after == "date+60":  # an HTTP-date 60 s ahead, made now (not at collection)
        retry_after = email.utils.formatdate(time.time() + 60, usegmt=True)
    stub.mode, stub.retry_after = mode, retry_after
    exc = await failure(model)
    assert exc.status == status and getattr(exc, "before_response", None) is False
    got = getattr(exc, "retry_after_s", None)
    assert got == retry or (retry == 60 and got is not None and 55 <= got <= 61)
    assert exc.headers.get("retry-after") == (str(got) if retry is not None else None)
    assert len(exc.message) < 600
    if mode == "401":  # our credential is wrong: the upstream's body is not shown
        assert "secret-token" not in exc.message and "api_key_env" in exc.message
    if status == 429:
        assert isinstance(exc, Overloaded)
    if mode == "400":
        assert exc.message.startswith("upstream 'm' of model 'far': bad field") \
            and exc.param == "x"
    await model.stop()


async def test_redirect_is_not_followed_and_huge_bodies_are_refused(stub: Stub) -> None:
    model = await started(stub.url, max_response_bytes=1024)
    stub.mode = "redirect"
    exc = await failure(model)
    assert exc.status == 502 and "redirect" in exc.message and stub.elsewhere == 0
    for mode in ("huge", "huge_chunked"):
        stub.mode = mode
        exc = await failure(model)
        assert exc.status == 502 and "max_response_bytes" in exc.message
    await model.stop()


async def test_timeouts_and_deadlines(stub: Stub) -> None:
    model = await started(stub.url, timeout_ms=300)
    stub.mode = "hang"  # headers, then nothing until the test ends
    t0 = time.perf_counter()
    exc = await failure(model)
    assert isinstance(exc, DeadlineExceeded) and exc.status == 504
    assert exc.before_response is False and exc.target_fault is True  # type: ignore[attr-defined]
    assert 0.25 <= time.perf_counter() - t0 < 20  # the budget, not the hang
    await model.stop()
    model = await started(stub.url)  # timeout_ms 30 s: the deadline is the bound
    stub.seen.clear()
    exc = await failure(model, ctx(deadline_ms=1000))
    assert exc.status == 504 and exc.before_response is False  # type: ignore[attr-defined]
    assert len(stub.seen) == 1 and float(stub.seen[0]["X-Sokuji-Timeout-Ms"]) <= 1000
    calls = len(stub.seen)
    with pytest.raises(DeadlineExceeded):  # passed already: the upstream is not called
        model.submit(await model.prepare(["a"], ctx()), ctx(deadline_ms=-1))
    assert len(stub.seen) == calls and model.in_flight == 0
    await model.stop()


async def test_admission_counts_requests_in_flight(stub: Stub) -> None:
    model = await started(stub.url, max_queue_depth=2)
    stub.mode = "hang"
    calls = [model.submit(await model.prepare(["a"], ctx()), ctx()) for _ in range(2)]
    with pytest.raises(Overloaded):
        model.check_admission()
    assert model.capacity().num_running == 2 and model.alive
    for call in calls:
        call.cancel()
    await asyncio.gather(*(c.result() for c in calls), return_exceptions=True)
    await asyncio.sleep(0)
    assert model.in_flight == 0
    model.check_admission()
    await model.stop()
    assert not model.alive


async def test_unreachable_upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    closed = "http://127.0.0.1:9"  # discard port: nothing listens
    with pytest.raises(ConfigError, match=r"127\.0\.0\.1:9"):
        await started(closed)
    model = await started(closed, dims=4, connect_timeout_ms=20000)
    assert model.metadata.outputs[0].shape == (-1, 4)
    codes: list[Any] = []
    model.on_attempt = lambda name, code, s: codes.append(code)
    exc = await failure(model)
    assert exc.status == 503 and exc.before_response is True  # type: ignore[attr-defined]
    assert codes == ["connect_error"]
    await model.stop()
    with pytest.raises(ConfigError, match="NOT_SET_ANYWHERE"):
        await started(closed, dims=4, api_key_env="NOT_SET_ANYWHERE")


async def test_a_reused_connection_closed_by_the_server_is_retried_once() -> None:
    """A raw server: the first request on each connection is answered (keep-alive); the
    second is read and the connection closed without a byte (its idle close racing our
    reuse). ``fresh`` closes the first request too: not a reused connection, no retry."""
    state = {"fresh": False, "connections": 0}
    answer = orjson.dumps({"data": [{"index": 0, "embedding": [1.0]}],
                           "usage": {"prompt_tokens": 2}})

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state["connections"] += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                if served or state["fresh"]:
                    break
                served += 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(answer), answer))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    model = await started(url, protocol="openai", task="embeddings")
    codes: list[Any] = []
    model.on_attempt = lambda name, code, s: codes.append(code)
    prepared = await model.prepare(["hi"], ctx())
    assert (await model.submit(prepared, ctx()).result()).tolist() == [[1.0]]
    assert prepared.num_tokens == 2
    before = state["connections"]
    assert (await infer(model, ["hi"])).tolist() == [[1.0]]
    assert codes == [200, "disconnected", 200] and state["connections"] == before + 1
    await model.stop()
    state["fresh"] = True
    model = await started(url, protocol="openai", task="embeddings", dims=1)
    model.on_attempt = lambda name, code, s: codes.append(code)
    codes.clear()
    exc = await failure(model)
    assert exc.status == 503 and exc.before_response is True  # type: ignore[attr-defined]
    assert codes == ["connect_error"]
    await model.stop()
    server.close()


async def chat(model: UpstreamModel, body: dict[str, Any], tenant: str = "t1") -> Any:
    req = llm_codec.decode(orjson.dumps({"model": "far", **body}), "messages" in body)
    c = ctx(tenant)
    return model.submit(await model.prepare(req, c), c)


async def drain(gen: Any) -> tuple[str, Finish, int]:
    texts, deltas = [], 0
    while True:
        for event in await gen.next_events():
            if isinstance(event, Delta):
                texts.append(event.text)
                deltas += 1
            else:
                return "".join(texts), event, deltas


async def test_generation_streams_through(stub: Stub) -> None:
    model = await started(stub.url, protocol="openai", task="chat")
    codes: list[Any] = []
    model.on_attempt = lambda name, code, s: codes.append(code)
    gen = await chat(model, {"messages": [{"role": "user", "content": "hi"}], "seed": 1})
    text, finish, deltas = await drain(gen)
    assert (text, finish.reason, finish.error, finish.completion_tokens) == \
        ("Hello you", "stop", None, 3)
    assert deltas == 3 and gen.timing.prompt_tokens == 9 and "ttft" in gen.timing.server_timing()
    gen = await chat(model, {"prompt": "hi", "max_tokens": 3})  # plain completions
    text, finish, _ = await drain(gen)
    assert (text, finish.reason) == ("Hello you", "stop")
    stub.mode = "429"
    first = await (await chat(model, {"prompt": "hi"})).next_events()
    assert isinstance(first[0], Finish) and first[0].error is not None
    assert first[0].error.status == 429 and first[0].error.headers["retry-after"] == "3"
    assert codes == [200, 200, 429] and model.in_flight == 0
    await model.stop()


@pytest.mark.parametrize(("mode", "status"), [("drop", 502), ("error_event", 502),
                                              ("stall", 504)])
async def test_a_broken_stream_ends_with_an_error(stub: Stub, mode: str, status: int) -> None:
    model = await started(stub.url, protocol="openai", task="chat", timeout_ms=300)
    stub.mode = mode
    text, finish, _ = await drain(await chat(model, {"prompt": "hi"}))
    assert text == "Hello" and finish.error is not None and finish.error.status == status
    assert finish.reason == ("deadline" if status == 504 else "error")
    assert "engine died" in finish.error.message or mode != "error_event"
    await model.stop()


async def test_cancel_closes_the_upstream_stream(stub: Stub) -> None:
    model = await started(stub.url, protocol="openai", task="chat")
    stub.mode = "slow"
    gen = await chat(model, {"prompt": "hi"})
    assert all(isinstance(e, Delta) for e in await gen.next_events())
    gen.cancel()
    _, finish, _ = await drain(gen)
    assert finish.reason == "cancelled" and finish.error is None
    await asyncio.wait_for(stub.gone.wait(), 10)  # the upstream saw the disconnect
    await asyncio.sleep(0)
    assert model.in_flight == 0
    await model.stop()


@pytest.mark.parametrize(("keys", "own"), [
    ({}, ()),  # docs/routing.md's example: api_key_env alone, every tenant on it
    ({"t1": "K1", "t2": "K2", "t3": "K3"}, ("t1", "t2", "t3")),
    ({"t1": "K1", "t2": "K1", "t3": "K3"}, ("t3",)),  # one key under two tenants
    ({"t1": "K1"}, ("t1",)),  # t2 and t3 share api_key_env's
    ({"t1": "UP"}, ()),  # t1's key is api_key_env's, which t2 and t3 are sent with
])
async def test_a_shared_upstream_credential_reveals_nothing_of_the_upstreams_state(
        stub: Stub, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        keys: dict[str, str], own: tuple[str, ...]) -> None:
    """Issue 25: tenant 2 probing tenant 1's prompt through a shared upstream key read the
    upstream's cached_tokens (18 for a wrong guess, 20 for the right one) and its
    Server-Timing. Only a tenant whose upstream key is its own sees them."""
    for var in ("UP", "K1", "K2", "K3"):
        monkeypatch.setenv(var, f"{var.lower()}-secret")
    tenants = ("t1", "t2", "t3")
    env = {t: var for t, var in keys.items()}
    with caplog.at_level("WARNING", logger="sokuji.routing.upstream"):
        gen_model = await started(stub.url, protocol="openai", task="chat", tenants=tenants,
                                  api_key_env="UP", tenant_keys_env=env)
        enc_model = await started(stub.url, tenants=tenants, api_key_env="UP",
                                  tenant_keys_env=env)
    shared = sorted(set(tenants) - set(own))
    warned = [r.getMessage() for r in caplog.records if "tenant_keys_env" in r.getMessage()]
    assert len(warned) == (2 if shared else 0)
    assert all(f"tenants {', '.join(shared)} are sent" in w and "cached_tokens" in w
               and "Server-Timing" in w for w in warned)
    for tenant in tenants:
        gen = await chat(gen_model, {"prompt": "hi", "stream": True,
                                     "stream_options": {"include_usage": True}}, tenant)
        _, finish, _ = await drain(gen)
        timeline = Timeline()
        c = ctx(tenant, timeline=timeline)
        await enc_model.submit(await enc_model.prepare(["a"], c), c).result()
        seen = tenant in own
        usage = llm_codec.Encoder.usage(gen.timing, finish.completion_tokens)
        assert usage["prompt_tokens_details"]["cached_tokens"] == (7 if seen else 0), tenant
        assert ("prefix-cache;desc=\"hit 7" in gen.timing.server_timing()) is seen
        assert gen.timing.prompt_tokens == 9  # the request's own count is its own
        assert timeline.notes[Stage.INFER] == ("upstream 0.28 ms" if seen else "upstream")
    await gen_model.stop()
    await enc_model.stop()


async def test_one_caller_sees_the_upstreams_state(stub: Stub) -> None:
    """No keys configured here: every caller is one tenant, nothing to keep apart."""
    model = await started(stub.url, protocol="openai", task="chat")
    gen = await chat(model, {"prompt": "hi"}, "anonymous")
    await drain(gen)
    assert gen.timing.reused_tokens == 7 and gen.timing.prefix_lookup == "hit"
    await model.stop()
