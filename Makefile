# The two commands of the README. Both create .venv and install everything they need:
# nothing here relies on packages installed by hand.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU wheel for this machine class; the package itself only asks torch>=2.4.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test lint install install-test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q "$(TORCH_PIN)" -e ".[test]"
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

demo: install
	$(VENV)/bin/pagedkv demo

lint: install-test
	$(VENV)/bin/ruff check pagedkv tests benchmarks
	$(VENV)/bin/ruff format --check pagedkv tests benchmarks

test: lint
	$(VENV)/bin/python -m pytest

clean:
	rm -rf $(VENV) pagedkv-report .pytest_cache .hypothesis
