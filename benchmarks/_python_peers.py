"""The peers of ``python_serving.py``: each serves the one model class of
``_python_model.py`` (``BreastCancer``, set up once, its ``predict`` called with a list of
request dicts) the way its own documentation shows, on ``POST /predict`` with a plain JSON
body ``{"features": [[30 numbers]]}`` answered ``{"probabilities": [[p0, p1]], "label":
[k]}``.

- ``fastapi`` (here): plain FastAPI under uvicorn (uvloop, httptools), a Pydantic request
  model and a ``def`` endpoint (FastAPI's threadpool, what its documentation recommends for
  blocking code): one request -> one ``predict`` call of one item, no batching.
  ``uvicorn --factory --app-dir benchmarks _python_peers:fastapi_app``.
- ``litserve``: ``litserve.LitAPI`` with ``max_batch_size`` / ``batch_timeout``
  (``_python_litserve.py``).
- ``ray``: a Ray Serve deployment with ``@serve.batch`` (``_python_ray.py``).
- ``bentoml``: ``@bentoml.service`` with ``@bentoml.api(batchable=True)``
  (``_python_bentoml.py``; it runs in a side venv, ``setup_bentoml.sh``).

Configured by environment: ``PY_PEER_MAX_BATCH`` (the batching peers' max batch size) and
``PY_PEER_TIMEOUT_S`` (their batch wait). (No ``from __future__ import annotations``:
FastAPI reads the endpoint's annotations at run time.)
"""

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _python_model import N_FEATURES, BreastCancer


def max_batch() -> int:
    return int(os.environ.get("PY_PEER_MAX_BATCH", "64"))


def batch_timeout_s() -> float:
    return float(os.environ.get("PY_PEER_TIMEOUT_S", "0.002"))


def new_model() -> BreastCancer:
    """The class set up, and warmed by one call (as Sokuji's ``warmup`` does)."""
    model = BreastCancer()
    model.setup({})
    model.predict([{"features": np.zeros((1, N_FEATURES))}])
    return model


def plain(result: dict[str, np.ndarray]) -> dict[str, Any]:
    """One result as plain JSON values."""
    return {k: v.tolist() for k, v in result.items()}


def fastapi_app() -> Any:
    from fastapi import FastAPI
    from pydantic import BaseModel

    class Features(BaseModel):
        features: list[list[float]]

    model = new_model()
    app = FastAPI()

    @app.post("/predict")
    def predict(request: Features) -> dict[str, Any]:
        return plain(model.predict([{"features": np.asarray(request.features)}])[0])

    @app.get("/health")
    def health() -> dict[str, bool]:
        return {"ok": True}

    return app
