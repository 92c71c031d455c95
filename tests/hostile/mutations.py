"""The hostile matrix's mutations: each turns a kind's declared valid requests into hostile
ones and says what the server must answer. A mutation applies to the kinds whose inputs or
routes it names (``applies``); ``cases`` makes its requests from the declaration.

What every case must get back is checked by the test (``test_matrix.py``): no 5xx, every
4xx with a reason, the status among ``expect``, the reason naming ``names`` (any of them),
and afterwards the kind's normal request still answered."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from tests.hostile import bodies, wire
from tests.hostile.declared import (
    AUDIO,
    IMAGE,
    OPENAI,
    PLAIN,
    STREAM,
    TENSOR,
    TEXT,
    V2_BINARY,
    V2_JSON,
    Declared,
    Request,
    files_v2,
    upload,
)

Send = Callable[[str, dict[str, str]], wire.Answer]
"""(base URL, auth headers) -> the server's answer."""
CLIENT_ERRORS = frozenset(range(400, 500))


@dataclass(frozen=True)
class Case:
    """One hostile request and what must come back."""

    id: str
    send: Send
    expect: frozenset[int] = CLIENT_ERRORS
    """Statuses allowed; None in it: the server may close without answering."""
    names: tuple[str, ...] = ()
    """The reason names one of these (the limit, its key, the field)."""
    or_closed: bool = False
    """The server may also close the connection without answering (the client lied about
    the length and then went away: there is no one to answer)."""


@dataclass(frozen=True)
class Mutation:
    name: str
    applies: Callable[[Declared], bool]
    cases: Callable[[Declared], list[Case]]


def _send(request: Request, body: bytes | None = None, headers: dict[str, str] | None = None,
          content_length: int | None = None, half_close: bool = False) -> Send:
    def go(url: str, auth: dict[str, str]) -> wire.Answer:
        return wire.send(url, request.path, {**(headers or dict(request.headers)), **auth},
                         request.body if body is None else body, content_length,
                         half_close=half_close)
    return go


def _bodied(d: Declared) -> list[Request]:
    """The declared requests with a whole body (a stream's is fed as it goes)."""
    return [r for r in d.requests if r.route != STREAM]


def _oversized(d: Declared) -> list[Case]:
    out = []
    for r in _bodied(d):
        big = r.body + b" " * (d.body_bytes + 1 - len(r.body))
        out.append(Case(r.label, _send(r, big), frozenset({413}), (str(d.body_bytes),)))

        def chunked(url: str, auth: dict[str, str], r: Request = r, big: bytes = big
                    ) -> wire.Answer:
            return wire.chunked(url, r.path, {**r.headers, **auth}, big)
        out.append(Case(f"{r.label}-chunked", chunked, frozenset({413}), (str(d.body_bytes),)))
    return out


