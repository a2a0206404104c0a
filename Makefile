# kvreg: two commands on a fresh machine (see README.md).
#   make run   - venv, install kvreg + every backend, info, conformance, bench
#   make test  - venv, install, the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvreg-installed
PIP := $(BIN)/python -m pip

.PHONY: install run test test-slow conformance bench asv clean

$(STAMP): pyproject.toml backends/numba/pyproject.toml backends/opencl/pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test]' -e backends/numba -e 'backends/opencl[pocl]'
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/kvreg info
	$(BIN)/kvreg conformance --backend all
	$(BIN)/kvreg bench --quick

test: install
	$(BIN)/python -m pytest tests backends/numba/tests backends/opencl/tests -q -p no:cacheprovider
	$(BIN)/kvreg conformance --backend all

test-slow: install
	KVREG_SLOW=1 KVREG_FUZZ_LONG=1 $(BIN)/python -m pytest tests backends/numba/tests backends/opencl/tests -q
	$(BIN)/kvreg conformance --backend all

conformance: install
	$(BIN)/kvreg conformance --backend all

bench: install
	$(BIN)/kvreg bench

asv: install
	$(PIP) install -q asv
	$(BIN)/asv machine --yes
	$(BIN)/asv run --python=same --quick

clean:
	rm -rf $(VENV) build *.egg-info .asv
