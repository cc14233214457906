# ruvllm: every target sets up what it needs on a fresh machine.
#   make run    create .venv, install, generate, then serve the built-in model
#   make test   install everything the tests need, then run the whole suite
#   make bench  run the benchmarks (see benchmarks/README.md)

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PIPC   := $(PIP) install --disable-pip-version-check -q -c constraints.txt
STAMP  := $(VENV)/.ruvllm-installed
PYTEST_ARGS ?=

.PHONY: setup run test bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 goes in first, alone, from the machine's local CPU wheel;
# everything after runs under constraints.txt so no package can upgrade it.
$(STAMP): $(VENV)/bin/python pyproject.toml constraints.txt
	$(PIP) install --disable-pip-version-check -q torch==2.13.0
	$(PIPC) -e '.[torch,test]'
	touch $(STAMP)

setup: $(STAMP)

# A short generation from the command line, then the OpenAI-compatible server
# on the built-in model (Ctrl-C stops it); it prints the URL it listens on.
PORT ?= 8000
run: setup
	$(VENV)/bin/ruvllm generate --max-tokens 60 --seed 0 "ROMEO:"
	$(VENV)/bin/ruvllm serve tiny-shakespeare --port $(PORT)

# pytest exit codes: 0 ok, 1 failures, 5 nothing collected (reported, not fatal).
test: setup
	@set +e; $(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; \
	exit $$rc

bench: setup
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
