"""``POST /v2/models/{pipeline}/infer``: a pipeline over the KServe V2 protocol (JSON only).

Inputs are V2 tensors named as the pipeline's inputs: BYTES tensors hold strings (one
element: the string; several: a list), numeric ones numbers. Outputs: the answer step's
output, then each extra output, each named by its step: a string is a BYTES tensor of one
element, a list of strings one element each, anything else (a retrieval's hits, a feature
row) JSON text per element; a vector or matrix an FP32 tensor. Binary tensors are refused
(400): a pipeline's inputs are a few strings.

Whole answers go through the response cache like a model's (key: tenant, pipeline, version,
the inputs), stored as their encoded outputs. ``Server-Timing`` has ``step.<name>`` for each
step (start offset in its description) and ``critical-path``; ``X-Sokuji-Pipeline-Steps``
lists every step's start and duration, so overlapping steps are visible.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson

from sokuji.core import timing
from sokuji.core.cache import Entry, ResponseCache, cache_key
from sokuji.core.model import RequestContext
from sokuji.core.request import Stage, Timeline
from sokuji.errors import BadRequest, InvalidInput
from sokuji.pipelines.model import PipelineModel
from sokuji.repository.models import Model
from sokuji.server import v2
from sokuji.server.http import Headers

STEPS_HEADER = "x-sokuji-pipeline-steps"
NUMERIC = {"BOOL", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64",
           "FP16", "FP32", "FP64"}
MAX_ELEMENTS = 1024


def decode(body: bytes, headers: Headers) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """The named inputs, the request id and the parameters (priority, timeout), or a 400
    naming what is wrong."""
    if headers.get(v2.HEADER_LENGTH) is not None:
        raise BadRequest("pipelines take JSON tensors only, not the binary extension")
    doc = v2.parse_json(body)
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
        raise InvalidInput("the body must be a JSON object with an 'inputs' list",
                           param="inputs")
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidInput("'id' must be a string", param="id")
    parameters = doc.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be an object", param="parameters")
    out: dict[str, Any] = {}
    for i, t in enumerate(doc["inputs"]):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise InvalidInput(f"inputs[{i}] must be an object with a 'name'", param="inputs")
        name, dtype, shape, data = t["name"], t.get("datatype"), t.get("shape"), t.get("data")
        if name in out:
            raise InvalidInput(f"input '{name}' is given twice", param=name)
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0
                                                  for d in shape):
            raise InvalidInput(f"input '{name}': 'shape' must be a list of sizes", param=name)
        if not isinstance(data, list):
            raise InvalidInput(f"input '{name}': 'data' must be a list", param=name)
        count = math.prod(shape)
        if count != len(data) or count > MAX_ELEMENTS:
            raise InvalidInput(f"input '{name}': shape {shape} does not match its "
                               f"{len(data)} elements" if count != len(data) else
                               f"input '{name}' has more than {MAX_ELEMENTS} elements",
                               param=name)
        if dtype == "BYTES":
            if not all(isinstance(x, str) for x in data):
                raise InvalidInput(f"input '{name}': BYTES data must be strings", param=name)
        elif dtype in NUMERIC:
            if not all(isinstance(x, int | float) for x in data):
                raise InvalidInput(f"input '{name}': {dtype} data must be numbers", param=name)
        else:
            raise InvalidInput(f"input '{name}': unsupported datatype {dtype!r}", param=name)
        out[name] = data[0] if count == 1 else data
    return out, request_id, parameters


def _tensor(name: str, value: Any) -> dict[str, Any]:
    if isinstance(value, np.ndarray) and value.dtype.kind in "fiu":
        return {"name": name, "datatype": "FP32", "shape": list(value.shape),
                "data": np.ascontiguousarray(value, dtype=np.float32).ravel()}
    if isinstance(value, str):
        return {"name": name, "datatype": "BYTES", "shape": [1], "data": [value]}
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return {"name": name, "datatype": "BYTES", "shape": [len(value)], "data": value}
    items = value if isinstance(value, list) else [value]
    return {"name": name, "datatype": "BYTES", "shape": [len(items)],
            "data": [orjson.dumps(v, option=orjson.OPT_SERIALIZE_NUMPY).decode()
                     for v in items]}


async def infer(model: Model, pipe: PipelineModel, body: bytes, headers: Headers,
                ctx_of: Any, tl: Timeline, cache: ResponseCache | None
                ) -> tuple[bytes, Headers]:
    """The pipeline's answer as a V2 response body and its headers. ``ctx_of(request_id,
    parameters)`` builds the request's context (once the body is decoded)."""
    inputs, request_id, parameters = decode(body, headers)
    tl.mark(Stage.DECODE)
    ctx: RequestContext = ctx_of(request_id, parameters)
    prepared = await pipe.prepare(inputs, ctx)
    extra_headers: Headers = {}

    async def compute() -> Entry:
        handle = pipe.submit(prepared, ctx)
        try:
            answer = await handle.result()
        finally:
            extra_headers["server-timing"] = timing.render(handle.run.timing_entries())
            extra_headers[STEPS_HEADER] = handle.run.steps_header()
        tensors = [_tensor(pipe.graph.nodes[pipe.graph.output].name, answer)]
        tensors += [_tensor(name, value) for name, value in handle.run.extra().items()]
        body = orjson.dumps(tensors, option=orjson.OPT_SERIALIZE_NUMPY)
        return Entry(np.frombuffer(body, dtype=np.uint8), 0)

    control = headers.get("cache-control", "").lower()
    if cache is None or not model.config.cache:
        entry = await compute()
    else:
        key = cache_key(ctx.tenant, model.name, model.version,
                        [orjson.dumps(inputs, option=orjson.OPT_SORT_KEYS).decode()])
        entry, result = await cache.get_or_compute(
            model.name, key, compute, read="no-cache" not in control,
            store="no-store" not in control)
        tl.notes[Stage.CACHE] = result.value
    tl.mark(Stage.INFER)
    doc = b'{"model_name":%s,"model_version":%s,%s"outputs":%s}' % (
        orjson.dumps(model.name), orjson.dumps(model.version),
        b'"id":%s,' % orjson.dumps(request_id) if request_id else b"",
        entry.output.tobytes())
    extra_headers["content-type"] = "application/json"
    return doc, extra_headers
