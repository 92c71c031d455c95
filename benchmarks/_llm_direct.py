"""llama.cpp called directly, in-process: the floor for benchmarks/llm_serving.py.

Run pinned to the server core; reads one JSON request a line on stdin
({"prompt", "max_tokens"}), generates with llama-cpp-python's own ``Llama`` (streaming,
greedy), and answers one JSON line: seconds from the request's arrival to each token.
"""

from __future__ import annotations

import json
import sys
import time

import llama_cpp


def main() -> None:
    path, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads,
                          n_threads_batch=threads, flash_attn=True, verbose=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.perf_counter()
        times = []
        for chunk in llm.create_completion(prompt=req["prompt"], max_tokens=req["max_tokens"],
                                           temperature=0.0, stream=True):
            if chunk["choices"][0]["text"]:
                times.append(time.perf_counter() - t0)
        print(json.dumps({"times": times}), flush=True)


if __name__ == "__main__":
    main()
