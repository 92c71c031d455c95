#!/usr/bin/env bash
# Build llama.cpp's own C++ `llama-server` and `llama-batched-bench`, the peers of
# benchmarks/llm_serving.py and benchmarks/llm_batched_bench.py, from the SAME llama.cpp
# sources Sokuji runs: the sdist of the llama-cpp-python installed in the project venv
# (its vendor/llama.cpp), built portable (-DGGML_NATIVE=OFF, as Sokuji's wheel is), Release,
# no network features (no curl, no OpenSSL, no web UI download).
#
#   benchmarks/build_llama_server.sh          (4-13 min on 2 cores; idempotent: a second run
#                                              only checks the binaries)
#
# Environment:
#   SOKUJI_TOOLS_DIR   where to build (default: <repo>/.cache/tools, git-ignored)
#   PYTHON             the project's python (default: <repo>/.venv/bin/python)
#   LLAMA_CPP_PYTHON_VERSION   default: the version installed in that python
#   JOBS               parallel compile jobs (default: nproc)
#
# Result: $SOKUJI_TOOLS_DIR/llama-cpp-<version>/build/bin/{llama-server,llama-batched-bench}
# with their .so files beside them. Needs cmake, a C++17 compiler and pip's access to PyPI
# (the sdist; pip's cache serves a second download).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS_DIR="${SOKUJI_TOOLS_DIR:-$ROOT/.cache/tools}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
JOBS="${JOBS:-$(nproc)}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-$("$PYTHON" -c \
  'import importlib.metadata as m; print(m.version("llama-cpp-python"))')}"
TARGETS=(llama-server llama-batched-bench)

HOME_DIR="$TOOLS_DIR/llama-cpp-$VERSION"
SRC_DIR="$HOME_DIR/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD_DIR="$HOME_DIR/build"
BIN_DIR="$BUILD_DIR/bin"

say() { printf '[build_llama_server %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

all_built() {
  for t in "${TARGETS[@]}"; do [[ -x "$BIN_DIR/$t" ]] || return 1; done
}

if all_built && "$BIN_DIR/llama-server" --version >/dev/null 2>&1; then
  say "already built: $BIN_DIR (llama-cpp-python $VERSION)"
  "$BIN_DIR/llama-server" --version 2>&1 | sed 's/^/  /'
  exit 0
fi

command -v cmake >/dev/null || { say "cmake is needed (apt-get install cmake)"; exit 1; }
mkdir -p "$HOME_DIR/src"
if [[ ! -f "$SRC_DIR/CMakeLists.txt" ]]; then
  say "downloading the llama-cpp-python==$VERSION sdist (the sources Sokuji's wheel is built from)"
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$HOME_DIR/src"
  say "unpacking"
  tar -xzf "$HOME_DIR/src/llama_cpp_python-$VERSION.tar.gz" -C "$HOME_DIR/src"
fi
[[ -f "$SRC_DIR/CMakeLists.txt" ]] || { say "no vendor/llama.cpp in the sdist: $SRC_DIR"; exit 1; }

# llama-server is under tools/server (LLAMA_BUILD_SERVER), llama-batched-bench under
# tools/batched-bench (LLAMA_BUILD_TOOLS); examples and tests are not needed.
say "configuring in $BUILD_DIR"
cmake -S "$SRC_DIR" -B "$BUILD_DIR" \
  -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF \
  -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  >"$HOME_DIR/cmake-configure.log" 2>&1 \
  || { tail -30 "$HOME_DIR/cmake-configure.log"; exit 1; }

for t in "${TARGETS[@]}"; do
  say "building $t with $JOBS jobs (log: $HOME_DIR/build-$t.log)"
  start=$SECONDS
  # progress: cmake's [ NN%] lines, one every few files
  set +o pipefail
  cmake --build "$BUILD_DIR" --target "$t" -j "$JOBS" 2>&1 | tee "$HOME_DIR/build-$t.log" \
    | grep --line-buffered -E '^\[ *[0-9]+%\]' | awk 'NR % 10 == 1 { print "  " $0; fflush() }'
  rc=${PIPESTATUS[0]}
  set -o pipefail
  [[ $rc -eq 0 ]] || { tail -30 "$HOME_DIR/build-$t.log"; exit 1; }
  say "$t built in $((SECONDS - start)) s"
done

all_built || { say "missing binaries in $BIN_DIR"; exit 1; }
"$BIN_DIR/llama-server" --version 2>&1 | sed 's/^/  /'
say "done: $BIN_DIR/llama-server and $BIN_DIR/llama-batched-bench"
