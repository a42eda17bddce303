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

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP) -d $(VENV)/sdist
	CMAKE_BUILD_PARALLEL_LEVEL=$(NPROC) CMAKE_ARGS="$(LLAMA_CMAKE)" $(BIN)/pip install -q $(VENV)/sdist/llama_cpp_python-$(LLAMA_CPP).tar.gz
	rm -rf $(LLAMA_SRC) && mkdir -p $(LLAMA_SRC)
	tar xzf $(VENV)/sdist/llama_cpp_python-$(LLAMA_CPP).tar.gz -C $(LLAMA_SRC) --strip-components=3 \
	    --wildcards '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion/*' \
	    '*/vendor/llama.cpp/gguf-py/*' '*/vendor/llama.cpp/models/ggml-vocab-*.gguf'
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
