"""A scikit-learn model trained at start-up on the iris dataset that ships with
scikit-learn, with a little feature code: the Python model most users would try first."""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_iris
from sklearn.linear_model import LogisticRegression

import sokuji


class Iris:
    deterministic = True

    def setup(self, options: dict) -> None:
        data = load_iris()
        self.names = np.array(data.target_names, dtype=object)
        self.scale = float(options.get("scale", 1.0))
        self.model = LogisticRegression(max_iter=int(options.get("max_iter", 500)))
        self.model.fit(self.features(data.data), data.target)

    def features(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64) * self.scale
        return np.hstack([x, x[:, 2:3] / (x[:, 3:4] + 1e-3)])  # petal length / width

    def predict(self, inputs: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        sizes = [len(i["features"]) for i in inputs]
        with sokuji.stage("features"):
            x = self.features(np.concatenate([i["features"] for i in inputs]))
        with sokuji.stage("model"):
            proba = self.model.predict_proba(x).astype(np.float32)
        out, start = [], 0
        for n in sizes:
            p = proba[start:start + n]
            out.append({"probabilities": p, "label": self.names[p.argmax(axis=1)]})
            start += n
        return out
