"""llama.cpp called directly, in-process: the floor for benchmarks/llm_serving.py.

Run as a script (``Direct`` starts it pinned to the server core), it reads one JSON request a
line on stdin ({"prompt", "max_tokens"}), generates with llama-cpp-python's own ``Llama``
(streaming, greedy, flash attention on as the servers have it), and answers one JSON line:
seconds from the request's arrival to each non-empty token.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


class Direct:
    """This script in its own process on ``core``; ``run`` is one request, blocking."""

    name = "direct"

    def __init__(self, core: int, gguf: Path, threads: int, n_ctx: int = 2048) -> None:
        self.proc = subprocess.Popen(
            ["taskset", "-c", str(core), sys.executable, __file__, str(gguf), str(threads),
             str(n_ctx)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        json.loads(self.proc.stdout.readline())

    def run(self, text: str, max_tokens: int) -> list[float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"prompt": text, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return list(json.loads(self.proc.stdout.readline())["times"])

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def main() -> None:
    import llama_cpp

    path, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads,
                          n_threads_batch=threads, flash_attn=True, verbose=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.perf_counter()
        times = []
        stream: Any = llm.create_completion(prompt=req["prompt"],
                                            max_tokens=req["max_tokens"], temperature=0.0,
                                            stream=True)
        for chunk in stream:
            if chunk["choices"][0]["text"]:
                times.append(time.perf_counter() - t0)
        print(json.dumps({"times": times}), flush=True)


if __name__ == "__main__":
    main()
