# Two commands do all the set-up on a fresh machine:
#   make serve   create the virtualenv with what serving needs, fetch the default model, serve it on
#                http://127.0.0.1:8000 (HOST=0.0.0.0 to listen on every interface, PORT=N for another port)
#   make test    the same virtualenv plus the test tools, fetch the default model, run the tests
#                (in a random order, whose seed is printed: PYTEST_ARGS=--randomly-seed=N repeats an order,
#                PYTEST_ARGS='-p no:randomly' keeps file order)
#   make test-fast   only the unit tier (tests/conftest.py gives each test file its tier), in under two minutes
# On Linux without an NVIDIA GPU, PyTorch's CPU build is installed first (hundreds of MB instead of the CUDA
# build's 5 GB); TORCH_INDEX_URL=<index> picks another index, TORCH_INDEX_URL= (empty) takes PyPI's torch.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SERVE_STAMP := $(VENV)/.serve-stamp
DEV_STAMP := $(VENV)/.dev-stamp
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=
PYTEST_ARGS ?=
CPU_TORCH_INDEX_URL := https://download.pytorch.org/whl/cpu
# An NVIDIA driver shows itself by nvidia-smi or /proc/driver/nvidia; PyPI's torch for Linux is the CUDA build.
NVIDIA_DRIVER_FILE ?= /proc/driver/nvidia/version
NVIDIA_GPU := $(shell { command -v nvidia-smi || test -e $(NVIDIA_DRIVER_FILE); } >/dev/null 2>&1 && echo yes)
ifeq ($(shell uname -s)$(NVIDIA_GPU),Linux)
TORCH_INDEX_URL ?= $(CPU_TORCH_INDEX_URL)
endif
TORCH_INDEX_URL ?=

.PHONY: install install-dev model serve test test-fast bench constraints clean

# torch from TORCH_INDEX_URL; where that index cannot be reached, the next step takes PyPI's torch instead.
define TORCH_FROM_INDEX
@echo "installing torch from $(TORCH_INDEX_URL)$(if $(filter $(CPU_TORCH_INDEX_URL),$(TORCH_INDEX_URL)), (no NVIDIA GPU \
found: the CPU build; TORCH_INDEX_URL= takes PyPI's CUDA build))"
$(PY) -m pip install --retries 1 --timeout 20 --index-url $(TORCH_INDEX_URL) torch || echo "could not install torch from $(TORCH_INDEX_URL): \
taking PyPI's torch"
endef

$(SERVE_STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(if $(TORCH_INDEX_URL),$(TORCH_FROM_INDEX))
	$(PY) -m pip install -c constraints.txt -e .
	touch $(SERVE_STAMP)

$(DEV_STAMP): $(SERVE_STAMP)
	$(PY) -m pip install -c constraints.txt -e '.[dev]'
	touch $(DEV_STAMP)

install: $(SERVE_STAMP)

install-dev: $(DEV_STAMP)

model: install
	$(PY) -m engine.loading.default_model

serve: model
	$(VENV)/bin/minivllm serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: install-dev model
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: install-dev model
	$(PY) -m pytest -q -m unit $(PYTEST_ARGS)

bench: install-dev model
	$(PY) bench/offline_throughput.py --quantization gguf

# Rewrite constraints.txt from this virtualenv (after changing pyproject.toml's dependencies).
constraints: install-dev
	{ sed -n '/^#/p' constraints.txt; $(PY) -m pip freeze --exclude-editable \
	    | grep -viE '^(torch|triton|nvidia-|cuda-)' | sort -f | sed 's/$$/; python_version >= "3.11"/'; } > constraints.new
	mv constraints.new constraints.txt

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
