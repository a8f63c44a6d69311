"""Backends by name. Each module imports its runtime lazily so `accel-opt --help` stays fast."""

from __future__ import annotations

from optimizer.backends.base import Availability, Backend, CompiledModel
from optimizer.errors import Unsupported
from optimizer.recipe import BackendName

__all__ = ["Availability", "Backend", "CompiledModel", "get_backend"]


def get_backend(name: BackendName | str) -> Backend:
    """The backend object for `name`; raises Unsupported (exit 4) with a reason if it cannot run here."""
    name = BackendName(name)
    if name is BackendName.onnxruntime:
        from optimizer.backends.onnxruntime import OnnxRuntimeBackend

        backend: Backend = OnnxRuntimeBackend()
    elif name is BackendName.openvino:
        from optimizer.backends.openvino import OpenVinoBackend

        backend = OpenVinoBackend()
    else:
        from optimizer.backends.tensorrt import TensorRtBackend

        backend = TensorRtBackend()
    availability = backend.available()
    if not availability:
        raise Unsupported(f"backend {name.value} is unavailable here: {availability.reason}")
    return backend
