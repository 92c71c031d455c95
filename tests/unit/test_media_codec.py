"""Media over V2 (the one codec, ``server/v2.py``, and a media model's adapter,
``MediaModel.from_tensors``): files as V2 BYTES (binary extension, base64), plain uploads
(``server/uploads.py``), outputs as JSON or binary tensors. No engine needed."""

from __future__ import annotations

import base64
import struct
from typing import Any

import numpy as np
import orjson
import pytest

from sokuji.config import ModelConfig
from sokuji.core.model import ModelMetadata, TensorSpec
from sokuji.core.tensor import Tensor
from sokuji.errors import BadRequest, InvalidInput, TooManyItems, UnsupportedMediaType
from sokuji.media import audio
from sokuji.media.image import MEDIA_TYPES
from sokuji.media.model import MediaModel
from sokuji.server import uploads, v2, v2_encode

PNGISH = b"\x89PNG\r\n\x1a\n\xff\xfe\x00 not utf-8 \x80"
META = ModelMetadata("x", (TensorSpec("image", "BYTES", (-1,), media_types=MEDIA_TYPES),),
                     (TensorSpec("text", "BYTES", (-1,)), TensorSpec("scores", "FP32", (-1,)),
                      TensorSpec("image_index", "INT32", (-1,))))


AUDIO = ModelMetadata("x", (TensorSpec("audio", "BYTES", (-1,),
                                     media_types=audio.MEDIA_TYPES),), ())


class _Engine:
    """What the adapter reads of an engine."""

    input_name = "image"
    metadata = META
    streams = False
    limits = ()


MEDIA = MediaModel(ModelConfig(name="ocr", runtime="ocr", max_batch_size=4),
                   _Engine())  # type: ignore[arg-type]


def decode_v2(body: bytes, head: int | None) -> tuple[list[bytes], str, dict[str, Any],
                                                        dict[str, bool]]:
    request = v2.decode(body, head, META)
    files, params = MEDIA.from_tensors(request)
    return files, request.request_id, dict(params), request.outputs


def binary_request(files: list[bytes], **doc: object) -> tuple[bytes, int]:
    blob = b"".join(struct.pack("<I", len(f)) + f for f in files)
    head = orjson.dumps({"inputs": [{"name": "image", "datatype": "BYTES",
                                     "shape": [len(files)],
                                     "parameters": {"binary_data_size": len(blob)}}], **doc})
    return head + blob, len(head)


def test_binary_files_come_through_byte_for_byte() -> None:
    body, head = binary_request([PNGISH, b"second"], id="r1",
                                outputs=[{"name": "text", "parameters": {"binary_data": True}}])
    files, rid, params, wanted = decode_v2(body, head)
    assert files == [PNGISH, b"second"]  # no UTF-8 decoding anywhere
    assert rid == "r1" and params == {} and wanted == {"text": True}


def test_base64_json_files() -> None:
    doc = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1, 1],
                       "data": [[base64.b64encode(PNGISH).decode()]]}],
           "parameters": {"text_score": 0.6}}
    files, _, params, wanted = decode_v2(orjson.dumps(doc), None)
    assert files == [PNGISH] and params == {"text_score": 0.6}
    assert wanted == {"text": False, "scores": False, "image_index": False}


@pytest.mark.parametrize(("doc", "words"), [
    ({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": ["@@"]}]},
     "base64"),
    ({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": [7]}]},
     "must be strings"),
    ({"inputs": []}, "needs input 'image'"),
    ({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [2], "data": ["AA=="]}]},
     "shape"),
    ({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [0], "data": []}]}, "empty"),
    ({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1]}]}, "neither"),
    ({"id": 5, "inputs": []}, "'id'"),
    ({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": ["AA=="]}],
      "outputs": [{"name": 3}]}, r"outputs\[0\]"),
])
def test_bad_v2_bodies(doc: dict[str, object], words: str) -> None:
    with pytest.raises(InvalidInput, match=words):
        decode_v2(orjson.dumps(doc), None)


def test_binary_sizes_that_lie_are_refused() -> None:
    blob = struct.pack("<I", 99) + b"abc"  # says 99 bytes, has 3
    head = orjson.dumps({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                                     "parameters": {"binary_data_size": len(blob)}}]})
    with pytest.raises(InvalidInput, match="overruns"):
        decode_v2(head + blob, len(head))
    body, head_len = binary_request([PNGISH])
    head = head_len
    with pytest.raises(InvalidInput, match="belong to no input"):
        decode_v2(body + b"extra", head)
    with pytest.raises(BadRequest, match="does not fit"):
        decode_v2(body, len(body) + 1)


def test_too_many_files() -> None:
    body, head = binary_request([b"a"] * 5)
    with pytest.raises(TooManyItems, match="at most 4"):
        decode_v2(body, head)


@pytest.mark.parametrize(("ctype", "kind"), [
    (None, "v2"), ("application/json", "v2"), ("image/png", "raw"), ("audio/wav", "raw"),
    ("application/octet-stream", "raw"), ("multipart/form-data; boundary=x", "multipart")])
def test_body_kinds(ctype: str | None, kind: str) -> None:
    headers = {} if ctype is None else {"content-type": ctype}
    meta = AUDIO if ctype and ctype.startswith("audio/") else META
    assert uploads.form(headers, meta) == kind


def test_octet_stream_with_the_binary_header_is_v2_and_others_are_refused() -> None:
    assert uploads.form({"content-type": "application/octet-stream",
                         "inference-header-content-length": "10"}, META) == "v2"
    with pytest.raises(UnsupportedMediaType, match="text/plain"):
        uploads.form({"content-type": "text/plain"}, META)


def test_outputs_json_and_binary() -> None:
    tensors = [Tensor("text", "BYTES", (2,), ["héllo", "b"]),
               Tensor("scores", "FP32", (2,), np.array([0.5, 0.25])),
               Tensor("image_index", "INT32", (2,), np.array([0, 1]))]
    docs, blobs = v2_encode.encode_outputs(tensors, {"text": False, "scores": False,
                                              "image_index": False})
    assert docs[0]["data"] == ["héllo", "b"] and not blobs
    docs, blobs = v2_encode.encode_outputs(tensors, {"text": True, "image_index": False})
    assert [d["name"] for d in docs] == ["text", "image_index"]
    raw = "héllo".encode()
    assert blobs == [struct.pack("<I", len(raw)) + raw + struct.pack("<I", 1) + b"b"]
    assert docs[0]["parameters"]["binary_data_size"] == len(blobs[0])
    _, blobs = v2_encode.encode_outputs(tensors, {"scores": True})
    assert np.frombuffer(blobs[0], np.float32).tolist() == [0.5, 0.25]
    with pytest.raises(InvalidInput, match="nope"):
        body, head = binary_request([PNGISH], outputs=[{"name": "nope"}])
        decode_v2(body, head)


def test_a_stage_that_ran_in_several_batches_counts_only_its_own_crops() -> None:
    from sokuji.media.model import _describe

    # Finding 6: "batch N from M requests" told a tenant how many others ran beside it.
    assert _describe(["3 crops", "1 crop", "2 crops"]) == "6 crops"
    assert _describe(["6 crops"]) == "6 crops"
    assert _describe(["300 frames", "20 frames"]) == "300 frames"
    assert _describe([]) is None
