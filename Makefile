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

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m experiments.quant_report

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP)
	$(BIN)/ruff check .
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(BIN)/python -m pytest -n 2 -q

clean:
	rm -rf $(VENV)
