"""Sokuji: a latency-first AI inference server. Importing it loads no runtime.

``sokuji.stage(name)``: inside a Python model's ``predict``, time a part of the batch so it
shows in each of its requests' ``Server-Timing`` (``pycode/stage.py``)."""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "stage":  # (imported when first asked for: sokuji stays light)
        from sokuji.pycode.stage import stage

        return stage
    raise AttributeError(f"module 'sokuji' has no attribute {name!r}")
