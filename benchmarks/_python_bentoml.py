"""The BentoML peer of ``python_serving.py``: a ``@bentoml.service`` over ``_python_model``'s
class, its API ``@bentoml.api(batchable=True)`` (BentoML's adaptive batching:
``max_batch_size``, ``max_latency_ms``): each request's ``features`` ([1, 30]) are
concatenated along dimension 0 by BentoML, split back into one dict per row for the class's
``predict``, and its list of results is split back per request (so a request's answer is a
list of its one result). One worker process (HTTP and the model), the sync API in its one
thread, as BentoML runs a sync API by default.

    bentoml serve _python_bentoml:PythonService --port PORT --working-dir benchmarks
    (in the side venv of ``setup_bentoml.sh``; PY_PEER_* as ``_python_peers.py``)

(No ``from __future__ import annotations``: BentoML reads the API's annotations at run time.)
"""

import os
import sys
from pathlib import Path
from typing import Any

import bentoml
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _python_model import BreastCancer

MAX_BATCH = int(os.environ.get("PY_PEER_MAX_BATCH", "64"))
MAX_LATENCY_MS = int(os.environ.get("PY_PEER_BENTO_MAX_LATENCY_MS", "60000"))


@bentoml.service(workers=1, traffic={"timeout": 60},
                 logging={"access": {"enabled": False}})  # as every peer: no access log
class PythonService:
    def __init__(self) -> None:
        self.model = BreastCancer()
        self.model.setup({})
        self.model.predict([{"features": np.zeros((1, 30))}])

    @bentoml.api(batchable=True, batch_dim=0, max_batch_size=MAX_BATCH,
                 max_latency_ms=MAX_LATENCY_MS)
    def predict(self, features: np.ndarray) -> list[dict[str, Any]]:
        rows = [{"features": features[i:i + 1]} for i in range(len(features))]
        return [{k: v.tolist() for k, v in r.items()} for r in self.model.predict(rows)]
