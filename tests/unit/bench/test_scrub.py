"""Credentials given to ``sokuji bench`` never reach its reports (JSON, HTML, terminal)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from sokuji.bench import report, scrub
from sokuji.bench.engine import Record, RunResult
from sokuji.bench.runner import main_bench

SECRETS = ("sk-live-abc123", "k3y-value", "sess=42", "tok-xyz", "hunter2", "qs-secret")
ARGV = ["bench", "http://user:hunter2@127.0.0.1:1/?api_key=qs-secret&x=1",
        "--header", "Authorization: Bearer sk-live-abc123",
        "--header=X-API-Key: k3y-value", "--header", "Cookie: sess=42",
        "--header", "X-Auth-Token:tok-xyz", "--header", "X-Request-Source: ci",
        "--concurrency", "1", "--count", "2", "--warmup", "0", "--timeout", "2"]


@pytest.mark.parametrize(("name", "value", "shown"), [
    ("Authorization", "Bearer sk-live-abc123", "Bearer ***"),
    ("authorization", "Basic dXNlcjpwYXNz", "Basic ***"),
    ("Authorization", "sk-live-abc123", "***"),
    ("Proxy-Authorization", "Digest username=x, response=y", "Digest ***"),
    ("X-API-Key", "k3y-value", "***"),
    ("Cookie", "sess=42; other=1", "***"),
    ("X-Amz-Security-Token", "tok", "***"),
    ("Client-Secret", "s", "***"),
    ("X-Request-Source", "ci", "ci"),
    ("Content-Type", "application/json", "application/json"),
])
def test_sensitive_header_values_are_masked(name: str, value: str, shown: str) -> None:
    assert scrub.header_value(name, value) == shown
    once = scrub.header_arg(f"{name}: {value}")
    assert once == f"{name}: {shown}" and scrub.header_arg(once) == once  # idempotent


def test_urls_lose_passwords_and_secret_query_values() -> None:
    assert scrub.url("http://user:hunter2@h:8000/x") == "http://user:***@h:8000/x"
    assert scrub.url("http://h/x?api_key=qs&model=m") == "http://h/x?api_key=***&model=m"
    assert scrub.url("http://user@h/") == "http://user@h/"
    assert scrub.arg("--header=Authorization: Bearer abc") == "--header=Authorization: Bearer ***"
    assert scrub.arg("--model") == "--model" and scrub.arg("minilm") == "minilm"


def fake_result() -> dict[str, Any]:
    run = RunResult([Record(intended_s=0.0, sent_s=0.0, done_s=0.01, status=200)], 0.0, 1.0,
                    0.1, "closed")
    from sokuji.bench import stats

    config = {"url": ARGV[1], "header": [a.split("=", 1)[1] if a.startswith("--header=")
                                         else a for a in ARGV if ":" in a and "//" not in a],
              "path": "/v2/models/m/infer?token=tok-xyz", "mode": "closed"}
    return {"schema": report.SCHEMA, "started_at": "2026-01-01T00:00:00+00:00",
            "command": ["sokuji", *ARGV], "config": config, "summary": stats.summarize(run),
            "slo": [], "cost": None, "sweep": None, "samples": report.samples(run)}


def assert_clean(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, secret


def test_every_report_output_is_scrubbed(tmp_path: Path) -> None:
    result = fake_result()
    assert any(s in json.dumps(result) for s in SECRETS)  # the test can fail
    report.write_json(tmp_path / "r.json", result)
    report.write_html(tmp_path / "r.html", result)
    buf = io.StringIO()
    report.print_summary(Console(file=buf, width=200), result)
    for text in ((tmp_path / "r.json").read_text(), (tmp_path / "r.html").read_text(),
                 buf.getvalue()):
        assert_clean(text)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert "Authorization: Bearer ***" in doc["config"]["header"]
    assert "X-Request-Source: ci" in doc["config"]["header"]  # harmless headers stay
    assert "--header=X-API-Key: ***" in doc["command"]
    assert doc["config"]["url"] == "http://user:***@127.0.0.1:1/?api_key=***&x=1"


def test_the_cli_writes_no_credential(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Nothing listens on port 1: the run records connection errors, then writes its reports.
    # (aiohttp refuses user info in the URL together with an Authorization header.)
    out, page = tmp_path / "r.json", tmp_path / "r.html"
    argv = [a.replace("user:hunter2@", "") for a in ARGV]
    code = main_bench([*argv, "--out", str(out), "--html", str(page)])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["requests"]["errors"] == {"connection": 2}
    assert "Cookie: ***" in doc["config"]["header"]
    captured = capsys.readouterr()
    for text in (out.read_text(), page.read_text(), captured.out, captured.err):
        assert_clean(text)


def test_a_malformed_header_is_refused_without_echoing_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main_bench(["bench", "http://127.0.0.1:1", "--header", "Authorization sk-live-abc123",
                       "--concurrency", "1", "--count", "1"]) == 2
    err = capsys.readouterr().err
    assert "--header number 1" in err and "sk-live-abc123" not in err
