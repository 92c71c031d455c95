"""The media lane (``core/offload.Lane``, issue 25 finding 1): heavy preparation runs in a
lane of its own, so the light preparation pool (``offload.run``: tokenising) keeps
answering while the lane is full of long jobs; past its bounds (jobs held, jobs per tenant)
a job is refused at once with 429 and Retry-After. Before, OCR preprocessing ran in the one
``sokuji-prep`` pool, and every tenant's tokenising waited behind it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from sokuji.core import offload
from sokuji.core.offload import Lane
from sokuji.errors import Overloaded

WAIT_S = 30.0


def blocked(go: threading.Event, entered: threading.Semaphore) -> str:
    entered.release()
    assert go.wait(WAIT_S)
    return "done"


def test_light_jobs_complete_while_the_media_lane_is_full() -> None:
    lane = Lane("test-media", threads=offload.pool_size(), max_waiting=4, per_tenant=100)

    async def main() -> None:
        go, entered = threading.Event(), threading.Semaphore(0)
        # As many long jobs as the light pool has threads, and a waiting room full too:
        # with one shared pool, the light job below would wait for them all.
        heavy = [asyncio.ensure_future(lane.run(f"t{i}", blocked, go, entered))
                 for i in range(lane.threads + lane.max_waiting)]
        for _ in range(lane.threads):
            assert await asyncio.to_thread(entered.acquire, True, WAIT_S)
        assert lane.held == lane.threads + lane.max_waiting
        try:
            light = await asyncio.wait_for(offload.run(lambda: "tokenised"), WAIT_S)
            assert light == "tokenised"
            assert not any(h.done() for h in heavy)  # they were still running / waiting
            with pytest.raises(Overloaded, match="lane is full") as err:
                await lane.run("another", blocked, go, entered)
            assert err.value.status == 429 and "retry-after" in err.value.headers
        finally:
            go.set()
        assert await asyncio.gather(*heavy) == ["done"] * len(heavy)
        assert lane.held == 0

    asyncio.run(main())


def test_one_tenant_cannot_take_the_whole_lane() -> None:
    lane = Lane("test-tenant", threads=1, max_waiting=8, per_tenant=2)

    async def main() -> None:
        go, entered = threading.Event(), threading.Semaphore(0)
        mine = [asyncio.ensure_future(lane.run("acme", blocked, go, entered))
                for _ in range(2)]
        assert await asyncio.to_thread(entered.acquire, True, WAIT_S)
        try:
            with pytest.raises(Overloaded, match="this tenant already has 2 jobs"):
                await lane.run("acme", blocked, go, entered)
            other = asyncio.ensure_future(lane.run("corp", blocked, go, entered))
            await asyncio.sleep(0)
            assert lane.held_by("corp") == 1 and lane.held_by("acme") == 2
        finally:
            go.set()
        assert await asyncio.gather(*mine, other) == ["done"] * 3
        assert lane.held == 0 and lane.held_by("acme") == 0

    asyncio.run(main())


def test_a_cancelled_caller_keeps_its_slot_until_the_work_returns() -> None:
    lane = Lane("test-cancel", threads=1, max_waiting=0, per_tenant=1)

    async def main() -> None:
        go, entered = threading.Event(), threading.Semaphore(0)
        task = asyncio.ensure_future(lane.run("acme", blocked, go, entered))
        assert await asyncio.to_thread(entered.acquire, True, WAIT_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert lane.held == 1  # the thread still runs the job
        with pytest.raises(Overloaded):
            await lane.run("corp", blocked, go, entered)
        go.set()
        for _ in range(int(WAIT_S * 100)):  # freed by the job's thread once it returns
            if lane.held == 0:
                break
            await asyncio.sleep(0.01)
        assert lane.held == 0
        assert await lane.run("corp", lambda: "next") == "next"

    asyncio.run(main())


def test_a_job_error_is_the_callers_and_frees_the_slot() -> None:
    lane = Lane("test-error", threads=1, max_waiting=0, per_tenant=1)

    def fail() -> None:
        raise ValueError("bad file")

    async def main() -> None:
        with pytest.raises(ValueError, match="bad file"):
            await lane.run("acme", fail)
        assert lane.held == 0
        assert await lane.run("acme", lambda: 7) == 7

    asyncio.run(main())


def test_a_media_model_decodes_in_the_media_lane_under_its_tenant() -> None:
    from sokuji.config import ModelConfig
    from sokuji.core.model import RequestContext
    from sokuji.core.request import Priority
    from sokuji.media.model import MediaModel
    from tests.unit.test_media_codec import _Engine

    seen: list[tuple[str, int]] = []
    lane = offload.media_lane()

    class Engine(_Engine):
        def parameters(self, raw: object) -> dict[str, object]:
            return {}

        def decode(self, data: bytes, clock: object) -> bytes:
            seen.append((threading.current_thread().name, lane.held_by("acme")))
            return data

    model = MediaModel(ModelConfig(name="m", runtime="ocr", max_batch_size=4), Engine())  # type: ignore[arg-type]
    ctx = RequestContext("acme", Priority.INTERACTIVE, None, 0)
    prepared = asyncio.run(model.prepare(([b"a", b"b"], {}), ctx))
    assert [d for d, _ in prepared.files] == [b"a", b"b"]
    assert {name.split("_")[0] for name, _ in seen} == {"sokuji-media"}
    assert {held for _, held in seen} == {1}  # one job: the request's files, counted once
