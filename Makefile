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

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# NOTE: torch first, pinned to the CPU build, so nothing below can pull a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
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
