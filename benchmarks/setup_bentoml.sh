#!/usr/bin/env bash
# BentoML for benchmarks/python_serving.py, in a side venv of its own: it is not one of
# Sokuji's dependencies and must not change the project's venv.
#
#   benchmarks/setup_bentoml.sh [VENV]      (default .cache/bench-venvs/bentoml; ~1 minute)
#
# numpy and scikit-learn at the versions the project's venv has, so that every contender
# runs the identical model code on the identical libraries. Exits 0 when the venv is ready
# (already, or now); prints why not and exits 1 otherwise.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.cache/bench-venvs/bentoml}"
BENTOML_VERSION="${BENTOML_VERSION:-1.4.40}"
MAIN_PY="${MAIN_PY:-$ROOT/.venv/bin/python}"
[ -x "$MAIN_PY" ] || MAIN_PY="$(command -v python3.11 || command -v python3)"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import bentoml, sklearn, numpy" 2>/dev/null; then
    echo "bentoml venv ready: $VENV ($("$VENV/bin/python" -c 'import bentoml; print(bentoml.__version__)'))"
    exit 0
fi
versions="$("$MAIN_PY" -c 'import numpy, sklearn; print(numpy.__version__, sklearn.__version__)' 2>/dev/null || true)"
pins=(numpy scikit-learn)
if [ -n "$versions" ]; then
    read -r np_v sk_v <<<"$versions"
    pins=("numpy==$np_v" "scikit-learn==$sk_v")
fi
BASE_PY="$(command -v python3.11 || command -v python3)"
mkdir -p "$(dirname "$VENV")"
"$BASE_PY" -m venv "$VENV"
if ! "$VENV/bin/python" -m pip install -q "bentoml==$BENTOML_VERSION" "${pins[@]}"; then
    echo "bentoml venv: pip install bentoml==$BENTOML_VERSION ${pins[*]} failed" >&2
    exit 1
fi
"$VENV/bin/python" -c "import bentoml, sklearn, numpy; print('bentoml venv ready:', '$VENV', bentoml.__version__, 'numpy', numpy.__version__, 'scikit-learn', sklearn.__version__)"
