"""OpenVINO backend: the fastest CPU runtime on x86 (bf16 on AMX, int8 from the same Q/DQ ONNX).

The backend compiles exactly the ONNX graph it is given. Its one precision knob is the
INFERENCE_PRECISION_HINT, which is always set: on AMX CPUs OpenVINO silently runs an fp32 model
in bf16 unless told f32. After compiling, the hint and every layer's runtime precision are read
back and recorded, so the report says what actually ran, not what was asked for.

Shapes: unless the recipe asks for `dynamic_shapes`, every input-shape set runs on a model compiled
for exactly those static shapes (a dynamic batch costs 6-20% at int8 here). The runner compiles one
per shape signature on first use, each verified like the saved one; the saved blob is the compile
for the deployment's shapes (the pipeline passes them, at the deployed batch size).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from accel_opt.backends.base import CompiledModel
from accel_opt.backends.openvino.blob import (
    BLOB_DEPENDS_ON,
    _save_blob,
    blob_mismatch,
    environment,
    load_cached_blob,
    load_compiled,
)
from accel_opt.backends.openvino.compile import (
    DEVICE,
    HINTS,
    READ_BACK,
    StaticCompiler,
    _compile_model,
    _core,
    _onnx_io_names,
    _read,
    _verify_precision,
    capabilities,
    compute_kernels,
    execution_precisions,
    precision_support,
)
from accel_opt.backends.openvino.runner import OpenVinoRunner, throughput
from accel_opt.errors import Unsupported
from accel_opt.files import install_line, sha256_file
from accel_opt.machine.cpu import CpuProfile, available_cpus
from accel_opt.machine.support import Availability
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.types import Precision

__all__ = ["HINTS", "OpenVinoBackend", "OpenVinoRunner", "StaticCompiler", "blob_mismatch", "capabilities",
           "environment",
           "execution_precisions", "load_cached_blob", "load_compiled", "precision_support", "throughput"]

log = logging.getLogger(__name__)


class OpenVinoBackend:
    name = "openvino"
    extra = "openvino"
    compiles_for_shapes = True  # compile() takes the deployment's resolved input shapes (see base.Backend)

    def __init__(self, cpu: CpuProfile | None = None):
        # The CPU it compiles and runs for: its flags say where bf16/fp16 are native and which kernels a saved blob
        # holds. None: this machine's, read here (the edge for direct use; builds and loads pass theirs).
        self.cpu = cpu or CpuProfile.here()

    def available(self) -> Availability:
        try:
            import openvino  # noqa: F401
        except ImportError:
            return Availability(False, f"openvino is not installed ({install_line('openvino')})")
        if DEVICE not in _core().available_devices:
            return Availability(False, "OpenVINO sees no CPU device")
        return Availability(True)

    def supports(self, precision: Precision) -> Availability:
        return precision_support(precision, self.cpu.flags, self.cpu.openvino_capabilities or capabilities())

    def compile(
        self,
        onnx_path: Path,
        precision: Precision,
        recipe: Recipe,
        workdir: Path,
        performance_hint: str = "LATENCY",
        num_streams: int = 1,
        *,
        shapes: dict[str, list[int]] | None = None,
    ) -> CompiledModel:
        """Compile on the CPU with the precision hint set, verify what runs, and save the blob.

        `shapes`: the deployment's input shapes at its batch size (the pipeline passes them). Unless
        `recipe.dynamic_shapes`, the build is static: the saved blob is compiled for exactly `shapes`,
        and the runner compiles every other input-shape set it is fed for exactly that set (so one
        runner still sweeps batch sizes). Without `shapes` the blob keeps the model's own shapes
        (static only where the model fixes them). With `recipe.dynamic_shapes` one dynamic compile
        serves every shape.
        """
        support = self.supports(precision)
        if not support:
            raise Unsupported(f"OpenVINO {precision.value}: {support.reason}")
        onnx_path = Path(onnx_path)
        threads = recipe.benchmark.threads or available_cpus()
        config = {
            "INFERENCE_PRECISION_HINT": HINTS[precision],
            "PERFORMANCE_HINT": performance_hint,
            "NUM_STREAMS": str(num_streams),
            "INFERENCE_NUM_THREADS": str(threads),
        }
        start = time.perf_counter()
        model = _read(onnx_path)
        shape_mode = "dynamic" if recipe.dynamic_shapes else "static"
        blob_shapes = None if recipe.dynamic_shapes or not shapes else {name: list(dims) for name,
                                                                        dims in shapes.items()}
        compiled = _compile_model(model, config, blob_shapes)
        build_seconds = time.perf_counter() - start

        by_layer = _verify_precision(compiled, precision)
        inputs, outputs = _onnx_io_names(compiled, onnx_path)
        if blob_shapes is None and all(port.get_partial_shape().is_static for port in compiled.inputs):
            # fixed by the model
            blob_shapes = {name: list(port.get_shape()) for name, port in zip(inputs, compiled.inputs)}
        meta = {
            **environment(self.cpu),
            "precision": precision.value,
            "config": config,
            "static_shapes": blob_shapes,
            "execution_precision_by_layer_type": by_layer,
            "source_sha256": sha256_file(onnx_path),
        }
        blob_path, meta_path = _save_blob(compiled,
                                          Path(workdir) / f"{onnx_path.stem}.openvino-{precision.value}.blob", meta)
        settings = {
            "compile_config": config,
            "properties": {key: str(compiled.get_property(key)) for key in READ_BACK},
            "inference_precision": HINTS[precision],
            "execution_precision_by_layer_type": by_layer,
            "kernels_by_layer_type": compute_kernels(compiled),
            # static: one compile per input-shape set (the runner compiles each on first use);
            # dynamic: one compile for every shape. static_shapes: what the saved blob was compiled for.
            "shape_mode": shape_mode,
            "static_shapes": blob_shapes,
            "input_names": inputs,
            "output_names": outputs,
            "optimization_capabilities": list(capabilities()),
            **{key: meta[key] for key in BLOB_DEPENDS_ON},
            "blob": blob_path.name,
        }
        return CompiledModel(
            backend=self.name,
            path=onnx_path,
            precision=precision,
            device="cpu",
            providers=[f"OpenVINO {DEVICE}"],
            threads=threads,
            build_seconds=build_seconds,
            settings=settings,
            # An IR's weights (NNCF's int8 build): the .bin of the .xml's stem, which OpenVINO reads beside it.
            extra_files=[*([onnx_path.with_suffix(".bin")] if onnx_path.suffix == ".xml" else []),
                         blob_path, meta_path],
        )

    def runner(self, compiled: CompiledModel) -> OpenVinoRunner:
        settings = compiled.settings
        static = None
        if settings["shape_mode"] == "static":
            static = StaticCompiler(compiled.path, settings["compile_config"], compiled.precision)
        # A static runner starts from the saved blob only where that blob is static (its own shapes).
        has_start = static is None or settings["static_shapes"]
        return OpenVinoRunner(
            (lambda: load_compiled(compiled, self.cpu)) if has_start else (lambda: None),
            settings["input_names"],
            settings["output_names"],
            name=f"{self.name}-{compiled.precision.value}",
            static=static,
        )

    def synchronize(self) -> None:
        return None

    def concurrency_sweep(self, compiled: CompiledModel, feed: dict[str, np.ndarray],
                          seconds: float) -> list[dict[str, Any]]:
        """Threads x streams x performance hint: LATENCY with one stream at 1..threads threads, then
        THROUGHPUT with 1..threads streams (one async request in flight per stream)."""
        cores = max(1, compiled.threads)
        configs = [("LATENCY", 1, t) for t in range(1, cores + 1)] + [("THROUGHPUT", s,
                                                                       cores) for s in range(1, cores + 1)]
        return [throughput(compiled, feed, streams, seconds, hint, threads) for hint, streams, threads in configs]
