"""What a V2 infer body is: a V2 request (JSON, or the binary tensor extension), or a plain
upload for a model whose one input takes files (``TensorSpec.media_types``): the file
itself as the body (``Content-Type: image/png``, ``audio/wav``, ...), or
``multipart/form-data`` with one file part (``file``). A plain upload is that input's one
element; its answer is the model's plain JSON (``to_plain``)."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from sokuji.core.model import ModelMetadata
from sokuji.core.tensor import BYTES, InferRequest, Tensor
from sokuji.errors import BadRequest, InvalidInput, UnsupportedMediaType
from sokuji.server import v2
from sokuji.server.http import JSON, Headers

MULTIPART = "multipart/form-data"
V2, RAW, FORM = "v2", "raw", "multipart"


def form(headers: Headers, meta: ModelMetadata) -> str:
    """``v2`` (JSON or the binary extension), ``raw`` (the file is the body) or ``multipart``
    (the file in a form); 415 for anything else."""
    ctype = headers.get("content-type")
    base = (ctype or JSON).split(";", 1)[0].strip().lower()
    if base == JSON or (base == "application/octet-stream"
                        and headers.get(v2.HEADER_LENGTH) is not None):
        return V2
    types = meta.inputs[0].media_types if len(meta.inputs) == 1 else ()
    if base in types:
        return RAW
    if base == MULTIPART and types:
        return FORM
    files = f", the file itself ({', '.join(types)}) or {MULTIPART} with a 'file' part" \
        if types else ""
    raise UnsupportedMediaType(
        f"Content-Type {ctype!r} is not supported; send a V2 request (application/json, or "
        f"application/octet-stream with Inference-Header-Content-Length){files}")


def request(meta: ModelMetadata, data: bytes, headers: Headers) -> InferRequest:
    """A plain upload as the V2 request it stands for: the file, the model's one input."""
    name = meta.inputs[0].name
    files = [data] if data else []
    return InferRequest({name: Tensor(name, BYTES, (len(files),), files, binary=True)},
                        headers.get("x-request-id", ""))


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
        parsed = await parser.parse()
    except MultiPartException as exc:
        raise BadRequest(f"malformed multipart/form-data: {exc.message}") from None
    try:
        files = [v for _, v in parsed.multi_items() if isinstance(v, UploadFile)]
        if not files:
            raise InvalidInput("multipart/form-data has no file part; send the file as "
                               "'file'", param="file")
        chosen = next((v for k, v in parsed.multi_items() if k == "file"
                       and isinstance(v, UploadFile)), files[0])
        return await chosen.read(limit + 1)
    finally:
        await parsed.close()
