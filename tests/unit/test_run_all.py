"""``benchmarks/run_all.py`` (``make bench-all``): its steps read what their scripts write.

Every Figure reader is run on the raw JSON that step's script recorded under
``benchmarks/recorded/`` (the map below), so a reader that drifts from its script's output
fails here instead of in the middle of a two-hour run. Every script exists and takes the
output flag ``run_step`` passes it (read from its own ``--help``, which runs nothing).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import run_all  # noqa: E402

REC = ROOT / "benchmarks" / "recorded"


def _grammar(path: Path) -> dict[str, Any]:
    # the recorded file gathers both bench.py runs and the other scripts' output; bench.py
    # itself writes {"bench": [one row an engine]}
    return {"bench": json.loads(path.read_text())["bench_run2"]}


# step -> the recorded raw JSON of its script (and how to load it, where not as-is)
RECORDED: dict[str, list[str]] = {
    "overhead": ["serving_overhead-2026-11-30.json", "serving_overhead-2026-11-30-rerun.json",
                 "bench-all-2026-11-30/overhead.json"],
    "goodput": ["bench-all-2026-11-30/goodput.json"],
    "variants": ["variants_serving-2026-11-30.json"],
    # run 1 and the quick run: no peer met the tabular SLO, so the script wrote an infinite
    # goodput ratio (a legitimate value, but not the finite number checked here)
    "tensor": ["tensor_serving-issue26-2026-12-02-run2.json"],
    "grpc": ["grpc_vs_rest-2026-12-03.json"],
    "python_processes": ["python_processes.json"],
    "python_handoff": ["python_handoff.json"],
    "python": ["python_serving-2026-12-02-run1.json", "python_serving-2026-12-02-run2.json",
               "python_serving-2026-12-02-quick.json"],
    "overload": ["overload-slo-2026-12-01.json"],
    "llm": ["bench-all-2026-11-30/llm.json"],
    "speculative": ["speculative-quick-q4_1-2026-11-30.json",
                    "speculative-quick-q8_0-2026-11-30.json"],
    "structured": ["llm_structured-2026-12-02-run1.json", "llm_structured-2026-12-02-run2.json"],
    "grammar": ["grammar_engines-2026-12-02.json"],
    "media": ["media-2026-12-01.json"],
    "ocr_worst": ["ocr_worst_case-2026-12-01.json"],
    "pipelines": ["pipelines-2026-11-30.json"],
    "retrieval": ["retrieval_recall-2026-11-30.json"],
    "ann": ["retrieval_ann-2026-11-30.json"],
    "features": ["feature_lookup-2026-11-30.json"],
    "hop": ["upstream_hop-2026-12-01.json"],
    "failover": ["failover-2026-12-01.json"],
    "cascade": ["cascade-2026-12-01.json"],
    "canary": ["canary-2026-12-01.json"],
    "semantic": ["semantic_cache-2026-12-01.json"],
    "tracing": ["tracing-overhead-2026-12-01.json"],
    "dashboard": ["dashboard_overhead-2026-12-01.json"],
    "plan": ["plan-validation-2026-12-01.json"],
    "ray": ["ray_scaleout-2026-12-01.json"],
    "ray_affinity": ["ray_affinity-2026-12-01.json", "ray_affinity-inflight3-2026-12-01.json"],
    "ray_faults": ["ray_faults-2026-12-03.json"],
}
LOADERS = {"grammar": _grammar}
# steps whose script has no recorded raw JSON in the repository (said in BENCHMARKS.md)
NOT_RECORDED = {"reload", "llm_batched"}

STEPS = {s.name: s for s in run_all.STEPS}


def test_step_names_are_unique_and_every_step_is_mapped() -> None:
    names = [s.name for s in run_all.STEPS]
    assert len(names) == len(set(names))
    assert set(RECORDED) | NOT_RECORDED == set(names)
    assert not set(RECORDED) & NOT_RECORDED


def test_every_step_has_a_figure_and_a_known_area() -> None:
    areas = ["serving", "overload/admission", "LLM", "media", "pipelines", "routing",
             "observability", "plan", "scale-out"]
    seen = [s.area for s in run_all.STEPS]
    assert all(s.figures for s in run_all.STEPS)
    # in area order: an area's steps together, the areas in the documented order
    assert [a for i, a in enumerate(seen) if i == 0 or seen[i - 1] != a] == areas


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_every_reader_finds_a_finite_number_in_the_recorded_json(name: str) -> None:
    step = STEPS[name]
    for rel in RECORDED[name]:
        path = REC / rel
        assert path.is_file(), path
        result = LOADERS.get(name, lambda p: json.loads(p.read_text()))(path)
        for f in step.figures:
            value = f.read(result)
            assert isinstance(value, float) and math.isfinite(value), (rel, f.label, value)
            if f.target:
                assert isinstance(f.met(value), bool)


@pytest.mark.parametrize("name", sorted(STEPS))
def test_every_script_exists_and_takes_the_output_flag(name: str) -> None:
    step = STEPS[name]
    script = ROOT / "benchmarks" / step.script
    assert script.is_file(), script
    if step.out_flag is None:
        # no flag: the step says where the script writes, and the script does write there
        assert step.default_out is not None
        assert "recorded" in script.read_text() and step.default_out()
        return
    # --help parses the arguments and exits: nothing is measured. A side-venv script
    # (grammar) is asked by the project's venv when its own venv is absent.
    python = str(step.python) if step.python and step.python.is_file() else sys.executable
    r = subprocess.run([python, str(script), "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert step.out_flag in r.stdout, f"{step.script} has no {step.out_flag}"
    for flag in [a for a in step.quick + step.args if a.startswith("--")]:
        assert flag in r.stdout, f"{step.script} has no {flag}"


def test_command_passes_args_out_and_quick_in_order(tmp_path: Path) -> None:
    structured = STEPS["structured"]
    cmd = run_all.command(structured, tmp_path, quick=True)
    assert cmd[1].endswith("benchmarks/llm_serving.py")
    assert cmd[2:] == ["--parts", "schema", "logprobs", "--out",
                       str(tmp_path / "structured.json"), "--quick"]
    assert run_all.command(STEPS["ocr_worst"], tmp_path, quick=True)[-2:] == \
        ["--out", str(tmp_path / "ocr_worst.json")]
    assert run_all.command(STEPS["grammar"], tmp_path, quick=False)[-2] == "--json"


def test_skipped_steps_say_why() -> None:
    missing = run_all._needs_modules("surely_not_a_module_here")
    reason = missing()
    assert reason is not None and "surely_not_a_module_here" in reason
    assert run_all._needs_cores(10_000)() is not None
    assert run_all._needs_cores(1)() is None
    for s in run_all.STEPS:
        reason = s.needs()
        assert reason is None or (isinstance(reason, str) and reason)


def test_list_prints_every_step(capsys: pytest.CaptureFixture[str]) -> None:
    run_all.list_steps()
    out = capsys.readouterr().out
    for s in run_all.STEPS:
        assert f" {s.name} " in out and s.script in out


FAKE = '''
import argparse, json, sys
from pathlib import Path
ap = argparse.ArgumentParser()
ap.add_argument("--out")
ap.add_argument("--quick", action="store_true")
a = ap.parse_args()
doc = {"ratios": {"x": 0.5 if a.quick else 2.0}}
out = Path(a.out) if a.out else Path(sys.argv[0]).with_name("default-out.json")
out.write_text(json.dumps(doc))
'''


def test_main_runs_steps_skips_with_reasons_and_writes_the_table(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "fake_bench.py"
    script.write_text(FAKE)
    x = run_all.Figure("x ratio", lambda r: float(r["ratios"]["x"]), ">= 1.0")
    missing = run_all.Figure("not written", lambda r: float(r["ratios"]["nope"]), "")
    steps = [
        run_all.Step("with_out", str(script), "~0", [x, missing], quick=["--quick"]),
        run_all.Step("default_out", str(script), "~0", [x], out_flag=None,
                     default_out=lambda: [tmp_path / "default-out.json"]),
        run_all.Step("cannot", str(script), "~0", [x], needs=lambda: "no such machine here"),
    ]
    monkeypatch.setattr(run_all, "STEPS", steps)
    out_dir = tmp_path / "all"
    monkeypatch.setattr(sys, "argv", ["run_all.py", "--out-dir", str(out_dir)])
    run_all.main()
    summary = json.loads((out_dir / "summary.json").read_text())["steps"]
    assert summary["with_out"]["figures"]["x ratio"] == {
        "value": 2.0, "target": ">= 1.0", "unit": "", "met": True}
    assert summary["with_out"]["figures"]["not written"]["value"] is None
    assert "KeyError" in summary["with_out"]["figures"]["not written"]["error"]
    assert summary["default_out"]["figures"]["x ratio"]["value"] == 2.0
    assert summary["cannot"]["skipped"] == "no such machine here"
    md = (out_dir / "summary.md").read_text()
    assert "| cannot | x ratio | no such machine here | >= 1.0 |  |" in md
    assert "| with_out | x ratio | 2.000 | >= 1.0 | yes |" in md
    # --quick passes the step's quick flags
    monkeypatch.setattr(sys, "argv", ["run_all.py", "--quick", "--only", "with_out",
                                      "--out-dir", str(out_dir)])
    run_all.main()
    md = (out_dir / "summary.md").read_text()
    assert "| with_out | x ratio | 0.500 | >= 1.0 | **no** |" in md
    assert "cannot" not in md
