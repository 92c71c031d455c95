"""For ``tensor_serving.py``: ONNX Runtime called directly, in a child process on the server
core, driven over a pipe (as ``serving_overhead.py``'s raw runtime is).

The session is the one Sokuji's tensor runtime builds (``TensorRuntime.load``: the same
session options, 1 intra-op thread, spinning off, every graph optimisation), called with
``InferenceSession.run`` on the same inputs the servers get: for latency one request's input
at a time; for throughput batches of ``bs`` of them concatenated (the concatenation counted:
a server has to do it too).

    python _tensor_raw.py CORE CACHE_DIR      (commands: one JSON object a line on stdin)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(core: int, cache_dir: str) -> None:
    os.sched_setaffinity(0, {core})
    import numpy as np
    from _tensor_models import inputs, spec

    from sokuji.runtimes.tensor import Options, TensorRuntime

    sessions: dict[str, Any] = {}
    feeds: dict[str, list[np.ndarray]] = {}
    names: dict[str, str] = {}
    cursor = 0
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        model = cmd["model"]
        if model not in sessions:
            s = spec(model, cache_dir)
            rt = TensorRuntime(s.path, Options(intra_op_threads=cmd.get("threads", 1)))
            rt.load()
            sessions[model], feeds[model], names[model] = rt._session, inputs(s), s.input_name
            sessions[model].run(None, {s.input_name: feeds[model][0]})
        session, xs, name = sessions[model], feeds[model], names[model]
        reply: Any
        if cmd["cmd"] == "single":
            reply = []
            for _ in range(cmd["calls"]):
                x = xs[cursor % len(xs)]
                cursor += 1
                t0 = time.perf_counter()
                session.run(None, {name: x})
                reply.append((time.perf_counter() - t0) * 1e3)
        else:
            bs = cmd["bs"]
            items, calls, start, cpu0 = 0, 0, time.perf_counter(), time.process_time()
            while time.perf_counter() - start < cmd["seconds"] or calls < 3:
                batch = np.concatenate([xs[(cursor + k) % len(xs)] for k in range(bs)])
                cursor += bs
                session.run(None, {name: batch})
                items, calls = items + bs, calls + 1
            reply = {"items": items, "seconds": time.perf_counter() - start,
                     "cpu_s": time.process_time() - cpu0}
        print(json.dumps(reply), flush=True)


class RawTensorRuntime:
    """The child process; ``call(cmd=..., model=..., ...)`` returns its reply."""

    def __init__(self, core: int, cache_dir: str) -> None:
        import subprocess

        self.proc = subprocess.Popen([sys.executable, __file__, str(core), cache_dir],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=Path(__file__).resolve().parent.parent)
        self._read()

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the raw runtime process ended")
        return json.loads(line)

    def call(self, **cmd: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
