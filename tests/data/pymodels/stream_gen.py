"""Streaming predict models for tests/integration/test_python_predict.py: generators that
yield, each step, a list with one partial result per request of the batch."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path


class Steps:
    """``n`` partials (the request's ``n``, default 5), ``sleep_s`` apart; each says when it
    was yielded (``at``: wall-clock seconds, comparable with the client's on one machine).
    With a request's ``progress``: a file the generator appends each step's index to, and
    ``closed`` when it ends (a test's proof that a cancelled stream stopped the generator)."""

    def predict(self, inputs: list[dict]):
        n = max(int(i.get("n", 5)) for i in inputs)
        sleep_s = max(float(i.get("sleep_s", 0.0)) for i in inputs)
        progress = [Path(i["progress"]) if "progress" in i else None for i in inputs]
        try:
            for k in range(n):
                if k:
                    time.sleep(sleep_s)
                for p in progress:
                    if p is not None:
                        with p.open("a") as f:
                            f.write(f"{k}\n")
                yield [{"step": k, "at": time.time(), "text": "x" * int(i.get("pad", 0))}
                       if k < int(i.get("n", 5)) else None for i in inputs]
        finally:
            for p in progress:
                if p is not None:
                    with p.open("a") as f:
                        f.write("closed\n")


class AsyncSteps:
    """The same as an async generator (``asyncio.sleep`` between steps)."""

    async def predict(self, inputs: list[dict]):
        n = max(int(i.get("n", 5)) for i in inputs)
        sleep_s = max(float(i.get("sleep_s", 0.0)) for i in inputs)
        for k in range(n):
            if k:
                await asyncio.sleep(sleep_s)
            yield [{"step": k, "at": time.time()} for _ in inputs]


class FailsMidway:
    """Two partials, then a ValueError (the model's own failure, mid-stream); with
    ``at_once``, raises before its first partial."""

    def predict(self, inputs: list[dict]):
        if any(i.get("at_once") for i in inputs):
            raise ValueError("before anything")
        yield [{"step": 0} for _ in inputs]
        yield [{"step": 1} for _ in inputs]
        raise ValueError("secret data of another request")
