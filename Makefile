# Two commands do all the set-up on a fresh machine:
#   make serve   create the virtualenv with what serving needs, fetch the default model, serve it on
#                http://127.0.0.1:8000 (HOST=0.0.0.0 to listen on every interface, PORT=N for another port)
#   make test    the same virtualenv plus the test tools, fetch the default model, run the tests
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu installs a CPU-only torch first (a laptop).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SERVE_STAMP := $(VENV)/.serve-stamp
DEV_STAMP := $(VENV)/.dev-stamp
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=
PYTEST_ARGS ?=
TORCH_INDEX_URL ?=

.PHONY: install install-dev model serve test bench constraints clean

$(SERVE_STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(if $(TORCH_INDEX_URL),$(PY) -m pip install --index-url $(TORCH_INDEX_URL) torch)
	$(PY) -m pip install -c constraints.txt -e .
	touch $(SERVE_STAMP)

$(DEV_STAMP): $(SERVE_STAMP)
	$(PY) -m pip install -c constraints.txt -e '.[dev]'
	touch $(DEV_STAMP)

install: $(SERVE_STAMP)

install-dev: $(DEV_STAMP)

model: install
	$(PY) -m engine.default_model

serve: model
	$(VENV)/bin/minivllm serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: install-dev model
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: install-dev model
	$(PY) bench/offline_throughput.py

# Rewrite constraints.txt from this virtualenv (after changing pyproject.toml's dependencies).
constraints: install-dev
	{ sed -n '/^#/p' constraints.txt; $(PY) -m pip freeze --exclude-editable \
	    | grep -viE '^(torch|triton|nvidia-|cuda-)' | sort -f | sed 's/$$/; python_version >= "3.11"/'; } > constraints.new
	mv constraints.new constraints.txt

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
