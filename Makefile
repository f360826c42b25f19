# Every target sets itself up on a fresh machine: a .venv with torch (the CPU wheel, unless a CUDA
# build of torch is already importable) and tandem installed editable with its dev extras.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tandem-installed
TORCH_VERSION ?= 2.13.0
ARGS ?=

.PHONY: setup test test-image-triton lint train bench data clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@# A CUDA torch that is already there (a GPU image) is kept; pip must never pull a CUDA build here.
	$(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null \
		|| $(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# The tests run in two parts: most in TEST_WORKERS pytest-xdist workers of one thread each (a test file
# stays in one worker), then those that start groups of processes or bound their time (marked serial,
# tests/conftest.py) alone. Status 5, none of ARGS's tests in a part, is no failure.
TEST_WORKERS ?= 2

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial" $(ARGS) \
		|| test $$? -eq 5
	$(PY) -m pytest -q -m serial $(ARGS) || test $$? -eq 5

# The kernels' tests (those of tests/ops named triton or sm90: the interpreter runs and the sm_90 builds;
# the others do not touch Triton) once more with the Triton of the GPU image (torch 2.11 pins 3.6), in a
# venv of their own, on the CPU (CI): what builds with the newest Triton must build there too. Triton
# 3.6's interpreter needs numpy < 2.3. Not for a GPU machine: pip would fetch a CUDA build of torch.
IMAGE_TRITON ?= 3.6.0
IMAGE_VENV   := .venv-triton-$(IMAGE_TRITON)

test-image-triton:
	test -x $(IMAGE_VENV)/bin/python || $(PYTHON) -m venv $(IMAGE_VENV)
	$(IMAGE_VENV)/bin/python -m pip install -q "torch==$(TORCH_VERSION)" "triton==$(IMAGE_TRITON)" \
		"numpy>=1.24,<2.3" "tqdm>=4.60" "pytest>=8" "pytest-timeout>=2.2" "pytest-xdist>=3.5"
	$(IMAGE_VENV)/bin/python -m pip install -q --no-deps -e .
	OMP_NUM_THREADS=1 $(IMAGE_VENV)/bin/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) \
		--dist loadfile tests/ops -k "triton or sm90" $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/ruff format --check src tests benchmarks scripts

train: $(STAMP)
	$(VENV)/bin/tandem train $(ARGS)

bench: $(STAMP)
	$(VENV)/bin/tandem bench $(ARGS)

clean:
	rm -rf $(VENV) .venv-triton-* build dist src/*.egg-info .pytest_cache .ruff_cache
