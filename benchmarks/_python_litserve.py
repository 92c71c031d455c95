"""The LitServe peer of ``python_serving.py``: ``litserve.LitAPI`` over ``_python_model``'s
class, batching on (``max_batch_size``, ``batch_timeout``): ``decode_request`` makes a
request's dict, ``batch`` keeps the list, ``predict`` is the class's ``predict`` on it,
``unbatch`` hands each request its own result. LitServe runs the API in an inference worker
process fed over queues by its uvicorn server process.

    python _python_litserve.py PORT MAX_BATCH TIMEOUT_S

(No ``from __future__ import annotations``: LitServe reads the annotations at run time.)
"""

import sys
from pathlib import Path
from typing import Any

import litserve as ls
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _python_peers import new_model, plain


class PythonAPI(ls.LitAPI):
    def setup(self, device: str) -> None:
        self.model = new_model()

    def decode_request(self, request: dict) -> dict[str, Any]:
        return {"features": np.asarray(request["features"], dtype=np.float64)}

    def batch(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return inputs

    def predict(self, x: Any) -> Any:
        if isinstance(x, dict):  # a lone request (LitServe may skip batch() for one)
            return self.model.predict([x])[0]
        return self.model.predict(x)

    def unbatch(self, output: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        return output

    def encode_response(self, output: dict[str, np.ndarray]) -> dict[str, Any]:
        return plain(output)


def main(port: int, max_batch: int, timeout_s: float) -> None:
    server = ls.LitServer(PythonAPI(max_batch_size=max_batch, batch_timeout=timeout_s,
                                    api_path="/predict"),
                          accelerator="cpu", workers_per_device=1, timeout=60)
    server.run(host="127.0.0.1", port=port, log_level="warning", generate_client_file=False,
               num_api_servers=1)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
