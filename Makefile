# One command to set up and test, one to run. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# The CPU build of torch for development and CI. The package itself only asks for a range:
# Ascend users install the torch that matches their torch_npu.
TORCH_PIN ?= torch==2.13.0
# Which build of it (scripts/install_torch.py): auto (PyTorch's CPU index on an x86-64 box
# without a CUDA GPU, unless a wheel is already on disk; else the registry's), cpu, cuda or
# registry.
TORCH_VARIANT ?= auto
INSTALL_TORCH = scripts/install_torch.py "$(TORCH_PIN)" "$(TORCH_VARIANT)"
# The real torch_npu release that pairs with TORCH_PIN (its import and error paths are tested
# without CANN by make test-torch-npu).
TORCH_NPU_PIN ?= torch-npu==2.13.0

.PHONY: setup test test-slow test-floors test-torch-npu test-ray test-clients test-compressed lint run serve clean

$(STAMP): pyproject.toml examples/rlt-hal-acme/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python $(INSTALL_TORCH)
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps -e examples/rlt-hal-acme
	touch $(STAMP)

setup: $(STAMP)

lint: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/pre-commit run --all-files --show-diff-on-failure

# The suite must hold whichever GEMM path a CPU's libraries pick: the determinism and engine
# parity tests of the cpu driver run again under torch's and oneDNN's AVX2 dispatch (the closest
# this machine's CPU comes to an AVX2-only one, whatever it is). The emulated npu's cases are
# left out there: on an NPU no CPU GEMM runs, and the main run covers the emulation.
AVX2_DISPATCH := ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2

# The suite runs in TEST_WORKERS processes (pytest-xdist) of one thread each: on 2 cores that
# takes about three quarters of the time of one process of two threads (which leaves a core
# idle through Python, server start-ups and GEMMs too small to split). The rerun under AVX2
# dispatch keeps torch's own thread count, so the multi-threaded GEMM paths are tested too.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider

# Two tiers: make test (about 10 minutes on 2 idle cores) and make test-slow (the
# realistic-width configs, the benches, training, server fuzzing and timing, and each test
# that takes 5 s or more where a faster one checks the same guarantee: tests/conftest.py,
# SLOW_MODULES and SLOW_TESTS). CI runs both (.ci/run).
test: lint
	OMP_NUM_THREADS=1 $(PYTEST) -n $(TEST_WORKERS) --dist loadgroup -m "not slow"
	$(AVX2_DISPATCH) $(PYTEST) tests/test_deterministic.py tests/test_engine.py -k "not npu" \
		-m "not slow"
	$(PYTEST) --pyargs hal.testing --rlt-driver cpu --rlt-driver acme
	RLT_HAL_NPU_EMULATE=1 $(PYTEST) --pyargs hal.testing --rlt-driver npu

test-slow: $(STAMP)
	OMP_NUM_THREADS=1 $(PYTEST) -n $(TEST_WORKERS) --dist loadgroup -m slow
	$(AVX2_DISPATCH) $(PYTEST) tests/test_deterministic.py tests/test_engine.py -k "not npu" \
		-m slow

# The lowest versions pyproject.toml allows of the libraries whose APIs the runtime and the
# HF-module reference depend on, in a venv of their own: the tests that use them must pass.
FLOORS := "transformers==5.0.0" "tokenizers==0.22.1" "llguidance==1.0.0"
FLOOR_VENV := .venv-floors

test-floors: $(STAMP)
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python $(INSTALL_TORCH)
	$(FLOOR_VENV)/bin/python -m pip install -q -e ".[test]" $(FLOORS)
	$(FLOOR_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_parity.py \
		tests/test_detokenizer.py tests/test_cli.py tests/test_sampling.py tests/test_trained.py \
		tests/test_structured.py

# The real torch_npu package beside torch, with no CANN: rlt-hal must still list its drivers,
# run on cpu, and say what to install or source for npu.
TORCH_NPU_VENV := .venv-torch-npu

test-torch-npu: $(STAMP)
	test -x $(TORCH_NPU_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_NPU_VENV)
	$(TORCH_NPU_VENV)/bin/python $(INSTALL_TORCH)
	$(TORCH_NPU_VENV)/bin/python -m pip install -q "$(TORCH_PIN)" "$(TORCH_NPU_PIN)"
	$(TORCH_NPU_VENV)/bin/python -m pip install -q -e ".[test]"
	$(TORCH_NPU_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_torch_npu_package.py

# rlt-hal serve --replicas on Ray Serve, in a venv of its own with the ray extra: two CPU
# replicas of a tiny checkpoint on loopback. The main venv stays without Ray, where make test
# checks that --replicas says what to install.
RAY_VENV := .venv-ray

test-ray: $(STAMP)
	test -x $(RAY_VENV)/bin/python || $(PYTHON) -m venv $(RAY_VENV)
	$(RAY_VENV)/bin/python $(INSTALL_TORCH)
	$(RAY_VENV)/bin/python -m pip install -q -e ".[test,ray]"
	RAY_USAGE_STATS_ENABLED=0 $(RAY_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		tests/test_replicas.py

# Real clients of the OpenAI surface (guidellm, lm-evaluation-harness, LangChain) against a live
# server, in a venv of their own with the clients extra: guidellm's uvloop and httptools would
# otherwise become what uvicorn runs every server of the main suite on.
CLIENTS_VENV := .venv-clients

test-clients: $(STAMP)
	test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python $(INSTALL_TORCH)
	$(CLIENTS_VENV)/bin/python -m pip install -q -e ".[test,clients]"
	$(CLIENTS_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_clients.py

# Quantized checkpoints proved by the tools that own their format: llm-compressor's oneshot
# writes W8A16 / W4A16 Ouro checkpoints that rlt-hal loads, and compressed-tensors decompresses
# what rlt-hal quantize writes (tests/test_compressed_tools.py). A venv of its own with the
# compressed extra: llm-compressor pins a transformers older than the main venv's.
COMPRESSED_VENV := .venv-compressed

test-compressed: $(STAMP)
	test -x $(COMPRESSED_VENV)/bin/python || $(PYTHON) -m venv $(COMPRESSED_VENV)
	$(COMPRESSED_VENV)/bin/python $(INSTALL_TORCH)
	$(COMPRESSED_VENV)/bin/python -m pip install -q -e ".[test,compressed]"
	$(COMPRESSED_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_compressed_tools.py

# The main job: the OpenAI-compatible server on the embedded default (a small random Ouro
# checkpoint) at http://127.0.0.1:8000/v1. `make run` generates once without a server.
serve: $(STAMP)
	$(BIN)/rlt-hal serve

run: $(STAMP)
	$(BIN)/rlt-hal run

clean:
	rm -rf $(VENV) $(FLOOR_VENV) $(TORCH_NPU_VENV) $(RAY_VENV) $(CLIENTS_VENV) $(COMPRESSED_VENV) .pytest_cache .ruff_cache .mypy_cache
