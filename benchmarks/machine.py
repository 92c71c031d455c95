"""What a figure depends on: the machine it was measured on, and how fast its threads wake.

    .venv/bin/python benchmarks/machine.py          (~2 s; prints JSON)

Serving overhead on these shared 2-core machines is dominated by hand-offs between threads
(the event loop and a worker) and by the wake-up of a sleeping thread, which differs several
fold between machines of the same kind. Each benchmark report carries this probe so that a
figure can be read against the machine that gave it:

- ``thread_wakeup_us``: one thread puts an item on a ``queue.SimpleQueue`` that another thread
  is blocked on; time until the other thread runs (p50 / p99 over a few hundred hand-offs, the
  two threads on the same core as a server's loop and worker are).
- ``loop_wakeup_us``: a thread calls ``loop.call_soon_threadsafe`` on an idle asyncio loop;
  time until the callback runs (the worker -> event loop hand-back).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import queue
import statistics
import threading
import time
from typing import Any


def _pcts(values_ns: list[int]) -> dict[str, float]:
    ordered = sorted(values_ns)
    return {"p50": ordered[len(ordered) // 2] / 1e3,
            "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] / 1e3,
            "mean": statistics.fmean(ordered) / 1e3}


def thread_wakeup(samples: int = 400) -> dict[str, float]:
    inbox: queue.SimpleQueue[int] = queue.SimpleQueue()
    back: queue.SimpleQueue[int] = queue.SimpleQueue()

    def echo() -> None:
        while True:
            sent = inbox.get()
            if sent < 0:
                return
            back.put(time.perf_counter_ns() - sent)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    got = []
    for _ in range(samples):
        time.sleep(0.0005)  # let the echo thread go to sleep: we measure a cold wake-up
        inbox.put(time.perf_counter_ns())
        got.append(back.get())
    inbox.put(-1)
    t.join()
    return _pcts(got)


def loop_wakeup(samples: int = 400) -> dict[str, float]:
    async def probe() -> list[int]:
        loop = asyncio.get_running_loop()
        got: list[int] = []
        for _ in range(samples):
            done = loop.create_future()
            sent = [0]

            def arrive(fut: asyncio.Future[None] = done, stamp: list[int] = sent) -> None:
                got.append(time.perf_counter_ns() - stamp[0])
                fut.set_result(None)

            def fire(stamp: list[int] = sent) -> None:
                time.sleep(0.0005)  # the loop is asleep in its selector by now
                stamp[0] = time.perf_counter_ns()
                loop.call_soon_threadsafe(arrive)

            threading.Thread(target=fire, daemon=True).start()
            await done
        return got

    return _pcts(asyncio.run(probe()))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def describe(probe: bool = True) -> dict[str, Any]:
    """The machine, and (``probe``) its wake-up latencies measured now, on one core."""
    info: dict[str, Any] = {
        "cpu": cpu_name(), "cores": os.cpu_count(), "kernel": platform.release(),
        "python": platform.python_version(), "load_average": list(os.getloadavg()),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if probe:
        affinity = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {max(affinity)})
        try:
            info["thread_wakeup_us"] = thread_wakeup()
            info["loop_wakeup_us"] = loop_wakeup()
        finally:
            os.sched_setaffinity(0, affinity)
    return info


if __name__ == "__main__":
    print(json.dumps(describe(), indent=1))
