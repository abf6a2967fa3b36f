PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUNTIME_STAMP := $(VENV)/.installed-runtime

CHROMIUM ?= /usr/bin/chromium
# Two pytest workers, a test file each at a time (module fixtures are built once); the ten
# slowest tests are printed after the run (benchmarks/README.md: the suite's time budget).
PYTEST_WORKERS ?= -n 2 --dist loadfile

.PHONY: test lint typecheck pytest demo bench chromium clean

# Each set-up step runs once: a second `make test` finds its stamp (or Chromium, or the built
# DeepSpeed op) and says nothing; the first says what it installs.
$(BIN)/python:
	@echo "creating the virtual environment $(VENV) and upgrading its pip"
	@$(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	@echo "installing trainguard (editable) with its dev extras into $(VENV): torch (CPU, pinned by"
	@echo "constraints.txt), ruff, mypy, pytest with xdist, hypothesis, DeepSpeed, transformers,"
	@echo "lightning, wandb, tensorboard, plotly, playwright (pyproject.toml [dev])"
	@$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

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

# DeepSpeed's op builds (once) on the second core while ruff and mypy check on the first; its
# lines come after theirs, and either failing stops the run before pytest.
test: $(STAMP) chromium
	@$(BIN)/python tests/prepare_deepspeed.py > $(VENV)/prepare.log 2>&1 & prepare=$$!; \
	$(BIN)/ruff check src tests benchmarks && \
	$(BIN)/ruff format --check src tests benchmarks && \
	$(BIN)/mypy; checked=$$?; \
	wait $$prepare; prepared=$$?; cat $(VENV)/prepare.log; \
	test $$checked = 0 && test $$prepared = 0
	$(BIN)/pytest $(PYTEST_WORKERS) --durations=10

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
