# homespec: two entry points, `make serve` and `make test`. Both are idempotent: the venv is
# rebuilt only when pyproject.toml changes, and models are skipped once present and verified.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CONFIG ?= config.yaml
# llama-cpp-python compiles llama.cpp from source (~10 min on 2 cores the first time; pip caches
# the wheel). For an NVIDIA GPU:  make serve CMAKE_ARGS=-DGGML_CUDA=on
export CMAKE_ARGS

.PHONY: serve test install models test-models bench dashboard clean

serve: models
	$(BIN)/homespec serve --config $(CONFIG)

test: test-models
	$(BIN)/python -m pytest -q -ra

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
