"""Shared by the benchmark scripts: run ``sokuji bench`` pinned to a core, get its summary."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def sokuji_bench(url: str, args: list[str], core: int) -> dict[str, Any]:
    """``sokuji bench URL ARGS`` on ``core``; returns the result's ``summary``."""
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    try:
        subprocess.run(["taskset", "-c", str(core), sys.executable, "-m", "sokuji", "bench",
                        url, "--quiet", "--out", str(out), *args], check=False, cwd=ROOT)
        return dict(json.loads(out.read_text())["summary"])
    finally:
        out.unlink()