def _lying_length(d: Declared) -> list[Case]:
    out = []
    for r in _bodied(d):
        out.append(Case(f"{r.label}-larger", _send(r, content_length=len(r.body) + 100,
                                                   half_close=True), or_closed=True))
        out.append(Case(f"{r.label}-smaller", _send(r, content_length=len(r.body) // 2),
                        frozenset({400}), _CUT[r.route]))
    return out


_CUT = {V2_JSON: ("malformed JSON",), OPENAI: ("malformed JSON",),
        V2_BINARY: ("does not fit", "overruns", "does not match"),
        PLAIN: ("truncated", "corrupt")}
"""What the reason says of a body cut short, by route."""


def _truncated(d: Declared) -> list[Case]:
    return [Case(r.label, _send(r, r.body[:len(r.body) // 2]), frozenset({400}), _CUT[r.route])
            for r in _bodied(d)]


def _wrong_type(d: Declared) -> list[Case]:
    out = []
    for r in _bodied(d):
        wrong = "text/plain" if r.route != PLAIN else "application/x-unknown"
        out.append(Case(r.label, _send(r, headers={**r.headers, "Content-Type": wrong}),
                        frozenset({415}), (f"Content-Type '{wrong}'",)))
    return out


def _first_input(d: Declared) -> tuple[Request, dict[str, object]]:
    r = d.by_route(V2_JSON)
    assert r is not None
    return r, orjson.loads(r.body)["inputs"][0]


SHAPES = {"zero": "[0]", "negative": "[-1]", "huge": "[1099511627776]", "fraction": "[1.5]",
          "nan": "[NaN]", "string": '["1"]', "nested": "[[1]]", "many-dims": "[1,1,1,1,1,1,1,1,1]",
          "too-long": "[100]"}
"""A V2 JSON tensor's ``shape`` as sent (raw JSON: ``NaN`` is not JSON, as a client may
send it anyway)."""


def _shapes(d: Declared) -> list[Case]:
    r, tensor = _first_input(d)
    out = []
    for name, shape in SHAPES.items():
        doc = orjson.dumps({"inputs": [{**tensor, "shape": "__SHAPE__"}]}).decode()
        body = doc.replace('"__SHAPE__"', shape).encode()
        out.append(Case(name, _send(r, body), frozenset({400}), ("shape", "malformed JSON")))
    return out


def _binary_sizes(d: Declared) -> list[Case]:
    r = d.by_route(V2_BINARY)
    assert r is not None
    header_len = int(r.headers["Inference-Header-Content-Length"])
    header = orjson.loads(r.body[:header_len])
    raw = r.body[header_len:]
    out = []
    for name, size in (("zero", 0), ("negative", -1), ("huge", 1 << 40), ("string", "4"),
                       ("short", len(raw) - 1), ("long", len(raw) + 1)):
        tensor = header["inputs"][0]
        body, headers = bodies.v2_binary(tensor["name"], tensor["datatype"], tensor["shape"],
                                         raw, size=size)
        out.append(Case(f"size-{name}", _send(r, body, headers), frozenset({400}),
                        ("binary_data_size", "does not match", "overruns")))
    for name, value in (("negative", "-1"), ("past-body", str(len(r.body) + 10)),
                        ("not-a-number", "x")):
        out.append(Case(f"header-length-{name}", _send(
            r, headers={**r.headers, "Inference-Header-Content-Length": value}),
            frozenset({400}), ("Inference-Header-Content-Length",)))
    return out


def _nan_tensor(d: Declared) -> list[Case]:
    r = d.by_route(V2_BINARY)
    assert r is not None
    header_len = int(r.headers["Inference-Header-Content-Length"])
    tensor = orjson.loads(r.body[:header_len])["inputs"][0]
    out = []
    # A kind whose tensors carry NaN and infinity as values (``non_finite``) answers them
    # in the normal request's shape; the others refuse them, naming them.
    shape = tensor["shape"] if d.non_finite else [4]
    count = math.prod(shape)
    for name, word in (("nan", b"\x00\x00\xc0\x7f"), ("inf", b"\x00\x00\x80\x7f")):
        body, headers = bodies.v2_binary(tensor["name"], tensor["datatype"], shape,
                                         word * count)
        out.append(Case(name, _send(r, body, headers), frozenset({200}), ()) if d.non_finite
                   else Case(name, _send(r, body, headers), frozenset({400}), ("finite",)))
    return out


def _media(d: Declared, files: dict[str, tuple[bytes, frozenset[int], tuple[str, ...]]],
           content_type: str) -> list[Case]:
    name = "image" if IMAGE in d.inputs else "audio"
    out = []
    for fname, (data, expect, names) in files.items():
        out.append(Case(f"{fname}-v2", _send(files_v2(d.model, name, [data])), expect, names))
        out.append(Case(f"{fname}-upload", _send(upload(d.model, data, content_type)),
                        expect, names))
    return out


LIMIT = frozenset({400, 413})
"""A refusal by a limit: 413 (``LimitExceeded``) or 400 naming it."""


IMAGES = {"wide-2000x1": (bodies.png(2000, 1), LIMIT, ("limit",)),
          "tall-1x2000": (bodies.png(1, 2000), LIMIT, ("limit",)),
          "huge-header": (bodies.png(60000, 60000, idat_rows=1), frozenset({413}),
                          ("max_pixels",)),
          "zero-size": (bodies.png(0, 0, idat_rows=0), frozenset({400, 415}),
                        ("image format", "0x0")),
          "truncated": (bodies.png(64, 64)[:60], frozenset({400}), ("truncated",))}
"""Images whose cost a header hides: strips the upscale and padding multiply (finding 1),
a tiny file claiming 3.6 Gpx, no pixels at all, a file cut short."""
WAVS = {"rate-0": (bodies.wav(rate=0), frozenset({400}), ("sample rate",)),
        "rate-huge": (bodies.wav(rate=0xFFFFFFFF), frozenset({400}), ("sample rate",)),
        "rate-negative": (bodies.wav(rate=-8000), frozenset({400}), ("sample rate",)),
        "channels-0": (bodies.wav(channels=0), frozenset({400}), ("channels",)),
        "bits-0": (bodies.wav(bits=0), frozenset({400, 415}), ("0-bit",)),
        "data-claims-4gb": (bodies.wav(data_bytes=0xFFFFFFF0), LIMIT, ("limit",)),
        "truncated": (bodies.wav()[:30], frozenset({400}), ("truncated",))}
"""WAV headers that lie: rates of 0 (finding 6), past every real rate and ``-8000`` as its
unsigned field reads; no channels, no bits; a data chunk claiming 4 GB; a header cut."""


def _separator_ids(d: Declared) -> list[Case]:
    """Ids and user fields carrying tenant-like prefixes, NUL and '/': answered (or refused
    with a reason), never a 5xx, the id never rewritten."""
    out = []
    weird = "t2:victim/\u0000../%2f"
    fresh = {"Cache-Control": "no-cache"}  # to the model, past an answer cached before
    v2 = d.by_route(V2_JSON)
    if v2 is not None:
        doc = orjson.loads(v2.body)
        doc["id"] = weird
        out.append(Case("v2-request-id", _send(v2, orjson.dumps(doc), {**v2.headers, **fresh}),
                        frozenset({200, *CLIENT_ERRORS})))
    openai = d.by_route(OPENAI)
    if openai is not None:
        doc = orjson.loads(openai.body)
        doc["user"] = weird
        out.append(Case("openai-user", _send(openai, orjson.dumps(doc),
                                             {**openai.headers, **fresh}),
                        frozenset({200, *CLIENT_ERRORS})))
    return out


def _has(*routes: str) -> Callable[[Declared], bool]:
    return lambda d: any(d.by_route(r) is not None for r in routes)


def _takes(*kinds: str) -> Callable[[Declared], bool]:
    return lambda d: bool(d.inputs & set(kinds))


MUTATIONS = (
    Mutation("oversized", lambda d: bool(_bodied(d)), _oversized),
    Mutation("lying-length", lambda d: bool(_bodied(d)), _lying_length),
    Mutation("truncated", lambda d: bool(_bodied(d)), _truncated),
    Mutation("wrong-type", lambda d: bool(_bodied(d)), _wrong_type),
    Mutation("v2-shape", lambda d: _has(V2_JSON)(d) and _takes(TEXT, TENSOR)(d), _shapes),
    Mutation("v2-binary", _has(V2_BINARY), _binary_sizes),
    Mutation("nan-tensor", lambda d: _has(V2_BINARY)(d) and _takes(TENSOR)(d), _nan_tensor),
    Mutation("image", _takes(IMAGE), lambda d: _media(d, IMAGES, "image/png")),
    Mutation("wav", _takes(AUDIO), lambda d: _media(d, WAVS, "audio/wav")),
    Mutation("separator-ids", _has(V2_JSON, OPENAI), _separator_ids),
)
"""Every mutation of the matrix."""

DANGEROUS = {"wide-2000x1", "tall-1x2000"}
"""Cases that, without the fix, would take the server down (finding 1: one 80-byte strip
grew it to 23.7 GB): sent only once the model declares its pixel limits."""
