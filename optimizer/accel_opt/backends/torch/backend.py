"""PyTorch 2 as a deployment backend (`--backend torch`): torch.export, then an AOTInductor package.

For models given as a PyTorch factory. The build exports the module with `torch.export` at the deployed shapes,
the batch axis dynamic, after a precision transform of the module:
- fp32: as it is (on CUDA with TF32 off: fp32 means fp32);
- bf16 / fp16: weights and compute in that dtype, float32 inputs and outputs (cast inside the package), and a
  block list of submodules kept in float32 (their inputs cast up, their outputs back), which the fallback grows;
- int8: PyTorch's PT2E flow with X86InductorQuantizer (CPU only; it lives in torchao since torch 2.10), calibrated
  on the build's calibration samples.
`torch._inductor.aoti_compile_and_package` compiles it for the target device (C++/oneDNN kernels on a CPU, Triton
kernels on a GPU) into `model.pt2`, which `aoti_load_package` runs without the model's Python code. The same
package format on both devices: one code path, tested on the CPU in every CI run.

What a package is tied to, checked before it runs (runtime._environment_problems): the torch release that built it,
the CPU vector ISA its C++ kernels use (AOTI_CPU_ISA: an AVX-512 package cannot run on an AVX2-only CPU), and on
a GPU its compute capability. Measured here (torch 2.13 CPU, g++ 12, 2 cores): a small CNN compiles in about 50 s
cold and 20 s with Inductor's caches warm (in the user's temp folder, never in the artifact); it loads in
milliseconds.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from accel_opt.backends.base import CompiledModel
from accel_opt.backends.torch.cache import PACKAGE, cached_package
from accel_opt.backends.torch.kernels import compute_kernels, int8_check
from accel_opt.backends.torch.package import (
    MAX_BATCH,
    REDUCED_DTYPES,
    TORCHAO_INSTALL,
    AotiRunner,
    fp32_is_fp32,
    package_metadata,
    quiet,
    read_plan,
)
from accel_opt.backends.torch.runner import TORCH_EXTRA, require_cuda
from accel_opt.errors import InternalError, Unsupported, first_line
from accel_opt.files import copy_file, made_copy, mark_made
from accel_opt.graph.inspect import TensorSpec
from accel_opt.machine.cpu import available_cpus
from accel_opt.machine.support import Availability
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.types import Precision

log = logging.getLogger(__name__)


def default_device() -> str:
    """The GPU when torch sees one, else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class TorchBackend:
    """torch.export + AOTInductor on `device` ("cpu", "cuda[:N]"; None: default_device())."""

    name = "torch"
    extra = "torch"
    compiles_for_shapes = True

    def __init__(self, device: str | None = None):
        self.requested_device = device
        self.device = device or "cpu"
        self._module = None
        self._inputs: list[TensorSpec] = []
        self._output_names: list[str] = []
        self._batch_axes: dict[str, int | None] = {}
        self._calibration: list[dict[str, np.ndarray]] = []
        self._cache_dir: Path | None = None

    def available(self) -> Availability:
        try:
            import torch
        except ImportError:
            return Availability(False, f"PyTorch is not installed: {TORCH_EXTRA}")
        self.device = self.requested_device or default_device()
        if self.device.startswith("cuda"):
            try:
                require_cuda(torch, self.device)
            except Unsupported as exc:
                return Availability(False, str(exc))
        if shutil.which("g++") is None and shutil.which("c++") is None:
            return Availability(False, "AOTInductor compiles C++ and needs a C++ compiler (g++): apt install g++")
        return Availability(True)

    def supports(self, precision: Precision) -> Availability:
        if precision is Precision.int8:
            if self.device != "cpu":
                return Availability(False, "PyTorch's PT2E int8 flow targets the CPU here (X86InductorQuantizer); on a "
                                           "GPU build int8 with --backend tensorrt (Q/DQ graph)")
            try:
                with quiet():  # torchao says on import which of its CUDA kernels did not load: not this build's concern
                    import torchao.quantization.pt2e  # noqa: F401
            except ImportError:
                return Availability(False, f"PT2E int8 (X86InductorQuantizer) lives in torchao since torch 2.10: "
                                           f"{TORCHAO_INSTALL}")
        return Availability(True)

    def bind(self, module: Any, inputs: list[TensorSpec], outputs: list[TensorSpec], batch_axes: dict[str, int | None],
             calibration: list[dict[str, np.ndarray]] | None = None, cache_dir: Path | None = None) -> None:
        """The build's module (the factory's, eval mode), its inputs in forward()'s order, its outputs' names, the
        inputs' batch axes, and for int8 the calibration samples: what compile() exports. `cache_dir`: the build's
        cache, where compiled packages are kept by what they were compiled from (None: every compile runs Inductor)."""
        self._module, self._inputs, self._batch_axes = module, list(inputs), dict(batch_axes)
        self._output_names = [o.name for o in outputs]
        self._calibration = list(calibration or [])
        self._cache_dir = cache_dir

    def check_traceable(self, module: Any, shapes: dict[str, list[int]], dtypes: dict[str, str] | None = None) -> None:
        """Unsupported (exit 4), with torch.export's reason in one line, for a module it cannot trace at `shapes`
        (forward()'s order, the leading axis dynamic): checked before anything else is built from it."""
        import torch

        self._inputs = [TensorSpec(name=name, dtype=(dtypes or {}).get(name, "float32"), shape=list(shape))
                        for name, shape in shapes.items()]
        self._batch_axes = {name: 0 for name in shapes}
        with quiet():
            self._export(torch, module.eval(), self._examples(torch, shapes))

    def compile(self, path: Path, precision: Precision, recipe: Recipe, workdir: Path,
                shapes: dict[str, list[int]] | None = None) -> CompiledModel:
        """Export and compile the bound module at `shapes` (the batch axis dynamic) into workdir/model.pt2. `path`
        is the precision stage's plan (or the exported ONNX for a plain fp32 baseline)."""
        import torch

        if self._module is None:
            raise InternalError("the torch backend compiles a bound PyTorch module; none was bound")
        plan = read_plan(Path(path), precision)
        started = time.perf_counter()
        workdir.mkdir(parents=True, exist_ok=True)
        shapes = shapes or {}
        examples = self._examples(torch, shapes)
        from accel_opt.backends.torch.modules import precision_module

        module = precision_module(self._module, plan.precision,
                                  plan.keep_fp32) if plan.precision is not Precision.int8 \
            else self._module
        if self.device.startswith("cuda"):
            module = module.to(self.device)
            examples = [e.to(self.device) for e in examples]
        with fp32_is_fp32(torch), quiet():
            program = self._export(torch, module, examples)
            if plan.precision is Precision.int8:
                program = self._quantize(torch, program, examples)
            package = workdir / PACKAGE
            # int8: freezing folds the weights into constants, so Inductor's quantization passes can fuse each
            # dequantize -> conv/linear -> quantize into a oneDNN int8 kernel (without it the convs stay float).
            freezing = torch._inductor.config.patch(freezing=True) if plan.precision is Precision.int8 \
                else contextlib.nullcontext()
            cached = cached_package(torch, program, self.device, plan.precision is Precision.int8, self._cache_dir)
            reused = cached is not None and made_copy(cached, package)  # never a package this user's build did not make
            if reused:
                log.info("torch: %s package reused from %s", plan.precision.value, cached.parent)
            else:
                try:
                    with torch.no_grad(), freezing:
                        torch._inductor.aoti_compile_and_package(program, package_path=str(package))
                except Exception as exc:  # noqa: BLE001 - Inductor's lowering and the C++ compiler raise many types
                    raise Unsupported(f"AOTInductor could not compile the exported program for {self.device}: "
                                      f"{type(exc).__name__}: {first_line(exc)}") from exc
                if cached is not None:
                    copy_file(package, cached)
                    mark_made(cached)
        if self.device.startswith("cuda"):
            self._module.to("cpu")
        metadata = package_metadata(package)
        kernels = compute_kernels(package)
        checked = {"compute_kernels": kernels}
        if plan.precision is Precision.int8:
            checked["int8_check"] = int8_check(kernels)
        return CompiledModel(
            backend=self.name, path=package, precision=precision, device=self.device,
            providers=[f"aotinductor-{'cuda' if self.device.startswith('cuda') else 'cpu'}"],
            threads=recipe.benchmark.threads or available_cpus(), build_seconds=time.perf_counter() - started,
            settings={"torch_version": torch.__version__, "device": self.device, "keep_fp32": plan.keep_fp32,
                      "dtype": REDUCED_DTYPES.get(plan.precision,
                                                  "float32" if plan.precision is Precision.fp32 else "int8"),
                      "io_dtype": "float32", "dynamic_batch": {n: a for n,
                                                               a in self._batch_axes.items() if a is not None},
                      "max_batch": MAX_BATCH, "aoti": metadata, "tf32": False,
                      "package_reused": reused,
                      "inputs": [s.model_dump(mode="json") for s in self._inputs], "output_names": self._output_names,
                      **checked},
        )

    def _examples(self, torch: Any, shapes: dict[str, list[int]]) -> list[Any]:
        """Example inputs at the deployed shapes, the batch axis at 2 or more (torch.export specializes a size of 1)."""
        examples = []
        rng = np.random.default_rng(0)
        for spec in self._inputs:
            shape = list(shapes.get(spec.name) or [d if isinstance(d, int) and d > 0 else 1 for d in spec.shape])
            axis = self._batch_axes.get(spec.name)
            if axis is not None:
                shape[axis] = max(2, shape[axis])
            dtype = np.dtype(spec.dtype)
            array = rng.standard_normal(shape).astype(dtype) if dtype.kind == "f" else np.zeros(shape, dtype)
            examples.append(torch.from_numpy(array))
        return examples

    def _dynamic_shapes(self, torch: Any) -> tuple:
        batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
        return tuple({axis: batch} if (axis := self._batch_axes.get(s.name)) is not None else None
                     for s in self._inputs)

    def _export(self, torch: Any, module: Any, examples: list[Any]) -> Any:
        dynamic = self._dynamic_shapes(torch)
        parameters = list(inspect.signature(module.forward).parameters.values())
        if len(parameters) == 1 and parameters[0].kind is inspect.Parameter.VAR_POSITIONAL:
            dynamic = (dynamic,)  # forward(*args): torch.export sees one tuple argument
        try:
            return torch.export.export(module, tuple(examples), dynamic_shapes=dynamic)
        except Exception as exc:  # noqa: BLE001 - torch.export's trace errors are many types; the reason is the line
            raise Unsupported(f"torch.export cannot trace the module: {type(exc).__name__}: {first_line(exc)}") from exc

    def _quantize(self, torch: Any, program: Any, examples: list[Any]) -> Any:
        """PT2E static int8 (X86InductorQuantizer's default: u8 activations, s8 per-channel weights), calibrated on
        the build's calibration samples, exported again for AOTInductor."""
        support = self.supports(Precision.int8)
        if not support:
            raise Unsupported(f"--precision int8 on torch: {support.reason}")
        import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as x86
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

        quantizer = x86.X86InductorQuantizer().set_global(x86.get_default_x86_inductor_quantization_config())
        prepared = prepare_pt2e(program.module(), quantizer)
        with torch.no_grad():
            for sample in self._calibration:
                prepared(*[torch.from_numpy(np.ascontiguousarray(sample[s.name])) for s in self._inputs])
        return self._export(torch, convert_pt2e(prepared), examples)

    def runner(self, compiled: CompiledModel) -> AotiRunner:
        inputs = [TensorSpec(**spec) for spec in compiled.settings["inputs"]]
        return AotiRunner(compiled.path, inputs, compiled.settings["output_names"], threads=compiled.threads,
                          device=compiled.device, name=f"torch-{compiled.precision.value}")

    def synchronize(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(self.device)


