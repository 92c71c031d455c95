"""The V2 decoder's fast path (one JSON input of flat strings, checked by msgspec) decides
exactly as the full decoder: every body it takes gives the same request as the full path, and
every body the full path refuses it declines (so the refusal keeps its wording)."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import orjson
import pytest

from sokuji.core.model import ModelMetadata, TensorSpec
from sokuji.core.tensor import InferRequest
from sokuji.errors import SokujiError
from sokuji.server import v2

META = ModelMetadata("x", (TensorSpec("text", "BYTES", (-1,)),),
                     (TensorSpec("embedding", "FP32", (-1, 4)),))
MAX_ITEMS = 3
BASE: dict[str, Any] = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2],
                                    "data": ["héllo", "wörld"]}]}


def variant(top: dict[str, Any] | None = None, **tensor: Any) -> bytes:
    doc = copy.deepcopy(BASE)
    doc["inputs"][0].update(tensor)
    for key in [k for k, v in doc["inputs"][0].items() if v is _DROP]:
        del doc["inputs"][0][key]
    doc.update(top or {})
    return orjson.dumps(doc)


_DROP = object()

BODIES: list[bytes] = [
    variant(),
    variant(shape=[2, 1]),
    variant(shape=[1, 2]),
    variant(shape=[3]),
    variant(shape=[]),
    variant(shape=[-2]),
    variant(shape=[True, True]),
    variant(shape=[2.0]),
    variant(shape="2"),
    variant(data=[["a"], ["b"]]),
    variant(data=["a", 5]),
    variant(data=[], shape=[0]),
    variant(data=["a", "b", "c", "d"], shape=[4]),
    variant(data=_DROP),
    variant(name="other"),
    variant(name=5),
    variant(datatype="FP32"),
    variant(parameters={}),
    variant(parameters=None),
    variant(parameters={"custom": 1}),
    variant(parameters={"binary_data_size": 4}),
    variant(parameters=[]),
    variant(extra_field=1),
    variant({"id": "req-1"}),
    variant({"id": None}),
    variant({"id": 7}),
    variant({"parameters": {"binary_data_output": True}}),
    variant({"parameters": {"binary_data_output": "yes"}}),
    variant({"parameters": {"priority": 1, "timeout": 5000}}),
    variant({"parameters": None}),
    variant({"parameters": [1]}),
    variant({"outputs": [{"name": "embedding"}]}),
    variant({"outputs": [{"name": "embedding", "parameters": {"binary_data": True}}]}),
    variant({"outputs": [{"name": "nope"}]}),
    variant({"outputs": "embedding"}),
    variant({"outputs": None}),
    variant({"model_name": "x"}),
    variant({"inputs": []}),
    variant({"inputs": [BASE["inputs"][0], BASE["inputs"][0]]}),
    b'{"inputs":[{"name":"text","datatype":"BYTES","shape":[1],"data":["a"],"data":["b","c"]}]}',
    b'{"inputs":[{"name":"text","datatype":"BYTES","shape":[1],"data":["\\ud800"]}]}',
    b'{"inputs":[{"name":"text","datatype":"BYTES","shape":[1],"data":["a"]}]} trailing',
    b'[1, 2]',
    b'not json',
    b'\xff\xfe',
]


def full(body: bytes) -> InferRequest | SokujiError:
    try:
        return v2._decode_full(body, None, META)
    except SokujiError as exc:
        return exc


@pytest.mark.parametrize("body", BODIES)
def test_the_fast_path_decides_as_the_full_decoder(body: bytes) -> None:
    expected = full(body)
    try:
        plain = v2._decode_plain(body, META)
    except SokujiError as exc:  # only what the full path raises too, worded alike
        assert isinstance(expected, SokujiError) and str(exc) == str(expected)
        return
    if plain is None:
        return  # declined: the full path answers, as before
    assert not isinstance(expected, SokujiError), f"fast path took what full refuses: {body!r}"
    assert plain == expected


def plain_or_none(body: bytes) -> InferRequest | None:
    try:
        return v2._decode_plain(body, META)
    except SokujiError:
        return None


def test_the_common_requests_take_the_fast_path() -> None:
    taken = [body for body in BODIES if plain_or_none(body) is not None]
    assert variant() in taken and variant(shape=[2, 1]) in taken
    assert variant({"outputs": [{"name": "embedding"}]}) in taken
    assert len(taken) >= 10


@pytest.mark.parametrize(("n", "shape"),
                         list(itertools.product(range(1, 5), ([1], [2], "n", "n1"))))
def test_item_counts_and_shapes(n: int, shape: Any) -> None:
    dims = [n] if shape == "n" else [n, 1] if shape == "n1" else shape
    body = variant(data=[f"t{i}" for i in range(n)], shape=dims)
    plain = v2._decode_plain(body, META)
    expected = full(body)
    if plain is not None:
        assert plain == expected
    else:
        assert isinstance(expected, SokujiError) or dims not in ([n], [n, 1])
