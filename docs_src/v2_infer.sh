#!/usr/bin/env bash
# KServe V2 (Open Inference Protocol) with curl: two texts to the built-in encoder, and where
# the time went (the Server-Timing header, milliseconds per stage).
set -euo pipefail
URL=${SOKUJI_URL:-http://127.0.0.1:8000}

curl -sS -D - -o /tmp/sokuji-embeddings.json "$URL/v2/models/minilm/infer" \
  -H 'content-type: application/json' \
  -d '{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2],
                   "data": ["a latency-first server", "where did the time go?"]}]}' \
  | grep -i '^server-timing'
python3 -c 'import json; out = json.load(open("/tmp/sokuji-embeddings.json"))["outputs"][0];
print(out["name"], out["datatype"], out["shape"])'
