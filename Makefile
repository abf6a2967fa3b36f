PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUNTIME_STAMP := $(VENV)/.installed-runtime

CHROMIUM ?= /usr/bin/chromium

.PHONY: test lint typecheck pytest demo bench chromium clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

# The demo needs only trainguard's runtime dependencies and plotly for its HTML report (the
# `report` extra), not the dev tools; pip's own lines (not --quiet) show the install's progress.
$(RUNTIME_STAMP): $(BIN)/python pyproject.toml constraints.txt
	@echo "installing trainguard, its runtime dependencies and plotly into $(VENV)"
	$(BIN)/python -m pip install -c constraints.txt -e ".[report]"
	touch $(RUNTIME_STAMP)

# The report tests drive Debian's chromium headless; install it where it is missing.
chromium:
	@test -x $(CHROMIUM) || command -v chromium >/dev/null || { \
		echo "installing Debian's chromium for the report tests"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get install -y -q chromium >/dev/null 2>&1 || \
		{ $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q chromium >/dev/null; }; }

test: $(STAMP) chromium
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/python tests/prepare_deepspeed.py
	$(BIN)/pytest

demo: $(RUNTIME_STAMP)
	$(BIN)/trainguard demo

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/recovery.py
	$(BIN)/python benchmarks/diagnosis.py
	$(BIN)/python benchmarks/analyze.py
	$(BIN)/python benchmarks/curves.py
	$(BIN)/python benchmarks/distributed.py
	$(BIN)/python benchmarks/replicas.py
	$(BIN)/python benchmarks/deepspeed_zero.py
	$(BIN)/python benchmarks/alerts.py
	$(BIN)/python benchmarks/detection.py
	$(BIN)/python benchmarks/eval_decline.py
	$(BIN)/python benchmarks/faults.py
	$(BIN)/python benchmarks/trust.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
