"""The classifier cascade end to end on real models and the project's intent data: ``sokuji
route calibrate`` fits the threshold on a labelled slice (two MiniLM classifiers over the
built-in prototypes: nearest centroid as the small one, nearest prototype as the large),
checked against margins and accuracies computed here from each classifier's own served
scores; then the router reads the calibrated threshold and answers a request item by item:
the small classifier's rows where its margin reaches the threshold, the large one's below."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sokuji import config as cfg
from sokuji.routing import calibrate
from tests.conftest import CACHE_DIR, ROOT, client_for

pytestmark = pytest.mark.integration

DATA = ROOT / "sokuji" / "routing" / "data"
CONFIG = """
builtin_pipelines = false
[cache]
enabled = false
[[models]]
name = "small"
runtime = "classifier"
max_batch_size = 64
options = { scheme = "centroid", intra_op_threads = 1 }
[[models]]
name = "large"
runtime = "classifier"
max_batch_size = 64
options = { scheme = "nn", intra_op_threads = 1 }
[[models]]
name = "intents"
runtime = "router"
options = { kind = "cascade", targets = ["small", "large"] }
"""
ESCALATION = 0.25


def _slice(name: str, every: int) -> list[dict[str, str]]:
    rows = [json.loads(line) for line in (DATA / name).read_text().splitlines() if line]
    return rows[::every]


def _scores(client: Any, model: str, texts: list[str]) -> np.ndarray:
    r = client.post(f"/v2/models/{model}/infer", json={"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]})
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def test_route_calibrate_then_the_cascade_uses_the_threshold(tmp_path: Path) -> None:
    """Kills the mutants: the escalation fit off by one (``fit_escalation``), escalating at
    or above θ (``threshold_fit.row``), the margin of the large classifier (or of the
    scores' wrong end) used in ``calibrate.score``, the router not reading the calibrated
    threshold, and the cascade's rows merged out of place."""
    (tmp_path / "models").symlink_to(CACHE_DIR / "models")  # the exported MiniLM, shared
    config = tmp_path / "sokuji.toml"
    config.write_text(f'cache_dir = "{tmp_path}"\n{CONFIG}')
    calib, test = _slice("intents_calib.jsonl", 12), _slice("intents_test.jsonl", 50)
    for path, rows in (("calib.jsonl", calib), ("test.jsonl", test)):
        (tmp_path / path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert calibrate.main(["intents", "--config", str(config), "--labelled",
                           str(tmp_path / "calib.jsonl"), "--test", str(tmp_path / "test.jsonl"),
                           "--target-escalation", str(ESCALATION), "--json"]) == 0
    result = json.loads((tmp_path / "routers" / "intents" / "calibration.json").read_text())
    n = len(calib)
    assert result["n"] == n and result["small"] == "small" and result["large"] == "large"

    served = cfg.load(config)
    with client_for(served) as client:
        texts, truth = [r["text"] for r in calib], np.asarray([r["label"] for r in calib])
        labels = sorted({json.loads(line)["label"] for line in (
            DATA / "intents_prototypes.jsonl").read_text().splitlines() if line})
        small, large = _scores(client, "small", texts), _scores(client, "large", texts)
        top2 = np.sort(small, axis=1)[:, -2:]
        margins = top2[:, 1] - top2[:, 0]  # top-1 minus top-2, computed here
        small_ok = np.asarray(labels)[small.argmax(axis=1)] == truth
        large_ok = np.asarray(labels)[large.argmax(axis=1)] == truth
        theta = result["threshold"]

        # The fit: the quarter of the queries with the lowest margins falls below θ.
        k = round(ESCALATION * n)
        ordered = np.sort(margins)
        assert ordered[k - 1] < theta <= ordered[k] + 1e-6, (ordered[k - 1:k + 1], theta)
        escalated = margins < theta
        assert escalated.sum() == k
        assert result["calibration"]["escalated"] == pytest.approx(k / n)
        assert result["small_accuracy"] == pytest.approx(small_ok.mean())
        assert result["large_accuracy"] == pytest.approx(large_ok.mean())
        assert result["calibration"]["accuracy"] == pytest.approx(
            np.where(escalated, large_ok, small_ok).mean())
        assert result["calibration"]["easy_escalated"] == int((escalated & small_ok).sum())
        assert result["test"]["n"] == len(test) and 0 <= result["test"]["escalated"] <= 1
        assert small_ok.mean() > 0.5 and large_ok.mean() > 0.5  # real classifiers, real data

        # The router reads θ and answers item by item: sure rows the small one's, the rest
        # the large one's, each at its own position.
        r = client.post("/v2/models/intents/infer", json={"inputs": [
            {"name": "text", "datatype": "BYTES", "shape": [n], "data": texts}]})
        assert r.status_code == 200, r.text
        out = r.json()["outputs"][0]
        routed = np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
        want = np.where(escalated[:, None], large, small)
        np.testing.assert_allclose(routed, want, atol=1e-5)
        route = next(p for p in r.headers["server-timing"].split(",")
                     if p.strip().startswith("route"))
        assert "cascade_escalated" in route and f"escalated {k}/{n}" in route, route
