"""Open Inference Protocol (KServe V2) encoding, REST, with Triton's binary tensor extension:
output tensors into an infer response's body (each as JSON data or as binary data, as the
request asked: ``v2.decode`` reads what it asked for), and a model's V2 metadata body.

Binary data follows the JSON header, its length in the ``Inference-Header-Content-Length``
header; a tensor's bytes are its elements in row-major order, little-endian; BYTES elements
are each prefixed with a 4-byte little-endian length. JSON data that holds NaN or infinity is
written with the ``NaN`` / ``Infinity`` tokens Triton writes (never null).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson

from sokuji.core.model import ModelMetadata, TensorSpec
from sokuji.core.tensor import BYTES, DTYPES, Tensor
from sokuji.server.v2 import HEADER_LENGTH

_LENGTH = struct.Struct("<I")

def _blob(tensor: Tensor) -> bytes:
    """The tensor's binary data."""
    if tensor.datatype == BYTES:
        raw = [e if isinstance(e, bytes) else str(e).encode("utf-8") for e in tensor.data]
        return b"".join(_LENGTH.pack(len(r)) + r for r in raw)
    return np.ascontiguousarray(tensor.data, dtype=DTYPES[tensor.datatype]).tobytes()


def _json(tensor: Tensor) -> Any:
    """The tensor's JSON data (flat, row-major)."""
    if tensor.datatype == BYTES:
        return [e.decode("utf-8", "replace") if isinstance(e, bytes) else e
                for e in tensor.data]
    return np.ascontiguousarray(tensor.data, dtype=DTYPES[tensor.datatype]).reshape(-1)


def encode_outputs(outputs: Sequence[Tensor], wanted: Mapping[str, bool]
                   ) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The V2 output objects for the tensors ``wanted`` names (in ``outputs``' order), each
    with JSON data or, where ``wanted`` says binary, the binary data that follows."""
    docs, blobs = [], []
    for tensor in outputs:
        binary = wanted.get(tensor.name)
        if binary is None:
            continue
        doc: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype,
                               "shape": list(tensor.shape)}
        if binary:
            blob = _blob(tensor)
            doc["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            doc["data"] = _json(tensor)
        docs.append(doc)
    return docs, blobs


def _finite(out: dict[str, Any]) -> bool:
    """Whether an output's JSON data holds no NaN or infinity (orjson would write null)."""
    data = out.get("data")
    return not (isinstance(data, np.ndarray) and data.dtype.kind == "f"
                and not np.isfinite(data).all())


def _with_non_finite(doc: dict[str, Any]) -> bytes:
    """A response whose JSON data holds NaN or infinity, written as the ``NaN``,
    ``Infinity`` and ``-Infinity`` tokens Triton writes and Python's (and tritonclient's)
    JSON reader takes: the values as the model computed them, never null or an error."""
    import json

    def plain(value: Any) -> Any:
        return value.tolist() if isinstance(value, np.ndarray) else value

    outputs = [{k: plain(v) for k, v in o.items()} for o in doc["outputs"]]
    return json.dumps({**doc, "outputs": outputs}, separators=(",", ":")).encode()


def encode_infer(model_name: str, version: str, request_id: str,
                 outputs: Sequence[Tensor], wanted: Mapping[str, bool]
                 ) -> tuple[bytes, dict[str, str]]:
    """Body and headers of an infer response; binary outputs follow the JSON header."""
    doc: dict[str, Any] = {"model_name": model_name, "model_version": version}
    if request_id:
        doc["id"] = request_id
    doc["outputs"], blobs = encode_outputs(outputs, wanted)
    head = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY) \
        if all(_finite(o) for o in doc["outputs"]) else _with_non_finite(doc)
    if not blobs:
        return head, {"content-type": "application/json"}
    return b"".join([head, *blobs]), {"content-type": "application/octet-stream",
                                      HEADER_LENGTH: str(len(head))}


def model_metadata(name: str, versions: Sequence[str], meta: ModelMetadata) -> dict[str, Any]:
    """The V2 model metadata body; ``versions``: every version name the model answers to."""
    def tensor(t: TensorSpec) -> dict[str, Any]:
        return {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}

    return {"name": name, "versions": list(versions), "platform": meta.platform,
            "inputs": [tensor(t) for t in meta.inputs],
            "outputs": [tensor(t) for t in meta.outputs]}
