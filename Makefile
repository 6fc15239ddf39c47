# Two commands do all the set-up on a fresh machine:
#   make serve   create the virtualenv, fetch the default model, serve it on :8000
#   make test    create the virtualenv, fetch the default model, run the tests
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
HOST ?= 0.0.0.0
PORT ?= 8000
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: install model serve test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

model: install
	$(PY) -m engine.default_model

serve: model
	$(VENV)/bin/minivllm serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: model
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: model
	$(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
