"""What every backend provides: availability with a reason, compile, and a Polygraphy runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata
from polygraphy.datatype import DataType

from accel_opt.files import install_line
from accel_opt.machine.support import Availability
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.types import Precision

# The command that adds each optional backend (doctor and the backends' 'not installed' errors say it).
TORCH_INSTALL = install_line("torch", "torch==2.13.0")
INSTALL = {
    "openvino": install_line("openvino"),
    "torch": TORCH_INSTALL,
    "onnxruntime-gpu": f"pip uninstall -y onnxruntime && {install_line('gpu')}",
    "tensorrt": f"{install_line('tensorrt')} (TensorRT's libraries come from NVIDIA's own package index)",
}


@dataclass
class CompiledModel:
    """A model ready to run on one backend, with the facts a deployment needs."""

    backend: str
    path: Path  # the model file the backend runs
    precision: Precision
    device: str  # "cpu", "cuda:0"
    providers: list[str]  # what actually runs it (checked, not requested)
    threads: int
    build_seconds: float
    settings: dict[str, Any] = field(default_factory=dict)  # session/compile options, recorded verbatim
    extra_files: list[Path] = field(default_factory=list)  # files the deployment needs beside `path`
    # What keeps `path` and `extra_files` on disk while this is used (a loaded folder's private copy).
    keep_alive: Any = field(default=None, repr=False, compare=False)


class Backend(Protocol):
    """A runtime the pipeline builds for.

    A backend that compiles kernels for fixed input shapes (OpenVINO) sets the class attribute
    `compiles_for_shapes = True`; its compile() then also takes the keyword `shapes` (input name ->
    the deployment's resolved shape) and the pipeline passes it. Others need neither.
    """

    name: str
    extra: str  # the pip extra that installs it

    def available(self) -> Availability: ...

    def supports(self, precision: Precision) -> Availability: ...

    def compile(self, onnx_path: Path, precision: Precision, recipe: Recipe, workdir: Path) -> CompiledModel: ...

    def runner(self, compiled: CompiledModel) -> BaseRunner: ...

    def synchronize(self) -> None:
        """Wait for queued device work; a no-op on synchronous CPU runtimes."""


class CastInputsRunner(BaseRunner):
    """Runs `inner` on inputs cast to the dtypes its model declares.

    A build with `--no-keep-io-types` takes float16 inputs while the samples (and the reference) are
    float32; the cast is part of what the application pays, so it stays inside the timed call.
    """

    def __init__(self, inner: BaseRunner, dtypes: dict[str, str]):
        super().__init__(name=inner.name, prefix="cast-inputs-runner")
        self.inner, self.dtypes = inner, {name: np.dtype(d) for name, d in dtypes.items()}

    def activate_impl(self):
        self.inner.activate()

    def get_input_metadata_impl(self):
        meta = TensorMetadata()
        for name, info in self.inner.get_input_metadata(use_numpy_dtypes=False).items():
            meta.add(name, dtype=DataType.FLOAT32 if name in self.dtypes else info.dtype, shape=info.shape)
        return meta

    def infer_impl(self, feed_dict):
        cast = {name: (a.astype(self.dtypes[name]) if name in self.dtypes else a) for name, a in feed_dict.items()}
        outputs = self.inner.infer(cast, check_inputs=False)
        self.inference_time = self.inner.last_inference_time()
        return outputs

    def deactivate_impl(self):
        self.inner.deactivate()


def casting_inputs(runner: BaseRunner, fed: dict[str, Any], deployed: dict[str, Any]) -> BaseRunner:
    """`runner`, wrapped to cast the inputs fed in another dtype than the model deploys (in the timed call)."""
    differing = {name: dtype for name, dtype in deployed.items() if np.dtype(fed.get(name, dtype)) != np.dtype(dtype)}
    return CastInputsRunner(runner, differing) if differing else runner
