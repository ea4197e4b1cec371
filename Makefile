# Quick start on a fresh machine:  make demo   (runs the batch job on the embedded tiny checkpoint)
#                                  make test   (CPU test suite; GPU tests skip with the reason shown)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# CPU torch: the wheel on this machine's disk when there is one (never a multi-GB CUDA download in CI).
TORCH_WHEELS := $(wildcard /opt/wheels)

.PHONY: setup demo using-it test test-gpu bench build-ext lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(if $(TORCH_WHEELS),--find-links $(TORCH_WHEELS)) "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	# A CPU torch brings no Triton: tests/test_triton_interpret.py runs the Triton GEMMs under its interpreter.
	if $(PY) -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
	  $(PY) -m pip install -q "triton>=3.9" || echo "Triton not installed: tests/test_triton_interpret.py will skip"; \
	fi
	touch $(STAMP)

demo: setup
	$(VENV)/bin/ovbatch demo
	@echo "ovbatch is in $(VENV)/bin, not on your PATH: 'source $(VENV)/bin/activate' puts it there (or call $(VENV)/bin/ovbatch); then README's 'Using it'."

# README's "Using it" commands, in order, after the demo, in a temporary copy of the checkout (11 min
# on 2 cores: CI runs it, `make test` does not).
using-it: setup
	OVBATCH_README_RUN=1 $(PY) -m pytest -q tests/test_readme.py

# The CPU suite runs on the CPU on any machine: its tests expect the CPU defaults (device auto, fp32).
test: setup
	$(VENV)/bin/ruff check .
	CUDA_VISIBLE_DEVICES= $(PY) -m pytest -q

test-gpu: setup
	$(PY) -m pytest -q -m gpu

# On a CUDA machine; parity and generate also need the official `omnivoice` package installed.
bench: setup
	PY=$(PY) bash bench/gpu_session.sh parity generate codec-parity codec quantize pipeline kernels

build-ext: setup
	$(PY) -m engine.kernels.build

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
