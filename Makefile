# Two commands set everything up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.specpipe-installed

.PHONY: install run test bench clean

install: $(STAMP)

# llama-cpp-python compiles from source (~4 minutes on 2 cores); pip keeps the
# built wheel in its cache, so a repeat install (or a fresh clone on the same
# machine) reuses it and takes seconds. The stamp skips pip entirely when
# pyproject.toml has not changed.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

run: install
	$(BIN)/orchestrate run

test: install
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python -m benchmarks.pipeline_vs_whole

clean:
	rm -rf $(VENV) build *.egg-info
