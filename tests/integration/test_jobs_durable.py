"""Accepted jobs survive SIGKILL: after a restart every one completes, exactly once. (The
jobs the killed server was running wait for their leases to pass: ``DEFAULT_LEASE_S``.)"""

from __future__ import annotations

import json
import signal
import sqlite3
import time
import urllib.request
from pathlib import Path

import pytest

from sokuji.core.job import DEFAULT_LEASE_S
from tests.integration.serving import sokuji_process

pytestmark = pytest.mark.integration


def submit(url: str, text: str) -> str:
    body = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                   "data": [text]}]}).encode()
    req = urllib.request.Request(f"{url}/v2/models/slow/infer", data=body, headers={
        "content-type": "application/json", "prefer": "respond-async"})
    with urllib.request.urlopen(req) as r:
        assert r.status == 202
        return str(json.loads(r.read())["id"])


def job(url: str, job_id: str) -> dict[str, object]:
    with urllib.request.urlopen(f"{url}/v2/jobs/{job_id}") as r:
        return dict(json.loads(r.read()))


def test_accepted_jobs_complete_exactly_once_across_a_sigkill(tmp_path: Path) -> None:
    config = f"""
cache_dir = "{tmp_path}"
[jobs]
concurrency = 2
[[models]]
name = "slow"
runtime = "synthetic"
cache = false
max_batch_size = 1
options = {{base_ms = 100.0}}
"""
    texts = [f"job number {i}" for i in range(12)]
    with sokuji_process(config) as (proc, url):
        ids = [submit(url, t) for t in texts]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # let some finish, some run, most wait
            if sum(job(url, i)["status"] == "done" for i in ids) >= 3:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with sokuji_process(config) as (_, url):
        deadline = time.monotonic() + 30 + DEFAULT_LEASE_S
        while time.monotonic() < deadline:
            states = [job(url, i)["status"] for i in ids]
            if all(s == "done" for s in states):
                break
        assert states == ["done"] * len(ids)
        for job_id, text in zip(ids, texts, strict=True):
            with urllib.request.urlopen(f"{url}/v2/jobs/{job_id}/result") as r:
                assert json.loads(r.read())["outputs"][0]["data"] == [float(len(text))]
    db = sqlite3.connect(tmp_path / "jobs.sqlite")
    rows = db.execute("SELECT completions, attempts FROM jobs").fetchall()
    assert len(rows) == len(ids)
    assert all(completions == 1 for completions, _ in rows)
    assert all(attempts >= 1 for _, attempts in rows)
