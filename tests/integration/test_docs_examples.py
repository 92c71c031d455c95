"""The documentation's examples run against a real ``sokuji serve`` (FastAPI's ``docs_src``
habit): each file in ``docs_src/`` is what a page includes (``--8<--``, pymdownx.snippets),
so an example that stops working fails ``make test``; the README's tour blocks marked
``<!-- docs_src/NAME -->`` must be those files, verbatim."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import CACHE_DIR, ROOT
from tests.integration.serving import free_port, sokuji_server

pytestmark = pytest.mark.integration

SRC = ROOT / "docs_src"
GRPC_PORT = free_port()
CONFIG = f"""grpc_port = {GRPC_PORT}
cache_dir = "{CACHE_DIR}"
builtin_pipelines = false
[[models]]
name = "minilm"
[[models]]
name = "smollm2"
runtime = "llama"
cache = false
[models.options]
slots = 2
context_size = 512
"""
EXPECTED = {
    "v2_infer.sh": [r"(?im)^server-timing: .*total;dur=", r"embedding FP32 \[2, 384\]"],
    "openai_embeddings.py": [r"2 embeddings of 384 floats"],
    "openai_chat.py": [r"Paris"],
    "tritonclient_http.py": [r"embeddings \(2, 384\) float32", r"'count': \d+"],
    "tritonclient_grpc.py": [r"live: True ready: True", r"embeddings \(1, 384\)"],
    "bench.sh": [r"throughput", r"p99"],
}
"""What each example must print (a reader would check the same)."""


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with sokuji_server(CONFIG) as base:
        yield base


def test_every_example_is_checked() -> None:
    assert sorted(p.name for p in SRC.iterdir() if p.suffix in (".sh", ".py")) == sorted(
        EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_example_runs_against_a_real_server(url: str, name: str) -> None:
    path = SRC / name
    command = ["bash", str(path)] if path.suffix == ".sh" else [sys.executable, str(path)]
    env = {**os.environ, "SOKUJI_URL": url, "SOKUJI_GRPC": f"127.0.0.1:{GRPC_PORT}",
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
           "COLUMNS": "120"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for pattern in EXPECTED[name]:
        assert re.search(pattern, done.stdout), (pattern, done.stdout[-2000:])


def test_the_readmes_marked_blocks_are_the_example_files() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    marked = re.findall(r"<!-- docs_src/(\S+) -->\n```\w*\n(.*?)```", text, re.S)
    for name, block in marked:
        assert block == (SRC / name).read_text(encoding="utf-8"), name
