# Every target sets itself up on a fresh machine: a .venv with torch (the CPU wheel, unless a CUDA
# build of torch is already importable) and tandem installed editable with its dev extras.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tandem-installed
TORCH_VERSION ?= 2.13.0
ARGS ?=

.PHONY: setup test lint train bench data clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@# A CUDA torch that is already there (a GPU image) is kept; pip must never pull a CUDA build here.
	$(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null \
		|| $(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/ruff format --check src tests benchmarks scripts

train: $(STAMP)
	$(VENV)/bin/tandem train $(ARGS)

bench: $(STAMP)
	$(VENV)/bin/tandem bench $(ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
