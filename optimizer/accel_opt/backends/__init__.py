"""Backends by name. Each module imports its runtime lazily so `accel-opt --help` stays fast."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from accel_opt.backends.base import Backend, CompiledModel
from accel_opt.errors import Unsupported
from accel_opt.machine.cpu import CpuProfile
from accel_opt.machine.support import Availability
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.types import BackendName, Precision

__all__ = ["Availability", "Backend", "CompiledModel", "compile_for", "get_backend"]


def get_backend(name: BackendName | str, providers: Sequence[str] | None = None,
                allow_cpu_nodes: bool = False, device: str | None = None, cpu: CpuProfile | None = None) -> Backend:
    """The backend object for `name`; raises Unsupported (exit 4) with a reason if it cannot run here.

    ONNX Runtime only: `providers[0]` is the execution provider (CPU by default; CUDAExecutionProvider
    or TensorrtExecutionProvider need an NVIDIA GPU and onnxruntime-gpu), `allow_cpu_nodes` lets a GPU
    EP leave nodes it does not take to the CPU EP. torch only: `device` ("cpu", "cuda[:N]"; None: the GPU when
    torch sees one, else the CPU). OpenVINO only: `cpu`, the CPU profile its native bf16/fp16 and its saved blob's
    kernels are judged on (None: this machine's). Other backends ignore them."""
    name = BackendName(name)
    if name is BackendName.torch:
        from accel_opt.backends.torch.backend import TorchBackend

        backend: Backend = TorchBackend(device)
    elif name is BackendName.onnxruntime:
        from accel_opt.backends.onnxruntime.backend import OnnxRuntimeBackend

        backend = OnnxRuntimeBackend(list(providers) if providers else None, allow_cpu_nodes=allow_cpu_nodes)
    elif name is BackendName.openvino:
        from accel_opt.backends.openvino.backend import OpenVinoBackend

        backend = OpenVinoBackend(cpu)
    else:
        # Finds a CUDA device before importing tensorrt (its runtime can crash a process without a GPU).
        from accel_opt.backends.tensorrt.backend import TensorRtBackend

        backend = TensorRtBackend()
    availability = backend.available()
    if not availability:
        raise Unsupported(f"backend {name.value} is unavailable here: {availability.reason}")
    return backend


def compile_for(backend: Backend, path: Path, precision: Precision, recipe: Recipe, workdir: Path,
                shapes: dict[str, list[int]]) -> CompiledModel:
    """backend.compile, with the input shapes for backends that compile for fixed shapes."""
    kwargs = {"shapes": shapes} if getattr(backend, "compiles_for_shapes", False) else {}
    return backend.compile(path, precision, recipe, workdir, **kwargs)
