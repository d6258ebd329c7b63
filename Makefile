# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create (or reuse) the project's virtual environment in .venv first.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
UNAME := $(shell uname -s)
# Reinstall when the dependency list changes.
STAMP := $(VENV)/.edge0-installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: venv demo lint test browser clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(UNAME),Linux)
	@# CPU torch first (served from local disk) so opencompass does not pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
endif
	$(PY) -m pip install -q -e '.[eval,serve,test]'
	@rm -f $(VENV)/.edge0-installed-*
	@touch $@

demo: $(STAMP)
	$(VENV)/bin/edge0-eval demo

# mlx-lm's style (black, via ruff): the tree is kept formatted and lint-clean.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two workers (pytest-xdist), one per core here, each file on one worker; tests/conftest.py
# orders the files and makes the shared tiny models and OpenCompass run once for both.
# WORKERS=0 runs in this process.
WORKERS ?= 2
test: lint browser
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)

# The report page's test reads report.html in headless Chromium (Debian's `chromium`);
# installed once when missing (as root, or with sudo), nothing to do when present. Where it
# cannot be installed the suite still runs, and that test fails saying how to install it.
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium >/dev/null; } || \
	  echo "make browser: could not install chromium; the report page's browser test will fail"

clean:
	rm -rf $(VENV) .pytest_cache
