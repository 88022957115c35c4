# homespec: two entry points, `make serve` and `make test`. Both are idempotent: the venv is
# rebuilt only when pyproject.toml changes, and models are skipped once present and verified.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CONFIG ?= config.yaml
# llama-cpp-python compiles llama.cpp from source (~10-15 min on 2 cores the first time; pip
# caches the wheel). The default build targets AVX2 instead of -march=native: a native build on a
# CPU that advertises AMX uses AMX tiles, which fault inside VMs that do not enable them
# (measured here: SIGSEGV at ldtilecfg in ggml_backend_amx_mul_mat), and a native wheel from
# pip's cache would not run on an older CPU. For an NVIDIA GPU:
#     make serve LLAMA_CMAKE_ARGS="-DGGML_CUDA=on"
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
export CMAKE_ARGS := $(LLAMA_CMAKE_ARGS) $(CMAKE_ARGS)

.PHONY: serve test lint install models test-models bench dashboard clean

serve: models
	$(BIN)/homespec serve --config $(CONFIG)

test: test-models
	$(BIN)/ruff check homespec tests scripts
	$(BIN)/python -m pytest -q -ra

lint: $(STAMP)
	$(BIN)/ruff check homespec tests scripts

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip wheel
	$(BIN)/python -m pip install --quiet -e '.[dev,mtp]'
	touch $(STAMP)

# The default target and draft (see models/registry.yaml).
models: $(STAMP)
	$(BIN)/homespec models pull --config $(CONFIG)

# Defaults plus the models the tests use (a model with a different tokenizer).
test-models: $(STAMP)
	$(BIN)/homespec models pull --config $(CONFIG) --with-test-models

bench: models
	$(BIN)/homespec bench --config $(CONFIG)

dashboard: $(STAMP)
	$(BIN)/homespec dashboard

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
