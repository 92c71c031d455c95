"""For ``python_serving.py``: the model class called directly, in a child process on the
server core, driven over a pipe (as ``_tensor_raw.py`` drives ONNX Runtime).

The class is ``_python_model.BreastCancer``, set up as every contender sets it up; a call is
``predict`` on what a server hands it after decoding: one dict a request, ``features`` an FP64
array of shape [1, 30] (a dataset row). ``single``: one request a call, each call timed;
``throughput``: batches of ``bs`` requests for ``seconds``.

    python _python_direct.py CORE      (commands: one JSON object a line on stdin)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(core: int) -> None:
    os.sched_setaffinity(0, {core})
    from _python_model import BreastCancer, load_rows

    model = BreastCancer()
    model.setup({})
    items = [{"features": row[None].copy()} for row in load_rows()]
    for i in range(20):
        model.predict(items[i:i + 1])
    cursor = 0
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        reply: Any
        if cmd["cmd"] == "single":
            reply = []
            for _ in range(cmd["calls"]):
                batch = [items[cursor % len(items)]]
                cursor += 1
                t0 = time.perf_counter()
                model.predict(batch)
                reply.append((time.perf_counter() - t0) * 1e3)
        else:
            bs = cmd["bs"]
            n, calls, start = 0, 0, time.perf_counter()
            while time.perf_counter() - start < cmd["seconds"] or calls < 3:
                batch = [items[(cursor + k) % len(items)] for k in range(bs)]
                cursor += bs
                model.predict(batch)
                n, calls = n + bs, calls + 1
            elapsed = time.perf_counter() - start
            reply = {"items": n, "seconds": elapsed, "batch_ms": elapsed / calls * 1e3}
        print(json.dumps(reply), flush=True)


class DirectModel:
    """The child process; ``call(cmd=..., ...)`` returns its reply."""

    def __init__(self, core: int) -> None:
        import subprocess

        self.proc = subprocess.Popen([sys.executable, __file__, str(core)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=Path(__file__).resolve().parent.parent)
        self._read()

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the direct-call process ended")
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
    main(int(sys.argv[1]))
