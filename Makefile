# Both targets create and use .venv at the repository root.
# torch==2.13.0 is pinned first: on the project's machines pip takes a local CPU build for it,
# where a looser spec would download a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# llama.cpp is a real client of the GGUF tests: llama-cpp-python builds it from its source distribution (about
# 7 CPU-minutes on 2 cores), and that distribution's vendor/llama.cpp also holds llama.cpp's own converter
# (convert_hf_to_gguf.py, the reference for GGUF output) and real vocabularies (models/ggml-vocab-*.gguf), which
# the tests find at $(sys.prefix)/llama.cpp.
LLAMA_CPP := 0.3.36
LLAMA_SRC := $(VENV)/llama.cpp
NPROC := $(shell nproc 2>/dev/null || echo 2)
# Not -march=native: these machines' CPUs report AMX, which the sandbox does not enable, and llama.cpp's native
# build dies of SIGILL on Q8_0 there (measured); x86-64-v3 (AVX2, FMA, F16C) runs every type.
LLAMA_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON

# Three stamps, so that each step reruns only when what it installs changes:
#   base   the venv, torch and what examples/demo.py runs (transformers, MLX, Flax, Triton); pyproject.toml
#   llama  llama.cpp built from llama-cpp-python's sdist, its converter and vocabularies; only LLAMA_CPP (the
#          stamp's name holds the version), never a pyproject.toml edit
#   dev    the dev extra (pytest, compressed-tensors, gguf, ...): after llama, so pip finds llama-cpp-python
#          installed and does not build it again from PyPI without the CMake flags above
# constraints.txt: the versions the suite is proven against, so that a client's new release (PEFT 0.22 changed the
# adapters it writes, and CI's fresh install took it) breaks no run until someone moves to it: make test LOCK= in a
# fresh clone installs the newest, make lock records what is installed.
LOCK ?= constraints.txt
PIP := $(if $(LOCK),PIP_CONSTRAINT=$(abspath $(LOCK))) $(BIN)/pip
BASE := $(BIN)/.base
LLAMA := $(VENV)/.llama-cpp-$(LLAMA_CPP)
DEV := $(BIN)/.dev
# A venv the single-step install this Makefile had before made (its stamp: .installed) holds this llama.cpp build
# already, made with these flags: adopted, not built again
ADOPT := $(and $(wildcard $(BIN)/.installed),$(wildcard $(VENV)/sdist/llama_cpp_python-$(LLAMA_CPP).tar.gz))

$(BASE): pyproject.toml $(LOCK)
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[mlx-cpu,flax,cuda]' 'transformers>=4.45'
	touch $@

$(LLAMA): | $(BASE)
ifeq ($(ADOPT),)
	$(PIP) download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP) -d $(VENV)/sdist
	CMAKE_BUILD_PARALLEL_LEVEL=$(NPROC) CMAKE_ARGS="$(LLAMA_CMAKE)" $(PIP) install -q $(VENV)/sdist/llama_cpp_python-$(LLAMA_CPP).tar.gz
	rm -rf $(LLAMA_SRC) && mkdir -p $(LLAMA_SRC)
	tar xzf $(VENV)/sdist/llama_cpp_python-$(LLAMA_CPP).tar.gz -C $(LLAMA_SRC) --strip-components=3 \
	    --wildcards '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/convert_lora_to_gguf.py' \
	    '*/vendor/llama.cpp/conversion/*' \
	    '*/vendor/llama.cpp/gguf-py/*' '*/vendor/llama.cpp/models/ggml-vocab-*.gguf'
endif
	touch $@

# torchtitan: the anchor of the DCP tests (its state-dict adapters). Its wheel requires a training stack (datasets,
# wandb, tensorboard, torchdata) the adapters never import: installed without those, with what they do import.
TORCHTITAN := torchtitan==0.3.0 spmd_types==0.2.3

$(DEV): $(BASE) $(LLAMA) $(LOCK)
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps $(TORCHTITAN)
	touch $@

.PHONY: install demo test bench lock
install: $(DEV)

demo: $(BASE)
	$(BIN)/python examples/demo.py

# $(BIN)/pytest, not python -m pytest: -m puts the repository root first on sys.path, where the top-level kernels/
# (installed as ffn_tools.kernels) would shadow Hugging Face's `kernels` package, which transformers 5.25 imports.
# Three workers on two cores: a worker waits (for a shared fixture another builds, a child's start, a killed run's
# point) about a tenth of the run, which the third fills (measured 2026-12-08, one tree: 449 s, 485 s with two).
test: $(DEV)
	$(BIN)/pytest -n 3 --dist worksteal --durations=25 tests

lock: $(DEV)
	{ sed -n '1,/^[^#]/p' constraints.txt | grep '^#'; $(BIN)/pip freeze --exclude-editable | grep -v '^#' \
	    | sed -e 's/^torch==\([0-9.]*\)+.*/torch==\1/' -e 's/^\(llama.cpp.python\) @ .*/\1==$(LLAMA_CPP)/'; } > constraints.tmp
	mv constraints.tmp constraints.txt
	touch $(BASE) $(DEV)

bench: $(DEV)
	$(BIN)/python benchmarks/bench_split.py
	$(BIN)/python benchmarks/bench_mlx.py
	$(BIN)/python benchmarks/bench_native.py
	$(BIN)/python benchmarks/bench_verify.py
	$(BIN)/python benchmarks/bench_kernels.py
