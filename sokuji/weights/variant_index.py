"""The variants ``sokuji optimize`` built beside an ONNX model, as the server reads them:
``<model>.variants/`` holds one directory per variant (``model.onnx`` + ``manifest.json``) and
``index.json`` (every variant, its verdict, the recommended one). Written by
``optimize/pipeline.py``; read here, so serving never imports the tool.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

INDEX = "index.json"


def variants_dir(model: Path) -> Path:
    return model.with_suffix(".variants")


def read_index(model: Path) -> dict[str, Any] | None:
    path = variants_dir(model) / INDEX
    if not path.is_file():
        return None
    return dict(json.loads(path.read_text()))


def servable(index: dict[str, Any]) -> dict[str, Path]:
    """Variants the server may load: those that passed the gate or were forced, and whose
    file is still there and unchanged."""
    root = Path(index["root"])
    out = {}
    for name, v in index["variants"].items():
        path = root / v["file"]
        if (v["passed"] or v.get("forced")) and v.get("kept", True) and path.is_file():
            out[name] = path
    return out
