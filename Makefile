# One command sets up, one runs the demo, one runs the tests. pip + venv only (see README).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch: any other spec can pull a multi-GB CUDA build (measured: ~5 GB).
TORCH_PIN := torch==2.13.0

.PHONY: install demo test test-all lint bench gpu-check gpu-rehearsal wheelhouse clean
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

# The GPU kit (benchmarks/gpu_kit.py; docs/backends.md "The GPU kit"). The GPU machine (an H200: Python 3.12, a CUDA
# torch and torchvision, no registry) lacks these of the project's dependencies: a wheelhouse for its Python,
# git-ignored, that travels with the run (about 4 MB; the kit with it is measured by `make gpu-rehearsal`). setuptools
# and wheel come along so that the editable install needs nothing from the machine itself.
WHEELHOUSE := wheelhouse
WHEELHOUSE_PYTHON ?= 3.12
WHEEL_PLATFORMS := --only-binary=:all: --implementation cp --python-version $(WHEELHOUSE_PYTHON) \
	--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
wheelhouse:
	$(PYTHON) -m pip download --quiet $(WHEEL_PLATFORMS) --no-deps -d $(WHEELHOUSE) \
	    polygraphy onnxslim colorama annotated-types typing-inspection setuptools wheel
	$(PYTHON) -m pip download --quiet $(WHEEL_PLATFORMS) -d $(WHEELHOUSE) "pydantic>=2.6"

# On a machine with a CUDA torch and make: the kit alone (the GPU machine itself gets one line without make:
# benchmarks.gpu_kit.DEVICE_LINE, quoted in docs/backends.md).
gpu-check:
	$(GPU_PYTHON) -m benchmarks.gpu_kit $(if $(OUT),--out $(OUT))

# The kit rehearsed here, as CI runs it: that line with the network cut, in the GPU machine's package set, on Python
# 3.12 (found under pyenv) and on this Python with its CPU torch; what the kit wrote checked against what comes back.
gpu-rehearsal: install
	$(BIN)/python scripts/gpu_rehearsal.py

clean:
	rm -rf $(VENV) artifacts/*/ .pytest_cache .ruff_cache
