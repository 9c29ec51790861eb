# tailguard: `make demo` runs it, `make test` checks it. Both install first if needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/tailguard demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy --strict src

unit: $(STAMP)
	$(BIN)/pytest

test: lint typecheck unit

bench: $(STAMP)
	$(BIN)/python benchmarks/sim_speed.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .mypy_cache .ruff_cache .pytest_cache
