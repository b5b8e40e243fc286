# Two commands: `make test` and `make serve`. Both set up .venv themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test serve helloworld bench venv clean chromium

venv: $(STAMP)

# Refresh the venv whenever the package metadata or the pins change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

# Lint first; DYNAMOE_REQUIRE_CPU_KERNELS=1: a CPU kernel build that fails on an x86-64 machine fails the
# run (tests/conftest.py) instead of skipping every kernel test (DYNAMOE_NO_CPU_KERNELS=1 still turns them off)
test: $(STAMP) chromium
	$(VENV)/bin/ruff check .
	DYNAMOE_REQUIRE_CPU_KERNELS=1 $(PY) -m pytest -q

# Debian's headless Chromium for the web-UI test (tests/test_serve_http.py). Installed only where it is
# missing and apt-get can run as root; elsewhere that one test is skipped and says why.
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y -q chromium >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }; }; } || \
	  echo "make: chromium is not installed and cannot be here; the browser test will be skipped"

helloworld: $(STAMP)
	$(PY) -m dynamoe.examples.helloworld --batch_size 4 --num_tokens 256 --model_dim 256 --hidden_size 512 --num_local_experts 4 --top 2 --num_steps 10

bench: $(STAMP)
	$(PY) benchmarks/moe_layer.py

# make serve ARGS="--model DIR [--port 8000] [--api-key K] ..." (see `dynamoe serve --help`); without a model
# it serves the embedded demo model when the build has one, else says to pass --model
serve: $(STAMP)
	$(PY) -m dynamoe.cli serve $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
