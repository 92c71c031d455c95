"""``server/grpc_arrivals.py``: which gRPC inference calls are in flight, seen from the
interceptor (before the message is read) until the handler returns, driven through a real
grpc.aio server and client."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from sokuji.server import grpc_arrivals
from sokuji.server.grpc_arrivals import Arrivals

INFER = "/inference.GRPCInferenceService/ModelInfer"


class Service(service_pb2_grpc.GRPCInferenceServiceServicer):
    """ModelInfer answers once ``release`` is set, recording whether it had company."""

    def __init__(self, arrivals: Arrivals) -> None:
        self.arrivals = arrivals
        self.seen: list[bool] = []
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        try:
            self.seen.append(self.arrivals.company())
            self.entered.set()
            if request.id == "wait":
                await self.release.wait()
            return service_pb2.ModelInferResponse(id=request.id)
        finally:
            self.arrivals.leave()

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerLiveResponse(live=True)


async def serve() -> tuple[grpc.aio.Server, Service, Any, grpc.aio.Channel]:
    arrivals = Arrivals(frozenset({INFER}))
    server = grpc.aio.server(interceptors=[arrivals])
    service = Service(arrivals)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, service, service_pb2_grpc.GRPCInferenceServiceStub(channel), channel


async def test_calls_one_after_another_have_no_company() -> None:
    server, service, stub, channel = await serve()
    for i in range(5):
        await stub.ModelInfer(service_pb2.ModelInferRequest(id=str(i)))
        await stub.ServerLive(service_pb2.ServerLiveRequest())  # not counted
    assert service.seen == [False] * 5 and service.arrivals.pending == 0
    await channel.close()
    await server.stop(0)


async def test_a_call_in_flight_is_company_until_its_handler_returns() -> None:
    """Catches: counting ended when the handler asks (a queued call would not count), the
    call's own arrival counted as company, or ``leave`` forgotten (every later call would
    have company)."""
    server, service, stub, channel = await serve()
    waiting = asyncio.ensure_future(stub.ModelInfer(service_pb2.ModelInferRequest(id="wait")))
    await asyncio.wait_for(service.entered.wait(), 10)
    await stub.ModelInfer(service_pb2.ModelInferRequest(id="second"))
    service.release.set()
    await waiting
    await stub.ModelInfer(service_pb2.ModelInferRequest(id="third"))
    assert service.seen == [False, True, False] and service.arrivals.pending == 0
    await channel.close()
    await server.stop(0)


async def test_an_arrival_that_never_reached_its_handler_goes_stale(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A call cancelled before its handler never leaves: it is dropped after ``STALE_S``."""
    arrivals = Arrivals(frozenset({INFER}))
    arrivals._pending[999] = 0  # started long ago (perf_counter_ns 0), never at its handler
    monkeypatch.setattr(grpc_arrivals, "STALE_S", 1e-6)
    assert arrivals.company() is False and arrivals.pending == 0
