# homespec: two entry points, `make serve` and `make test`. Both are idempotent: the venv is
# rebuilt only when pyproject.toml changes, and models are skipped once present and verified.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CONFIG ?= config.yaml
# llama-cpp-python compiles llama.cpp from source (~10-15 min on 2 cores the first time). It is
# built for the CPU it runs on: homespec/llama/cpu_build.py reads /proc/cpuinfo and names every x86
# kernel option ON or OFF (AVX2, AVX-512, VNNI, ...; AMX only with HOMESPEC_AMX=on, where a tile
# check passes), and changes llama.cpp's source before building it (its `fixes`: a line GCC 12
# miscompiles, Q6_K weights kept out of AMX, where they decode slower, a process-wide switch for
# ggml's reference kernels, which exact mode's verify passes take, flash attention, Q6_K and Q4_K
# products that cost verify passes less, larger chunks of a product for the threads: cpu_build.py
# says how).
# The wheel is kept in a folder named after the version, the options and the fixes (their names and
# a digest of what they change: cpu_build.py fixes), never in pip's
# cache, which is keyed by version only and would hand a wheel built for one CPU to another that
# lacks its instructions.
# The options are recorded beside the installed package, and the daemon refuses a build this CPU
# cannot run. For an NVIDIA GPU:
#     make serve LLAMA_CMAKE_ARGS="-DGGML_CUDA=on"
LLAMA_VERSION := $(shell sed -n 's/.*"llama-cpp-python==\([^"]*\)".*/\1/p' pyproject.toml)
LLAMA_CMAKE_ARGS ?= $(shell $(PYTHON) homespec/llama/cpu_build.py cmake-args)
export CMAKE_ARGS := $(LLAMA_CMAKE_ARGS) $(CMAKE_ARGS)
LLAMA_FIXES := $(shell $(PYTHON) homespec/llama/cpu_build.py fixes)
LLAMA_BUILD := $(shell printf '%s|%s|%s|%s' '$(LLAMA_VERSION)' '$(CMAKE_ARGS)' "$$(uname -m)" '$(LLAMA_FIXES)' | sha256sum | cut -c1-16)
WHEELS      := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/homespec/wheels/$(LLAMA_BUILD)
LLAMA_STAMP := $(VENV)/.llama-$(LLAMA_BUILD)

.PHONY: serve test lint install models test-models bench dashboard clean

serve: models
	$(BIN)/homespec serve --config $(CONFIG)

test: test-models
	$(BIN)/ruff check homespec tests scripts
	$(BIN)/python -m pytest -q -ra

lint: $(STAMP)
	$(BIN)/ruff check homespec tests scripts

install: $(STAMP)

$(STAMP): pyproject.toml $(LLAMA_STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,mtp]'
	touch $(STAMP)

# llama.cpp for this CPU (or for LLAMA_CMAKE_ARGS), built once per version and options.
$(LLAMA_STAMP):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip wheel
	ls $(WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl >/dev/null 2>&1 || \
		$(BIN)/python homespec/llama/cpu_build.py wheel '$(LLAMA_VERSION)' $(WHEELS)
	$(BIN)/python -m pip install --quiet --force-reinstall --no-deps $(WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl
	$(BIN)/python homespec/llama/cpu_build.py stamp "$$($(BIN)/python -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("llama_cpp").origin))')" '$(CMAKE_ARGS)'
	rm -f $(VENV)/.llama-*
	touch $@

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
