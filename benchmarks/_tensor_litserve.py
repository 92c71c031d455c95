"""The LitServe peer of ``tensor_serving.py``: ``litserve.LitAPI`` over ``_tensor_peers``'s
``PeerModel`` (the same model code as the FastAPI peer), batching on: ``max_batch_size`` and
``batch_timeout`` given, ``batch`` concatenating the requests' rows and ``unbatch`` splitting
the outputs back. LitServe runs the API in an inference worker process (spawned: so the API
class lives at module level) fed over queues by its FastAPI/uvicorn server process.

    python _tensor_litserve.py PORT MAX_BATCH TIMEOUT_S    (TENSOR_PEER_* as _tensor_peers)

(No ``from __future__ import annotations``: LitServe reads ``decode_request``'s annotation
at run time to build the endpoint.)
"""

import sys
from pathlib import Path
from typing import Annotated, Any

import litserve as ls
import numpy as np
from fastapi import Body, Response

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tensor_peers import RAW, PeerModel


class TensorAPI(ls.LitAPI):
    def setup(self, device: str) -> None:
        self.model = PeerModel()
        self.model.predict(self.model.decode(bytes(self.model.row_bytes)))

    def decode_request(self, request: Annotated[bytes, Body(media_type=RAW)]) -> np.ndarray:
        return self.model.decode(request)

    def batch(self, inputs: list[np.ndarray]) -> Any:
        return np.concatenate(inputs), [len(x) for x in inputs]

    def predict(self, x: Any) -> Any:
        if isinstance(x, tuple):  # a batch: (rows, rows per request)
            return self.model.predict(x[0]), x[1]
        return self.model.predict(x)

    def unbatch(self, output: Any) -> list[list[np.ndarray]]:
        outs, rows = output
        parts, start = [], 0
        for n in rows:
            parts.append([o[start:start + n] for o in outs])
            start += n
        return parts

    def encode_response(self, output: list[np.ndarray]) -> Response:
        return Response(self.model.encode(output), media_type=RAW)


def main(port: int, max_batch: int, timeout_s: float) -> None:
    server = ls.LitServer(TensorAPI(max_batch_size=max_batch, batch_timeout=timeout_s,
                                    api_path="/infer"),
                          accelerator="cpu", workers_per_device=1, timeout=60)
    server.run(host="127.0.0.1", port=port, log_level="warning", generate_client_file=False,
               num_api_servers=1)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
