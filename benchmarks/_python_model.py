"""The one model class every contender of ``python_serving.py`` serves: a user's own
scikit-learn model, written the way Sokuji's Python kind takes it (``setup(options)``,
``predict(list of dicts) -> list of dicts``). The peers wrap this very class in their own
APIs (``_python_peers.py``); nothing here knows who calls it.

A standard-scaled logistic regression trained at setup on the breast-cancer data that ships
inside scikit-learn's wheel (569 rows, 30 features), plus the kind of feature code a user
adds (the log of the area features, whose scale spans three decades). ``predict`` is
vectorised over the batch: the rows of every request stacked into one matrix, one
``predict_proba`` call a batch, the rows split back, one dict per request. A request's
``features`` is an array (or nested list: the plain JSON peers send lists) of shape [1, 30]
or [30]; its result is ``probabilities`` (FP32, [n, 2]) and ``label`` (INT64, [n]).

Deliberately no ``sokuji`` import: the peers' processes (BentoML's side venv among them) run
it as it is. (Sokuji's ``Server-Timing`` still shows the batch as a whole.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

AREA_COLUMNS = (3, 13, 23)
"""mean area, area error, worst area: log-scaled in ``features``."""
N_FEATURES = 30


def load_rows() -> np.ndarray:
    """The dataset's rows (FP64 [569, 30]): what the benchmark's requests send, in turn."""
    from sklearn.datasets import load_breast_cancer

    return np.asarray(load_breast_cancer().data, dtype=np.float64)


class BreastCancer:
    deterministic = True

    def setup(self, options: dict[str, Any]) -> None:
        from sklearn.datasets import load_breast_cancer
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        x, y = load_breast_cancer(return_X_y=True)
        self.model = make_pipeline(
            StandardScaler(),
            LogisticRegression(C=float(options.get("C", 1.0)),
                               max_iter=int(options.get("max_iter", 1000))))
        self.model.fit(self.features(x), y)

    @staticmethod
    def features(x: np.ndarray) -> np.ndarray:
        x = np.array(x, dtype=np.float64)  # a copy: the request's own array is left alone
        x[:, AREA_COLUMNS] = np.log1p(x[:, AREA_COLUMNS])
        return x

    def predict(self, inputs: list[dict[str, Any]]) -> list[dict[str, np.ndarray]]:
        rows = [np.asarray(i["features"], dtype=np.float64).reshape(-1, N_FEATURES)
                for i in inputs]
        proba = self.model.predict_proba(self.features(np.concatenate(rows)))
        proba = proba.astype(np.float32)
        labels = proba.argmax(axis=1).astype(np.int64)
        out, start = [], 0
        for r in rows:
            n = len(r)
            out.append({"probabilities": proba[start:start + n], "label": labels[start:start + n]})
            start += n
        return out
