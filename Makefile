# Two set-up commands on a fresh machine: `make run` (the main job) and `make test` (the suite).
# Each installs what it needs into .venv by itself; the install is skipped when setup.cfg is unchanged.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU torch: this exact version is a CPU build; any other version pulls a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0

.PHONY: run test lint venv clean

$(STAMP): setup.cfg pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_CPU)
	$(BIN)/python -m pip install -q -e '.[torch,dev]'
	touch $(STAMP)

# SGLang 0.5.23's Python classes on CPU torch, --no-deps (tests of the SGLang plugin); no CUDA.
SGLANG_STAMP := $(VENV)/.sglang-cpu
$(SGLANG_STAMP): $(STAMP) requirements/sglang-cpu.txt scripts/install_sglang_cpu.sh
	scripts/install_sglang_cpu.sh $(VENV)
	touch $@

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m experiments.train_rl --config=configs/quickstart.py --workdir=runs/quickstart

lint: $(STAMP)
	$(BIN)/ruff check .

# --dist worksteal: each worker starts on one contiguous half of the suite (a module's tests,
# module fixtures and compiled programs stay in one process) and steals queued tests when idle.
# The SGLang plugin's tests run in a process of their own: SGLang loads tvm_ffi, whose SIGSEGV
# handler deadlocked a JAX test worker (WORKSPACE.md, Traps). --durations: the
# slowest tests at the end of the log (keep the suite under its ~20 minute budget).
# TEST_XLA_FLAGS: 8 simulated CPU devices for the sharding tests, and XLA's CPU backend at
# optimization level 0: the suite's time is mostly compiling small programs once (the packed-KV
# sessions test: 84 -> 68 s alone). XLA's CPU backend uses no fast math at either level; the
# whole suite, bit-exact tests included, passed at both.
# FAST_COMPILE_FLAGS: XLA's CPU backend emits its fusions through its older elemental emitters,
# which compile in about 2/3 of the time (the whole suite on the 2-core machine: 20 min 33 s ->
# 14 min 34 s). DEFAULT_EMITTER_TESTS run under XLA's default emitters, the ones a user's
# program runs: the quantizers' bits (against numpy, torch and the GPU checks' references), and
# the tests that compare two differently fused programs bit for bit and fail under the older
# emitters (the trainer against the rollout under the invariant plan: the logprobs differ in
# their last bits; the fake-quant kernels against XLA's quantizers: 1% of a gradient's elements).
TEST_XLA_FLAGS = --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0
FAST_COMPILE_FLAGS = --xla_cpu_use_fusion_emitters=false
DEFAULT_EMITTER_TESTS = tests/quant tests/rollout_bridge/test_torch_quant.py \
  tests/experiments/bench/test_bit_checks.py tests/train/test_exact_on_policy.py \
  tests/model/test_precision.py
PYTEST = $(BIN)/python -m pytest -n 2 --dist worksteal -q
test: $(STAMP) $(SGLANG_STAMP)
	$(BIN)/ruff check .
	XLA_FLAGS="$(TEST_XLA_FLAGS) $(FAST_COMPILE_FLAGS)" $(PYTEST) --durations=20 \
	  --ignore=tests/rollout_bridge/test_sglang_plugin.py \
	  $(addprefix --ignore=,$(DEFAULT_EMITTER_TESTS))
	XLA_FLAGS="$(TEST_XLA_FLAGS)" $(PYTEST) $(DEFAULT_EMITTER_TESTS)
	XLA_FLAGS="$(TEST_XLA_FLAGS)" $(BIN)/python -m pytest -q \
	  tests/rollout_bridge/test_sglang_plugin.py

clean:
	rm -rf $(VENV)
