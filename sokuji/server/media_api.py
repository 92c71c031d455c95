"""``POST /v2/models/{ocr|vad}/infer``: files in, over KServe V2 or as a plain upload.

Three ways to send the file(s), one answer each:
- **V2, binary tensor extension** (tritonclient with ``binary_data=True``, perf_analyzer): the
  input (``image`` / ``audio``) is a BYTES tensor of shape [N] (or [N, 1]) whose elements are
  the encoded files, raw, each after its 4-byte little-endian length. No UTF-8 anywhere.
- **V2, JSON**: each element a base64 string (JSON cannot carry raw bytes; the input's
  ``parameters.content_type`` may say ``"base64"``, no other value is accepted).
- **A plain upload**: the file itself as the body (``Content-Type: image/png``, ``image/jpeg``,
  ``image/webp``, ``audio/wav``, ``audio/flac`` or ``application/octet-stream`` without
  ``Inference-Header-Content-Length``), or ``multipart/form-data`` with one file part
  (``file``). The answer is plain JSON: the model's name and version and the file's result
  (``lines`` or ``segments``).

V2 answers carry the engine's output tensors (JSON, or binary where the request asks, as
Triton does). Whole answers go through the response cache like an encoder's (key: tenant,
model, version, each file's SHA-256, the parameters). The engine's stages go into
``Server-Timing`` after the request's own.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import struct
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

import numpy as np
import orjson

from sokuji.core import timing
from sokuji.core.cache import Entry, ResponseCache, cache_key
from sokuji.core.model import RequestContext
from sokuji.core.request import Stage, Timeline
from sokuji.errors import BadRequest, InvalidInput, TooManyItems, UnsupportedMediaType
from sokuji.media.model import MediaModel
from sokuji.repository.models import Model
from sokuji.server import v2
from sokuji.server.http import JSON, Headers

RAW_TYPES = frozenset({"image/png", "image/jpeg", "image/webp", "audio/wav", "audio/x-wav",
                       "audio/wave", "audio/vnd.wave", "audio/flac", "audio/x-flac",
                       "application/octet-stream"})
MULTIPART = "multipart/form-data"
INLINE_MAX_BYTES = 256 * 1024
"""V2 bodies up to this size are decoded on the event loop; larger ones (base64 files: ~1 ms
a MiB) in the preparation pool."""
DTYPES = {"FP32": np.float32, "FP64": np.float64, "INT32": np.int32, "INT64": np.int64,
          "UINT8": np.uint8, "BOOL": np.bool_}


def body_kind(headers: Headers) -> str:
    """``v2`` (JSON or the binary extension), ``raw`` (the file is the body) or
    ``multipart``; 415 for anything else."""
    ctype = headers.get("content-type")
    base = (ctype or JSON).split(";", 1)[0].strip().lower()
    if base == JSON or (base == "application/octet-stream"
                        and headers.get(v2.HEADER_LENGTH) is not None):
        return "v2"
    if base in RAW_TYPES:
        return "raw"
    if base == MULTIPART:
        return "multipart"
    raise UnsupportedMediaType(
        f"Content-Type {ctype!r} is not supported; send a V2 request (application/json, or "
        "application/octet-stream with Inference-Header-Content-Length), the file itself "
        "(image/png, image/jpeg, image/webp, audio/wav, audio/flac, application/octet-stream) "
        "or multipart/form-data with a 'file' part")


def decode_v2(body: bytes, header_length: int | None, name: str, max_files: int
              ) -> tuple[list[bytes], str, dict[str, Any], dict[str, bool]]:
    """The files, the request id, the parameters, the requested outputs (name -> binary),
    or a 400 naming what is wrong. ``name``: the model's one input."""
    if header_length is not None:
        if not 0 < header_length <= len(body):
            raise BadRequest(f"Inference-Header-Content-Length {header_length} does not fit "
                             f"a body of {len(body)} bytes")
        head, binary = body[:header_length], memoryview(body)[header_length:]
    else:
        head, binary = body, memoryview(b"")
    doc = v2.parse_json(head)
    if not isinstance(doc, dict):
        raise BadRequest("request body must be a JSON object")
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidInput(f"'id' must be a string, got {v2.brief(request_id)}", param="id")
    parameters = doc.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be an object", param="parameters")
    all_binary = parameters.get("binary_data_output", False)
    if not isinstance(all_binary, bool):
        raise InvalidInput("parameter 'binary_data_output' must be a boolean",
                           param="parameters.binary_data_output")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise InvalidInput(f"'inputs' must be a list of one input, '{name}'", param="inputs")
    tensor = inputs[0]
    if tensor.get("name") != name:
        raise InvalidInput(f"unexpected input {v2.brief(tensor.get('name'))}; the model "
                           f"takes: {name}", param="inputs")
    if tensor.get("datatype") != "BYTES":
        raise InvalidInput(f"input '{name}' has datatype {v2.brief(tensor.get('datatype'))}; "
                           "expected BYTES (encoded files)", param=f"inputs.{name}.datatype")
    shape = tensor.get("shape")
    tparams = tensor.get("parameters") or {}
    if not isinstance(tparams, dict):
        raise InvalidInput(f"input '{name}' parameters must be an object",
                           param=f"inputs.{name}.parameters")
    size = tparams.get("binary_data_size")
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= len(binary):
            raise InvalidInput(f"input '{name}' binary_data_size {v2.brief(size)} does not fit "
                               f"the {len(binary)} binary bytes",
                               param=f"inputs.{name}.parameters.binary_data_size")
        if size != len(binary):
            raise InvalidInput(f"{len(binary) - size} bytes of binary data belong to no input")
        files = _binary_elements(name, binary)
    elif len(binary):
        raise InvalidInput(f"{len(binary)} bytes of binary data belong to no input")
    elif "data" in tensor:
        content = tparams.get("content_type", "base64")
        if content != "base64":
            raise InvalidInput(f"input '{name}' content_type {v2.brief(content)} is not "
                               "supported; JSON data must be base64 (or send the files "
                               "with the binary tensor extension)",
                               param=f"inputs.{name}.parameters.content_type")
        files = _base64_elements(name, tensor["data"])
    else:
        raise InvalidInput(f"input '{name}' has neither 'data' nor binary data")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool)
                                              for d in shape) \
            or shape not in ([len(files)], [len(files), 1]):
        raise InvalidInput(f"input '{name}' has shape {v2.brief(shape)} with {len(files)} "
                           "elements; expected [N] or [N, 1] holding N files",
                           param=f"inputs.{name}.shape")
    check_count(name, len(files), max_files)
    outputs = _requested(doc.get("outputs"), all_binary)
    return files, request_id, parameters, outputs


