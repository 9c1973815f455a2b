# Two entry points: `make serve` (the main job) and `make test` (the test suite).
# Both create .venv and install everything from this repo's own files on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ktserve-installed
SOURCES := pyproject.toml setup.py $(wildcard proto/ktserve/v1/*.proto ktshm/*.pyx ktshm/*.pxd \
	ktshm/*.h expert_service/kernels/*.cpp expert_service/kernels/*.h expert_service/kernels/*.pyx)

.PHONY: install serve test lint bench clean

install: $(STAMP)

# torch goes in first, on its own, so that nothing installed after it can swap it for another build.
#   TORCH=cpu   (default) torch 2.13.0. Where the default package index serves CUDA builds (pip's
#               default on Linux), add TORCH_INDEX_URL=<a CPU-only wheel index> for the small build.
#   TORCH=cuda  any torch >= 2.4, < 2.14 the index has (CUDA builds on Linux from pip's default).
TORCH ?= cpu
TORCH_INDEX_URL ?=
TORCH_SPEC_cpu := torch==2.13.0
TORCH_SPEC_cuda := torch>=2.4,<2.14
TORCH_SPEC = $(or $(TORCH_SPEC_$(TORCH)),$(error TORCH must be cpu or cuda, got '$(TORCH)'))

$(STAMP): $(SOURCES)
	@echo "ktserve: setting up $(VENV)/ (first run, or after a source change; a few minutes)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@echo "ktserve: installing torch ($(TORCH): $(TORCH_SPEC))"
	$(PY) -m pip install --progress-bar on '$(TORCH_SPEC)' \
		$(if $(TORCH_INDEX_URL),--index-url '$(TORCH_INDEX_URL)')
	@echo "ktserve: building ktserve (C++ kernels, Cython, gRPC stubs) and installing its packages"
	$(PY) -m pip install --progress-bar on -e '.[test]'
	touch $@

# The OpenAI-compatible server on the embedded demo model (MODEL=dir to serve another; ARGS for
# more flags, see `.venv/bin/ktserve serve --help`). Without a GPU, the GPU part runs on the CPU.
MODEL ?=
ARGS ?=
serve: install
	$(VENV)/bin/ktserve serve $(MODEL) $(ARGS)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: install
	$(PY) bench/bench_ktshm.py
	$(PY) bench/bench_moe_kernel.py
	$(PY) bench/bench_quality.py

clean:
	rm -rf build *.egg-info $(VENV)
	find . -name '*.so' -not -path './$(VENV)/*' -delete
