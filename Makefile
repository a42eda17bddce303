# Both targets create and use .venv at the repository root.
# torch==2.13.0 is pinned first: on the project's machines pip takes a local CPU build for it,
# where a looser spec would download a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

.PHONY: install demo test bench
install: $(BIN)/.installed

demo: install
	$(BIN)/python examples/demo.py

test: install
	$(BIN)/python -m pytest -n 2 tests

bench: install
	$(BIN)/python benchmarks/bench_split.py
	$(BIN)/python benchmarks/bench_mlx.py
	$(BIN)/python benchmarks/bench_native.py
	$(BIN)/python benchmarks/bench_verify.py
	$(BIN)/python benchmarks/bench_kernels.py
