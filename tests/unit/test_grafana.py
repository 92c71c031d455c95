"""grafana/sokuji.json: an importable dashboard whose every query names series that a real
server's /metrics has (the app over a synthetic model with an SLO, its real exposition)."""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sokuji import config as cfg
from tests.conftest import ROOT, client_for

DASHBOARD = ROOT / "grafana" / "sokuji.json"
NAME = re.compile(r"\b((?:sokuji|gen_ai)_[a-z0-9_]+)\b")
MATCHERS = re.compile(r"\b((?:sokuji|gen_ai)_[a-z0-9_]+)\{([^}]*)\}")
LABEL = re.compile(r"([a-z_]+)\s*(?:=~|!~|!=|=)")
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("",), "gauge": ("",)}
BODY = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["x"]}]}


def panels(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in doc["panels"]:
        yield p
        yield from p.get("panels", [])


def expressions(doc: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in panels(doc) for t in p.get("targets", [])]
    out += [v["definition"] for v in doc["templating"]["list"]]
    return out


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return json.loads(Path(DASHBOARD).read_text())


@pytest.fixture(scope="module")
def exposition() -> tuple[set[str], dict[str, set[str]]]:
    """Every series name /metrics can show (from its HELP / TYPE lines) and the labels of
    those it shows with samples."""
    config = cfg.validate(cfg.ServerConfig(
        models=(cfg.ModelConfig(name="synth", runtime="synthetic", max_batch_size=4,
                                slo=cfg.SloConfig(p99_ms=50.0)),),
        cache_dir=tempfile.mkdtemp(prefix="sokuji-test-")))
    with client_for(config) as client:
        for _ in range(3):
            assert client.post("/v2/models/synth/infer", json=BODY).status_code == 200
        text = client.get("/metrics").text
    types: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split()
        if line.startswith("# HELP "):
            types.setdefault(parts[2], "")
        elif line.startswith("# TYPE "):
            types[parts[2]] = parts[3]
    names: set[str] = set()
    for family, kind in types.items():
        # a family with no samples yet (an LLM's, with no LLM served) has HELP only: any
        # of its forms
        for suffix in SUFFIXES.get(kind, ("", "_bucket", "_sum", "_count")):
            names.add(family + suffix)
    labels: dict[str, set[str]] = {}
    for line in text.splitlines():
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", line)
        if m:
            labels.setdefault(m[1], set()).update(re.findall(r'([a-z_]+)="', m[2]))
    return names, labels


def test_the_dashboard_is_importable(doc: dict[str, Any]) -> None:
    assert doc["schemaVersion"] >= 39 and doc["uid"] and doc["title"] == "Sokuji"
    assert [i["name"] for i in doc["__inputs"]] == ["DS_PROMETHEUS"]
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["model"]["query"]["query"].startswith("label_values(")
    ids = [p["id"] for p in panels(doc)]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in panels(doc):
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        here = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & here, f"panel {p['title']!r} overlaps another"
        cells |= here
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}" and p["targets"], p["title"]
            for t in p["targets"]:
                assert "$model" in t["expr"] or "cache_errors" in t["expr"], t["expr"]
    titles = " ".join(p["title"] for p in panels(doc)).lower()
    for what in ("latency", "stage", "queue", "batch", "cache", "first token",
                 "inter-token", "tokens", "burn", "budget"):
        assert what in titles, what


def used(doc: dict[str, Any], slo: bool) -> set[str]:
    return {n for e in expressions(doc) for n in NAME.findall(e)
            if n.startswith("sokuji_slo_") == slo}


def check(doc: dict[str, Any], exposition: tuple[set[str], dict[str, set[str]]],
          slo: bool) -> None:
    names, labels = exposition
    missing = used(doc, slo) - names
    assert not missing, f"queried but not in /metrics: {sorted(missing)}"
    for expr in expressions(doc):
        for name, matchers in MATCHERS.findall(expr):
            if name.startswith("sokuji_slo_") != slo or name not in labels:
                continue
            extra = set(LABEL.findall(matchers)) - labels[name]
            if name.endswith("_bucket"):
                extra.discard("le")
            assert not extra, f"{name} has no label {sorted(extra)} in /metrics"


def test_every_series_it_queries_exists(doc: dict[str, Any],
                                        exposition: tuple[set[str], dict[str, set[str]]]
                                        ) -> None:
    assert len(used(doc, slo=False)) >= 15
    check(doc, exposition, slo=False)


def test_the_slo_series_it_queries_exist(doc: dict[str, Any],
                                         exposition: tuple[set[str], dict[str, set[str]]]
                                         ) -> None:
    if not any(n.startswith("sokuji_slo_") for n in exposition[0]):
        pytest.skip("the server exports no sokuji_slo_* series yet (issue 16 item 3)")
    assert {"sokuji_slo_error_budget_remaining", "sokuji_slo_burn_rate",
            "sokuji_slo_p99_seconds", "sokuji_slo_target_p99_seconds"} <= used(doc, slo=True)
    check(doc, exposition, slo=True)
