# UltraQuant: every target sets up what it needs on a fresh machine.
#   make test                 venv + dev install (CPU torch), ruff, pytest
#   make kernels ARCH=gfx942  AOT blobs into generated/<arch>/ (see codegen/)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU build of torch lies on the CI machines' disk; the unpinned name would pull a CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: test lint env clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	touch $@

env: $(VENV)/.installed

lint: env
	$(VENV)/bin/ruff check .

test: env lint
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build dist *.egg-info