def check_count(name: str, count: int, max_files: int) -> None:
    if count == 0:
        raise InvalidInput(f"input '{name}' is empty: nothing to infer", param=f"inputs.{name}")
    if count > max_files:
        raise TooManyItems(f"input '{name}' has {count} files; this model takes at most "
                           f"{max_files} per request", param=f"inputs.{name}")


def _binary_elements(name: str, buf: memoryview) -> list[bytes]:
    out, pos = [], 0
    while pos < len(buf):
        if pos + 4 > len(buf):
            raise InvalidInput(f"input '{name}': truncated BYTES element length at byte {pos}")
        (n,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if pos + n > len(buf):
            raise InvalidInput(f"input '{name}': BYTES element of {n} bytes overruns the data")
        out.append(bytes(buf[pos:pos + n]))
        pos += n
    return out


def _base64_elements(name: str, data: Any) -> list[bytes]:
    if not isinstance(data, list):
        raise InvalidInput(f"input '{name}' data must be a list", param=f"inputs.{name}.data")
    flat: list[Any] = []
    for item in data:
        flat.extend(item if isinstance(item, list) else (item,))
    out = []
    for i, item in enumerate(flat):
        if not isinstance(item, str):
            raise InvalidInput(f"input '{name}' element {i} is {type(item).__name__}; "
                               "expected a base64 string", param=f"inputs.{name}.data")
        try:
            out.append(base64.b64decode(item, validate=True))
        except (binascii.Error, ValueError):
            raise InvalidInput(f"input '{name}' element {i} is not valid base64 (send the "
                               "file's bytes base64-encoded, or use the binary tensor "
                               "extension)", param=f"inputs.{name}.data") from None
    return out


def _requested(outputs: Any, all_binary: bool) -> dict[str, bool]:
    """Requested output name -> binary; empty: every output (checked against the model's
    outputs once known)."""
    if outputs is None:
        return {"*": all_binary}
    if not isinstance(outputs, list):
        raise InvalidInput("'outputs' must be a list", param="outputs")
    chosen = {}
    for i, out in enumerate(outputs):
        oname = out.get("name") if isinstance(out, dict) else None
        if not isinstance(oname, str):
            raise InvalidInput(f"outputs[{i}] must be an object with a string 'name'",
                               param="outputs")
        oparams = out.get("parameters") or {}
        binary = oparams.get("binary_data", all_binary) if isinstance(oparams, dict) else None
        if not isinstance(binary, bool):
            raise InvalidInput(f"output '{oname}' parameter 'binary_data' must be a boolean",
                               param=f"outputs.{oname}.parameters.binary_data")
        chosen[oname] = binary
    return chosen


async def multipart_file(body: bytes, headers: Headers, limit: int) -> bytes:
    """The one file part of a ``multipart/form-data`` body (its field named ``file``, or
    the only file there is); 400 naming what is missing."""
    from starlette.datastructures import Headers as StarletteHeaders
    from starlette.datastructures import UploadFile
    from starlette.formparsers import MultiPartException, MultiPartParser

    async def stream() -> AsyncGenerator[bytes, None]:
        yield body

    parser = MultiPartParser(StarletteHeaders(headers=headers), stream(), max_files=1,
                             max_fields=8, max_part_size=64 * 1024)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise BadRequest(f"malformed multipart/form-data: {exc.message}") from None
    try:
        files = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
        if not files:
            raise InvalidInput("multipart/form-data has no file part; send the file as "
                               "'file'", param="file")
        chosen = next((v for k, v in form.multi_items() if k == "file"
                       and isinstance(v, UploadFile)), files[0])
        return await chosen.read(limit + 1)
    finally:
        await form.close()


def encode_outputs(tensors: list[tuple[str, str, list[int], Any]], wanted: Mapping[str, bool],
                   ) -> tuple[list[dict[str, Any]], list[bytes]]:
    """V2 output tensors (JSON data, or binary data as Triton sends it) for ``wanted``."""
    known = [t[0] for t in tensors]
    for name in wanted:
        if name != "*" and name not in known:
            raise InvalidInput(f"unknown output {v2.brief(name)}; the model gives: "
                               f"{', '.join(known)}", param="outputs")
    docs, blobs = [], []
    for name, dtype, shape, data in tensors:
        binary = wanted.get(name, wanted.get("*"))
        if binary is None:
            continue
        doc: dict[str, Any] = {"name": name, "datatype": dtype, "shape": shape}
        if dtype == "BYTES":
            if binary:
                raw = [s.encode() for s in data]
                blob = b"".join(struct.pack("<I", len(r)) + r for r in raw)
            else:
                doc["data"] = list(data)
        else:
            array: np.ndarray = np.ascontiguousarray(data, dtype=DTYPES[dtype])
            if binary:
                blob = array.tobytes()
            else:
                doc["data"] = array.reshape(-1)
        if binary:
            doc["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        docs.append(doc)
    return docs, blobs


async def infer(model: Model, media: MediaModel, files: list[bytes], request_id: str,
                parameters: dict[str, Any], wanted: dict[str, bool] | None,
                ctx_of: Callable[[str, dict[str, Any]], RequestContext], tl: Timeline,
                cache: ResponseCache | None, cache_control: str,
                observe: Callable[[str, list[Any]], None] | None = None
                ) -> tuple[bytes, Headers]:
    """The answer to ``files``: V2 outputs (``wanted``) or, for a plain upload (``wanted``
    None), the one file's result as plain JSON. ``observe(model, jobs)``: the stages'
    metrics, called soon after."""
    ctx = ctx_of(request_id, parameters)
    stage_entries: list[timing.Entry] = []

    async def compute() -> Entry:
        if cache is not None and model.config.cache:
            tl.mark(Stage.CACHE)
        prepared = await media.prepare((files, parameters), ctx)
        handle = media.submit(prepared, ctx)
        try:
            results = await handle.result()
        finally:
            stage_entries.extend(handle.stage_entries())
            if observe is not None:  # off the response's own latency
                asyncio.get_running_loop().call_soon(observe, model.metric_name, handle.jobs)
        if wanted is None:
            doc = {"model_name": model.name, "model_version": model.version,
                   **media.engine.plain(results[0])}
            out = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
        else:
            docs, blobs = encode_outputs(media.engine.outputs(results), wanted)
            head = orjson.dumps(docs, option=orjson.OPT_SERIALIZE_NUMPY)
            out = _pack(head, blobs)
        return Entry(np.frombuffer(out, dtype=np.uint8), 0)

    control = cache_control.lower()
    if cache is None or not model.config.cache:
        entry = await compute()
    else:
        digest = [hashlib.sha256(f).hexdigest() for f in files]
        key = cache_key(ctx.tenant, model.name, model.version, [
            *digest, orjson.dumps(media.parameters(parameters), option=orjson.OPT_SORT_KEYS
                                  ).decode(), orjson.dumps(wanted, option=orjson.OPT_SORT_KEYS
                                                           ).decode()])
        entry, result = await cache.get_or_compute(
            model.name, key, compute, read="no-cache" not in control,
            store="no-store" not in control)
        tl.notes[Stage.CACHE] = result.value
        if not stage_entries:
            tl.mark(Stage.CACHE)
    out_headers: Headers = {}
    if stage_entries:
        out_headers["server-timing"] = timing.render(stage_entries)
    raw = entry.output.tobytes()
    if wanted is None:
        out_headers["content-type"] = JSON
        return raw, out_headers
    head_len, blobs_len = struct.unpack_from("<II", raw, 0)
    head, blobs = raw[8:8 + head_len], raw[8 + head_len:]
    doc = b'{"model_name":%s,"model_version":%s,%s"outputs":%s}' % (
        orjson.dumps(model.name), orjson.dumps(model.version),
        b'"id":%s,' % orjson.dumps(request_id) if request_id else b"", head)
    if not blobs_len:
        out_headers["content-type"] = JSON
        return doc, out_headers
    out_headers["content-type"] = "application/octet-stream"
    out_headers[v2.HEADER_LENGTH] = str(len(doc))
    return doc + blobs, out_headers


def _pack(head: bytes, blobs: list[bytes]) -> bytes:
    """The cached form of a V2 answer: lengths, the outputs' JSON, the binary data."""
    tail = b"".join(blobs)
    return struct.pack("<II", len(head), len(tail)) + head + tail
