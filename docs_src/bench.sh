#!/usr/bin/env bash
# sokuji bench against the running server: 4 closed-loop workers for 3 seconds, a summary
# table (throughput, latency percentiles, the server's stages) and raw JSON.
set -euo pipefail
URL=${SOKUJI_URL:-http://127.0.0.1:8000}

sokuji bench "$URL" --model minilm --concurrency 4 --duration 3 --warmup 0.5s \
  --out /tmp/sokuji-bench.json
