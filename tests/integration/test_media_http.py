"""Images and audio over HTTP, against a real ``sokuji serve``: every way to send a file
(V2 JSON with base64, tritonclient's binary tensor extension, the file as the body, a
multipart upload) gives the same answer, the stages are timed, and every bad file or
request is a 4xx that names the problem — decided before anything is decoded."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import struct
import wave
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

DATA = Path(__file__).resolve().parent.parent / "data" / "media"
IMAGE = (DATA / "images" / "lines3.png").read_bytes()
SMALL = (DATA / "images" / "tiny_la.png").read_bytes()
CONFIG = """
builtin_pipelines = false
max_request_bytes = 65536
[[models]]
name = "ocr"
runtime = "ocr"
max_batch_size = 4
max_request_bytes = 4194304
[[models]]
name = "ocr_tight"
runtime = "ocr"
max_batch_size = 4
max_request_bytes = 4194304
warmup = false
options = { max_crops = 4 }
[[models]]
name = "vad"
runtime = "vad"
max_batch_size = 4
max_request_bytes = 8388608
options = { max_audio_s = 60 }
"""


def audio_fixture() -> bytes:
    return (DATA / "audio" / "talk16k.wav").read_bytes()


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with sokuji_server(CONFIG) as base:
        yield base


def b64_body(name: str, files: list[bytes], **extra: Any) -> dict[str, Any]:
    return {"inputs": [{"name": name, "datatype": "BYTES", "shape": [len(files)],
                        "parameters": {"content_type": "base64"},
                        "data": [base64.b64encode(f).decode() for f in files]}], **extra}


def stages(response: requests.Response) -> dict[str, str]:
    out = {}
    for part in response.headers["server-timing"].split(","):
        name, _, rest = part.strip().partition(";")
        out[name] = rest
    return out


def lines_of(v2: dict[str, Any]) -> list[str]:
    return next(o["data"] for o in v2["outputs"] if o["name"] == "text")


# --- the ways to send a file give one answer -------------------------------------------


def test_ocr_raw_upload_v2_base64_and_multipart_agree(url: str) -> None:
    raw = requests.post(f"{url}/v2/models/ocr/infer", data=IMAGE,
                        headers={"Content-Type": "image/png"}, timeout=60)
    assert raw.status_code == 200, raw.text
    lines = raw.json()["lines"]
    assert lines and all({"text", "score", "box"} <= set(line) for line in lines)
    assert raw.json()["model_name"] == "ocr"
    v2 = requests.post(f"{url}/v2/models/ocr/infer", json=b64_body("image", [IMAGE]),
                       timeout=60)
    assert v2.status_code == 200, v2.text
    assert lines_of(v2.json()) == [line["text"] for line in lines]
    boxes = next(o for o in v2.json()["outputs"] if o["name"] == "boxes")
    assert boxes["shape"] == [len(lines), 4, 2]
    form = requests.post(f"{url}/v2/models/ocr/infer", files={"file": ("x.png", IMAGE)},
                         timeout=60)
    assert form.status_code == 200, form.text
    assert form.json()["lines"] == lines


def test_ocr_through_tritonclient_binary_in_and_out(url: str) -> None:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url.removeprefix("http://"))
    meta = client.get_model_metadata("ocr")
    assert meta["inputs"][0] == {"name": "image", "datatype": "BYTES", "shape": [-1]}
    inp = httpclient.InferInput("image", [2], "BYTES")
    inp.set_data_from_numpy(np.array([IMAGE, SMALL], dtype=np.object_), binary_data=True)
    outs = [httpclient.InferRequestedOutput(n, binary_data=True)
            for n in ("text", "scores", "image_index", "boxes")]
    result = client.infer("ocr", [inp], outputs=outs)
    texts = [t.decode() for t in result.as_numpy("text")]
    index = result.as_numpy("image_index")
    assert result.as_numpy("boxes").shape == (len(texts), 4, 2)
    assert result.as_numpy("scores").dtype == np.float32
    one = requests.post(f"{url}/v2/models/ocr/infer", data=IMAGE,
                        headers={"Content-Type": "image/png"}, timeout=60).json()
    assert [t for t, i in zip(texts, index, strict=True) if i == 0] == \
        [line["text"] for line in one["lines"]]
    assert set(index.tolist()) <= {0, 1}


def test_ocr_server_timing_names_every_stage(url: str) -> None:
    r = requests.post(f"{url}/v2/models/ocr/infer", data=IMAGE,
                      headers={"Content-Type": "image/png", "Cache-Control": "no-cache"},
                      timeout=60)
    assert r.status_code == 200
    got = stages(r)
    for name in ("decode", "preprocess", "queue", "infer", "encode", "total",
                 "image-decode", "resize", "det", "cls", "rec"):
        assert name in got, (name, r.headers["server-timing"])
    # The request's own crops (lines3.png: 3 lines), never the batch's other requests
    # (issue 25: "batch N from M requests" told a tenant how many others ran beside it).
    assert got["rec"].endswith('desc="3 crops"'), got["rec"]
    assert "request" not in r.headers["server-timing"]
    assert "batch" not in got["cls"] and "batch" not in got["rec"]


def test_repeated_image_is_a_cache_hit(url: str) -> None:
    first = requests.post(f"{url}/v2/models/ocr/infer", data=SMALL,
                          headers={"Content-Type": "image/png"}, timeout=60)
    again = requests.post(f"{url}/v2/models/ocr/infer", data=SMALL,
                          headers={"Content-Type": "image/png"}, timeout=60)
    assert again.json() == first.json()
    assert 'desc="hit"' in stages(again)["cache"]
    assert "det" not in stages(again)


def test_concurrent_requests_all_answer_alike(url: str) -> None:
    def one(_: int) -> list[str]:
        r = requests.post(f"{url}/v2/models/ocr/infer", data=IMAGE, timeout=120,
                          headers={"Content-Type": "image/png", "Cache-Control": "no-cache"})
        assert r.status_code == 200, r.text
        return [line["text"] for line in r.json()["lines"]]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(one, range(4)))
    assert all(a == answers[0] for a in answers)


def test_metrics_have_the_media_stages(url: str) -> None:
    r = requests.post(f"{url}/v2/models/ocr/infer", data=SMALL, timeout=60,
                      headers={"Content-Type": "image/png", "Cache-Control": "no-cache"})
    assert r.status_code == 200
    text = requests.get(f"{url}/metrics", timeout=10).text
    assert 'sokuji_media_stage_duration_seconds_count{model="ocr",stage="det"}' in text
    assert 'sokuji_media_batch_requests_count{model="ocr",stage="rec"}' in text
    stats = requests.get(f"{url}/v2/models/ocr/stats", timeout=10).json()["model_stats"][0]
    assert stats["inference_count"] >= stats["execution_count"] > 0  # files, requests
    assert stats["inference_stats"]["compute_infer"]["ns"] > 0


# --- VAD ------------------------------------------------------------------------------


def test_vad_raw_and_v2_agree(url: str) -> None:
    wav = audio_fixture()
    raw = requests.post(f"{url}/v2/models/vad/infer", data=wav,
                        headers={"Content-Type": "audio/wav"}, timeout=60)
    assert raw.status_code == 200, raw.text
    segments = raw.json()["segments"]
    assert segments and all(0 <= s["start"] < s["end"] for s in segments)
    v2 = requests.post(f"{url}/v2/models/vad/infer", json=b64_body("audio", [wav]), timeout=60)
    assert v2.status_code == 200, v2.text
    out = {o["name"]: o for o in v2.json()["outputs"]}
    assert out["segments_samples"]["shape"] == [len(segments), 2]
    assert out["segments_samples"]["data"] == [
        v for s in segments for v in (s["start_sample"], s["end_sample"])]
    got = stages(v2)
    for name in ("audio-decode", "resample", "infer", "queue", "total"):
        assert name in got, (name, v2.headers["server-timing"])


def test_two_tenants_sending_the_same_audio_never_share_a_cached_answer() -> None:
    """Kills the mutant: keying the response cache of media models as one tenant for
    everyone (``server/inference.py`` ``_cached``: ``cache_key("", ...)`` for kind ``vad``
    or ``ocr``). With API keys, tenant ``bolt``'s first request of the audio ``acme`` sent
    is a miss (the cache stage's marker) and computed for it: the same segments, its own."""
    from sokuji import config as cfg
    from tests.conftest import CACHE_DIR, client_for

    keys = (cfg.ApiKey(key="key-of-acme-0001", tenant="acme"),
            cfg.ApiKey(key="key-of-bolt-0002", tenant="bolt"))
    config = cfg.validate(cfg.ServerConfig(
        models=(cfg.ModelConfig(name="vad", runtime="vad", max_request_bytes=8 << 20),),
        builtin_pipelines=False, api_keys=keys, cache_dir=str(CACHE_DIR)))
    wav = audio_fixture()
    with client_for(config) as client:
        def send(key: str) -> tuple[Any, str]:
            r = client.post("/v2/models/vad/infer", content=wav, headers={
                "Content-Type": "audio/wav", "Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            return r.json()["segments"], stages(r)["cache"]

        own, marker = send(keys[0].key)
        assert 'desc="miss"' in marker
        again, marker = send(keys[0].key)
        assert own and again == own and 'desc="hit"' in marker  # the cache is on
        theirs, marker = send(keys[1].key)
        assert 'desc="miss"' in marker, marker  # computed for bolt, not read from acme's
        assert theirs == own
        assert 'desc="hit"' in send(keys[1].key)[1]  # bolt's own entry from now on


# --- bad requests: a 4xx naming the problem --------------------------------------------


def png_header(width: int, height: int) -> bytes:
    """A PNG signature and IHDR claiming ``width`` x ``height``, then an empty IDAT."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + \
        chunk(b"IEND", b"")


def wav_bytes(rate: int, seconds: float, declared_frames: int | None = None) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x00\x00" * int(rate * seconds))
    data = buf.getvalue()
    if declared_frames is not None:  # a header that lies about its data chunk
        data = data[:40] + struct.pack("<I", declared_frames * 2) + data[44:]
    return data


def wav_rate(rate: int) -> bytes:
    """A 16-bit mono WAV whose header says ``rate`` (0 was a 500 ZeroDivisionError)."""
    body = b"\0" * 320
    fmt = struct.pack("<HHIIHH", 1, 1, rate, (rate * 2) & 0xFFFFFFFF, 2, 16)
    return (b"RIFF" + struct.pack("<I", 36 + len(body)) + b"WAVE" + b"fmt " +
            struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", len(body)) + body)


def white_png(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (width, height), 255).save(buf, "PNG")
    return buf.getvalue()


def thin_png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (5000, 1), 255).save(buf, "PNG")  # rapidocr cannot resize it (0 px)
    return buf.getvalue()


BAD: list[tuple[str, str, Any, dict[str, str], int, str]] = [
    ("ocr", "gif", b"GIF89a\x01\x00\x01\x00\x00\x00\x00;", {"Content-Type": "image/png"},
     415, "PNG, JPEG or WebP"),
    ("ocr", "garbage", b"not an image at all", {"Content-Type": "application/octet-stream"},
     415, "image"),
    ("ocr", "empty", b"", {"Content-Type": "image/png"}, 400, "empty"),
    ("ocr", "truncated", IMAGE[: len(IMAGE) // 2], {"Content-Type": "image/png"}, 400,
     "truncated"),
    ("ocr", "pixels", png_header(100_000, 100_000), {"Content-Type": "image/png"}, 413,
     "100000"),
    ("ocr", "too thin", thin_png(), {"Content-Type": "image/png"}, 400, "too thin"),
    ("ocr", "text/plain", IMAGE, {"Content-Type": "text/plain"}, 415, "Content-Type"),
    ("ocr", "too big", b"\0" * 5_000_000, {"Content-Type": "image/png"}, 413, "limit"),
    ("vad", "png as audio", IMAGE, {"Content-Type": "audio/wav"}, 415, "WAV or FLAC"),
    ("vad", "too long", wav_bytes(8000, 61), {"Content-Type": "audio/wav"}, 413, "60"),
    ("vad", "rate", wav_bytes(4000, 1), {"Content-Type": "audio/wav"}, 400, "4000"),
    ("vad", "truncated wav", wav_bytes(16000, 1, declared_frames=32000),
     {"Content-Type": "audio/wav"}, 400, "truncated"),
    ("vad", "rate 0", wav_rate(0), {"Content-Type": "audio/wav"}, 400, "sample rate 0 Hz"),
    ("vad", "rate 4e9", wav_rate(4_000_000_000), {"Content-Type": "audio/wav"}, 400,
     "4000000000 Hz"),
]


@pytest.mark.parametrize(("model", "what", "body", "headers", "status", "words"), BAD,
                         ids=[f"{b[0]}-{b[1]}" for b in BAD])
def test_bad_files_are_refused_with_a_reason(url: str, model: str, what: str, body: bytes,
                                             headers: dict[str, str], status: int,
                                             words: str) -> None:
    r = requests.post(f"{url}/v2/models/{model}/infer", data=body, headers=headers,
                      timeout=60)
    assert r.status_code == status, (what, r.status_code, r.text)
    assert words.lower() in r.json()["error"].lower(), r.text


@pytest.mark.parametrize(("width", "height"), [(2000, 1), (300, 1), (100, 1), (1, 300)])
def test_a_strip_is_refused_before_its_upscale_and_the_server_lives(url: str, width: int,
                                                                    height: int) -> None:
    """Issue 25 finding 1: a white 2000 x 1 PNG of ~80 bytes grew the server to 23.7 GB
    (rapidocr's short-side upscale and letterbox: a 15000 x 60000 det input) and the OOM
    killer ended it; a 300 x 1 took 1.4 GB and 2 s. Now: 413 from the header, at once."""
    strip = white_png(width, height)
    assert len(strip) < 200
    r = requests.post(f"{url}/v2/models/ocr/infer", data=strip,
                      headers={"Content-Type": "image/png"}, timeout=60)
    assert r.status_code == 413, r.text
    assert r.json()["error"].endswith("options.max_aspect_ratio = 64"), r.text
    ok = requests.post(f"{url}/v2/models/ocr/infer", data=IMAGE,
                       headers={"Content-Type": "image/png", "Cache-Control": "no-cache"},
                       timeout=60)
    assert ok.status_code == 200 and len(ok.json()["lines"]) == 3, ok.text


def test_a_requests_crops_are_bounded_over_its_files(url: str) -> None:
    """Finding 4: 8 images x 1000 boxes = 8000 crops on the one rec thread. The crops of
    one request are summed over its files and refused past ``max_crops`` before rec."""
    one = requests.post(f"{url}/v2/models/ocr_tight/infer", data=IMAGE,
                        headers={"Content-Type": "image/png"}, timeout=60)
    assert one.status_code == 200 and len(one.json()["lines"]) == 3, one.text
    two = requests.post(f"{url}/v2/models/ocr_tight/infer",
                        json=b64_body("image", [IMAGE, IMAGE]), timeout=60)
    assert two.status_code == 413, two.text
    assert "needs 6 crops" in two.json()["error"]
    assert "options.max_crops = 4" in two.json()["error"]


def test_the_media_models_state_their_limits(url: str) -> None:
    ocr = requests.get(f"{url}/v2/models/ocr/config", timeout=10).json()["parameters"]
    assert ocr["limit.options.max_det_pixels"]["string_value"].startswith("4.5e+06 pixels")
    for key in ("max_batch_size", "options.max_pixels", "options.max_side",
                "options.max_aspect_ratio", "options.max_boxes", "options.max_crops",
                "options.max_rec_width"):
        assert f"limit.{key}" in ocr, key
    vad = requests.get(f"{url}/v2/models/vad/config", timeout=10).json()["parameters"]
    assert vad["limit.options.max_audio_s"]["string_value"].startswith("60 seconds")
    assert vad["limit.samples_16k"]["string_value"].startswith("960001 samples")
    for key in ("options.max_rate_hz", "options.max_channels", "source_bytes"):
        assert f"limit.{key}" in vad, key


def test_a_decompression_bomb_is_refused_before_decoding(url: str) -> None:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (8000, 8000)).save(buf, "PNG")  # ~62 KB on the wire, 64 Mpx inside
    bomb = buf.getvalue()
    assert len(bomb) < 100_000
    r = requests.post(f"{url}/v2/models/ocr/infer", json=b64_body("image", [bomb]),
                      timeout=60)
    assert r.status_code == 413, r.text
    assert "8000" in r.json()["error"]


V2_BAD: list[tuple[str, dict[str, Any], str]] = [
    ("bad base64", {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                                "data": ["%%% not base64 %%%"]}]}, "base64"),
    ("other content type", {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                                        "parameters": {"content_type": "str"},
                                        "data": ["abc"]}]}, "content_type"),
    ("wrong name", {"inputs": [{"name": "audio", "datatype": "BYTES", "shape": [1],
                                "data": [""]}]}, "image"),
    ("wrong datatype", {"inputs": [{"name": "image", "datatype": "FP32", "shape": [1],
                                    "data": [1.0]}]}, "BYTES"),
    ("shape", {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [3],
                           "data": [base64.b64encode(SMALL).decode()]}]}, "shape"),
    ("too many files", b64_body("image", [SMALL] * 5), "at most 4"),
    ("unknown output", b64_body("image", [SMALL], outputs=[{"name": "nope"}]), "nope"),
    ("bad parameter", b64_body("image", [SMALL], parameters={"text_score": "high"}),
     "text_score"),
]


@pytest.mark.parametrize(("what", "body", "words"), V2_BAD, ids=[b[0] for b in V2_BAD])
def test_bad_v2_requests_name_the_problem(url: str, what: str, body: dict[str, Any],
                                          words: str) -> None:
    r = requests.post(f"{url}/v2/models/ocr/infer", json=body, timeout=60)
    assert r.status_code == 400, (what, r.text)
    assert words.lower() in r.json()["error"].lower(), r.text


def test_a_multipart_without_a_file_is_refused(url: str) -> None:
    r = requests.post(f"{url}/v2/models/ocr/infer", files={"note": (None, "no file")},
                      timeout=60)
    assert r.status_code == 400, r.text
    r = requests.post(f"{url}/v2/models/ocr/infer", data={"note": "hello"}, timeout=60,
                      headers={"Content-Type": "multipart/form-data; boundary=xyz"})
    assert r.status_code == 400, r.text


def test_a_media_model_refuses_the_text_endpoints(url: str) -> None:
    r = requests.post(f"{url}/v1/embeddings", json={"model": "ocr", "input": "x"}, timeout=10)
    assert r.status_code == 400 and "does not serve /v1/embeddings" in \
        r.json()["error"]["message"]


# --- streaming VAD: segments while the audio is still arriving -------------------------


def _chunked_post(url: str, path: str, headers: dict[str, str]) -> Any:
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=60)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nTransfer-Encoding: chunked\r\n"
                 f"{head}\r\n".encode())
    return sock


def _send_chunk(sock: Any, data: bytes) -> None:
    sock.sendall(b"%x\r\n%s\r\n" % (len(data), data))


def test_vad_streams_segments_before_the_audio_ends(url: str) -> None:
    import json

    wav = audio_fixture()
    whole = requests.post(f"{url}/v2/models/vad/infer", data=wav,
                          headers={"Content-Type": "audio/wav"}, timeout=60).json()["segments"]
    assert len(whole) >= 2
    # Send up to 1 s after the first segment's end (its silence is then long enough), in
    # uneven chunks, and wait for that segment's line before sending the rest.
    cut = 44 + int((whole[0]["end"] + 1.0) * 16000) * 2
    sock = _chunked_post(url, "/v2/models/vad/infer?threshold=0.5",
                         {"Content-Type": "audio/wav", "Accept": "application/x-ndjson"})
    reader = sock.makefile("rb")
    try:
        pos, step = 0, 1000
        while pos < cut:
            _send_chunk(sock, wav[pos:min(cut, pos + step)])
            pos, step = min(cut, pos + step), step * 2 + 7
        status = reader.readline()
        assert b" 200 " in status, status
        while reader.readline() not in (b"\r\n", b""):
            pass  # headers
        size = int(reader.readline(), 16)  # the first chunk of the body: a segment's line
        first = json.loads(reader.read(size))
        reader.readline()
        assert first == whole[0]  # arrived while 2/3 of the audio was still unsent
        _send_chunk(sock, wav[cut:])
        sock.sendall(b"0\r\n\r\n")
        rest = b""
        while True:
            size = int(reader.readline(), 16)
            if size == 0:
                break
            rest += reader.read(size)
            reader.readline()
        lines = [json.loads(line) for line in rest.decode().splitlines()]
    finally:
        reader.close()
        sock.close()
    assert lines[-1]["done"] is True and lines[-1]["segments"] == len(whole)
    assert [first, *lines[:-1]] == whole


def test_vad_stream_refuses_a_bad_header_with_a_status(url: str) -> None:
    r = requests.post(f"{url}/v2/models/vad/infer", data=iter([IMAGE[:100], IMAGE[100:]]),
                      headers={"Content-Type": "audio/wav", "Accept": "application/x-ndjson"},
                      timeout=60)
    assert r.status_code == 415, r.text
    r = requests.post(f"{url}/v2/models/vad/infer?threshold=2", data=iter([audio_fixture()]),
                      headers={"Content-Type": "audio/wav", "Accept": "application/x-ndjson"},
                      timeout=60)
    assert r.status_code == 400 and "threshold" in r.json()["error"], r.text
    r = requests.post(f"{url}/v2/models/vad/infer", data=b"fLaC....",
                      headers={"Content-Type": "audio/flac", "Accept": "application/x-ndjson"},
                      timeout=60)
    assert r.status_code == 415 and "FLAC" in r.json()["error"], r.text


def test_an_image_can_be_an_async_job(url: str) -> None:
    import time

    big = IMAGE + b"\0" * 70_000  # over the server's 64 KiB, under the model's own limit
    r = requests.post(f"{url}/v2/models/ocr/infer", data=big, timeout=60,
                      headers={"Content-Type": "image/png", "Prefer": "respond-async"})
    assert r.status_code == 202, r.text
    location = url + r.headers["location"] + "/result"
    deadline = time.monotonic() + 120
    while (res := requests.get(location, timeout=10)).status_code == 202:
        assert time.monotonic() < deadline
        time.sleep(0.2)  # polling the job's state, as a client would
    assert res.status_code == 200, res.text
    direct = requests.post(f"{url}/v2/models/ocr/infer", data=IMAGE, timeout=60,
                           headers={"Content-Type": "image/png"}).json()
    assert res.json()["lines"] == direct["lines"]
