# One command sets up, one runs the demo, one runs the tests. pip + venv only (see README).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch: any other spec can pull a multi-GB CUDA build (measured: ~5 GB).
TORCH_PIN := torch==2.13.0

.PHONY: install demo test test-all lint bench gpu-check wheelhouse clean
# A Python with a CUDA build of torch (the venv pins the CPU build); on a machine without a GPU the check says so, exit 0.
GPU_PYTHON ?= $(BIN)/python

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet -e ".[dev]" "$(TORCH_PIN)"
	touch $@

demo: install
	$(BIN)/python examples/demo.py

test: install
	$(BIN)/python -m pytest

test-all: install
	$(BIN)/python -m pytest -m ""

lint: install
	$(BIN)/python -m ruff check .

bench: install
	$(BIN)/python -m benchmarks.harness_overhead
	$(BIN)/python -m benchmarks.int8_speed
	$(BIN)/python -m benchmarks.openvino_speed
	$(BIN)/python -m benchmarks.quiet_state_ratio
	$(BIN)/python -m benchmarks.minilm_speed
	$(BIN)/python -m benchmarks.e2e_job --model resnet50
	$(BIN)/python -m benchmarks.e2e_job --model light

# The GPU machine (an H200: Python 3.12, torch with CUDA, no registry) lacks these of the project's dependencies:
# a wheelhouse for its Python, git-ignored, that travels with the run (about 4 MB).
WHEELHOUSE := wheelhouse
wheelhouse:
	$(PYTHON) -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
	    -d $(WHEELHOUSE) polygraphy onnxslim "pydantic>=2.6" pydantic-core annotated-types typing-inspection

# On the GPU machine: make gpu-check GPU_PYTHON=python3 (after installing the wheelhouse, see docs/backends.md).
gpu-check:
	$(GPU_PYTHON) -m benchmarks.gpu_check
	$(GPU_PYTHON) -m benchmarks.device_job --device cuda

clean:
	rm -rf $(VENV) artifacts/*/ .pytest_cache .ruff_cache
