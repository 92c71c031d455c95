"""The HTTP floor: the same server stack (uvicorn, uvloop, httptools, Starlette, orjson) with no
model, no batching and no timing. It parses the V2 request and answers a 384-float V2 response,
so ``serving_overhead.py`` can split Sokuji's overhead into HTTP floor + Sokuji's own work."""

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

EMBEDDING = np.linspace(-1, 1, 384, dtype=np.float32)


async def infer(request: Request) -> Response:
    doc = orjson.loads(await request.body())
    n = len(doc["inputs"][0]["data"])
    out = {"model_name": "minilm", "model_version": "1", "outputs": [
        {"name": "embedding", "datatype": "FP32", "shape": [n, 384],
         "data": np.tile(EMBEDDING, n)}]}
    return Response(orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY),
                    headers={"content-type": "application/json"})


async def ready(request: Request) -> Response:
    return Response(status_code=200)


app = Starlette(routes=[Route("/v2/models/minilm/infer", infer, methods=["POST"]),
                        Route("/v2/health/ready", ready)])
