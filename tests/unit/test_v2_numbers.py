"""Numeric JSON data takes a fast path (``v2._numbers``: types checked as one set, numpy
converts); the general path words refusals. Both must decide every body the same way: the
same array, or the same refusal."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from sokuji.errors import InvalidInput
from sokuji.server import v2

CASES: list[tuple[str, tuple[int, ...], Any]] = [
    ("FP32", (2, 3), [1, 2.5, -3, 4e38, 0.0, 7]),
    ("FP32", (2, 3), [[1, 2.5, -3], [4, 0.0, 7]]),
    ("FP32", (2, 3), [[1, 2.5], [-3, 4, 0.0, 7]]),       # ragged: same count, refused?
    ("FP32", (2, 3), [[1, 2.5, True], [4, 0.0, 7]]),     # a bool among numbers
    ("FP32", (2, 3), [1, 2.5, "3", 4, 0.0, 7]),          # a string
    ("FP32", (2, 2), [1, 2, 3]),                          # too few
    ("FP32", (2, 2), [[1, 2], [3, [4]]]),                 # mixed depth
    ("FP16", (3,), [1.0, 65504.0, 1e5]),                  # overflows FP16: inf, both ways
    ("FP64", (0, 4), []),
    ("INT64", (3,), [1, -2, 2**63 - 1]),
    ("INT64", (3,), [1, -2, 2**64]),                      # out of range
    ("INT32", (2,), [1, 2.0]),                            # a float for an integer
    ("UINT8", (3,), [0, 255, 256]),                       # out of range
    ("UINT8", (3,), [0, 255, -1]),
    ("UINT64", (2,), [2**64 - 1, 0]),
    ("BOOL", (2, 2), [[True, False], [False, True]]),
    ("BOOL", (2,), [True, 1]),                            # an int for a bool
    ("FP32", (1,), [None]),
    ("FP32", (1,), [{"a": 1}]),
    ("FP32", (2, 1, 2), [[[1, 2]], [[3, 4]]]),
]


def _decide(datatype: str, shape: tuple[int, ...], data: Any) -> Any:
    count = int(np.prod(shape)) if shape else 1
    try:
        with np.errstate(over="ignore"):
            out = v2._json_data("x", datatype, shape, count, data)
        return ("ok", out.dtype.str, out.shape, out.tobytes())
    except InvalidInput as exc:
        return ("refused", exc.message, exc.param)


@pytest.mark.parametrize(("datatype", "shape", "data"), CASES)
def test_the_fast_path_decides_as_the_general_one(monkeypatch: pytest.MonkeyPatch,
                                                   datatype: str, shape: tuple[int, ...],
                                                   data: Any) -> None:
    fast = _decide(datatype, shape, data)
    monkeypatch.setattr(v2, "_numbers", lambda *a: None)
    assert _decide(datatype, shape, data) == fast


def test_the_fast_path_is_taken_for_plain_numbers() -> None:
    data = [float(i) for i in range(6)]
    out = v2._numbers("FP32", (2, 3), 6, data)
    assert out is not None and out.dtype == np.float32 and out.shape == (2, 3)
    assert v2._numbers("FP32", (2, 3), 6, [*data[:5], True]) is None
