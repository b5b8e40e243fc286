# Two commands: `make test` and (once the server lands) `make serve`. Both set up .venv themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test serve helloworld bench venv clean

venv: $(STAMP)

# Refresh the venv whenever the package metadata or the pins change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

helloworld: $(STAMP)
	$(PY) -m dynamoe.examples.helloworld --batch_size 4 --num_tokens 256 --model_dim 256 --hidden_size 512 --num_local_experts 4 --top 2 --num_steps 10

bench: $(STAMP)
	$(PY) benchmarks/moe_layer.py

serve:
	@echo "make serve: the MoE LLM server (dynamoe serve) has not landed yet; it comes with the serving issue."
	@echo "For now try 'make helloworld' (a Tutel-style MoE training loop) or 'make test'."
	@exit 2

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
