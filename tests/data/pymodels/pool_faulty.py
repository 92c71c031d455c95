"""A model for the process pool's tests (``tests/test_python_pool.py``): each request's
``action`` (a string array) says what its batch does in the worker: compute (``echo``),
crash (``segv``, ``exit``), hang, raise, allocate and hold memory, or meet another worker
(``meet``: wait until as many workers as asked have written their mark, proving that they
run at once)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np

from sokuji.pycode.stage import stage


class Faulty:
    def setup(self, options: dict) -> None:
        self.scale = float(options.get("scale", 2.0))
        self.held: list[np.ndarray] = []
        lock = options.get("exit_in_first_setup")
        if lock:  # the first worker to take the lock exits: the others set up fine
            try:
                os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                os._exit(3)
        if options.get("raise_in_setup"):
            raise RuntimeError("no weights at /nowhere")

    def predict(self, inputs: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        out = []
        for item in inputs:
            action = str(item.get("action", np.array("echo")))
            if action == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            elif action == "exit":
                os._exit(1)
            elif action == "hang":
                while True:
                    pass
            elif action == "raise":
                raise ValueError("a value the model does not take")
            elif action == "alloc":
                self.held.append(np.ones(int(item["mb"]) << 20, np.uint8))
            elif action == "meet":
                self._meet(Path(str(item["dir"])), int(item["count"]))
            elif action == "count":
                return [{"y": np.zeros(1)}]  # one result, whatever the batch's size
            with stage("scale"):
                x = item.get("x", np.zeros(1, np.float32))
                out.append({"y": x * self.scale, "pid": np.int64(os.getpid()),
                            "label": f"n={x.size}"})
        return out

    def _meet(self, folder: Path, count: int) -> None:
        (folder / str(os.getpid())).touch()
        deadline = time.monotonic() + 20
        while len(list(folder.iterdir())) < count:
            if time.monotonic() > deadline:
                raise TimeoutError("the other workers never came")
            time.sleep(0.005)
