"""OpenVINO's compile layer: precision hints and what the CPU supports, reading and compiling a model (static or
dynamic shapes), and reading back which precision each layer really runs, so what ran is recorded, not what was asked.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from accel_opt.errors import InputRejected, Unsupported, first_line
from accel_opt.machine.cpu import BF16_FLAGS, FP16_FLAGS
from accel_opt.machine.support import Availability
from accel_opt.recipe.types import Precision

log = logging.getLogger(__name__)

DEVICE = "CPU"

# The hint per precision. int8: quantized ops run int8 as the Q/DQ nodes say; the rest stays f32,
# because a bf16 remainder would be a precision change the graph does not ask for.
HINTS = {Precision.fp32: "f32", Precision.bf16: "bf16", Precision.fp16: "f16", Precision.int8: "f32"}

NATIVE_FLAGS = {Precision.bf16: BF16_FLAGS, Precision.fp16: FP16_FLAGS}

CAPABILITY = {Precision.bf16: "BF16", Precision.fp16: "FP16"}

ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4")  # flags that change which kernels a blob holds

READ_BACK = ("PERFORMANCE_HINT", "NUM_STREAMS", "INFERENCE_NUM_THREADS", "EXECUTION_MODE_HINT", "ENABLE_CPU_PINNING")

COMPUTE_LAYERS = ("Convolution", "FullyConnected", "MatMul", "Deconvolution", "GroupConvolution")

def isa_flags(flags: frozenset[str]) -> list[str]:
    return sorted(f for f in flags if f.startswith(ISA_PREFIXES))

def precision_support(precision: Precision, flags: frozenset[str], capabilities: tuple[str, ...] = ()) -> Availability:
    """Whether `precision` runs natively here, from CPU flags and OpenVINO's OPTIMIZATION_CAPABILITIES.

    bf16/fp16 need the CPU instructions (emulation would be slower than fp32) and the runtime's
    agreement; where flags are unknown (not Linux), the runtime's capabilities decide alone.
    """
    if precision in (Precision.fp32, Precision.int8):
        return Availability(True)
    wanted = NATIVE_FLAGS[precision]
    has_flag = bool(flags & wanted) if flags else CAPABILITY[precision] in capabilities
    runtime_ok = not capabilities or CAPABILITY[precision] in capabilities
    if has_flag and runtime_ok:
        return Availability(True)
    what = " or ".join(f.upper().replace("_", "-") for f in sorted(wanted))
    if not has_flag:
        reason = (f"this CPU has no native {precision.value} ({what} missing); OpenVINO would emulate it, slower "
                  "than fp32")
    else:
        reason = (f"this OpenVINO CPU plugin does not offer {CAPABILITY[precision]} here (capabilities: "
                  f"{', '.join(capabilities)})")
    hint = ("use --precision int8 or fp32" if precision is Precision.bf16
            else "fp16 is a GPU precision; use bf16 or int8")
    return Availability(False, f"{reason}; {hint}")

@lru_cache(maxsize=1)
def _core():
    import openvino as ov

    return ov.Core()

def capabilities() -> tuple[str, ...]:
    return tuple(_core().get_property(DEVICE, "OPTIMIZATION_CAPABILITIES"))

def _read(onnx_path: Path):
    """The openvino.Model of an ONNX file (or OpenVINO IR)."""
    try:
        return _core().read_model(str(onnx_path))
    except Exception as exc:  # OpenVINO raises RuntimeError subclasses from C++
        raise InputRejected(f"OpenVINO could not read {Path(onnx_path).name}: {first_line(exc)}") from None

def _compile_model(model, config: dict[str, str], static_shapes: dict[str, list[int]] | None):
    """Compile `model` (left unchanged) on the CPU; with `static_shapes`, a reshaped copy of it."""
    if static_shapes:
        names = {n for i in model.inputs for n in i.get_names()}
        unknown = sorted(set(static_shapes) - names)
        if unknown:
            raise InputRejected(f"shapes given for unknown inputs {unknown}; the model has {sorted(names)}")
        model = model.clone()
        try:
            model.reshape({name: list(dims) for name, dims in static_shapes.items()})
        except Exception as exc:
            raise InputRejected(f"OpenVINO cannot reshape the model to {static_shapes}: {first_line(exc)}") from None
    try:
        return _core().compile_model(model, DEVICE, config)
    except Exception as exc:
        raise Unsupported(f"OpenVINO CPU cannot compile this model: {first_line(exc)}") from None

def _compile(onnx_path: Path, config: dict[str, str], static_shapes: dict[str, list[int]] | None):
    return _compile_model(_read(onnx_path), config, static_shapes)

def execution_precisions(compiled) -> dict[str, dict[str, int]]:
    """{layer type: {runtime precision: count}} from the executed graph (constants left out)."""
    return _runtime_counts(compiled, "runtimePrecision")

def compute_kernels(compiled) -> dict[str, dict[str, int]]:
    """{compute layer type: {kernel: count}}, e.g. brgconv_avx512_amx_I8: which ISA really runs the math."""
    return _runtime_counts(compiled, "primitiveType", COMPUTE_LAYERS)

def _runtime_counts(compiled, key: str, layers: tuple[str, ...] | None = None) -> dict[str, dict[str, int]]:
    counts: dict[str, Counter] = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        layer = info["layerType"].astype(str)
        if layer == "Const" or (layers is not None and layer not in layers):
            continue
        counts.setdefault(layer, Counter())[info[key].astype(str)] += 1
    return {layer: dict(sorted(c.items())) for layer, c in sorted(counts.items())}

def _onnx_io_names(compiled, onnx_path: Path) -> tuple[list[str], list[str]]:
    """Input/output names as the ONNX graph spells them (an OpenVINO port may carry several names)."""
    import onnx

    wanted: set[str] = set()
    if onnx_path.suffix == ".onnx":  # an OpenVINO IR (.xml) keeps its own names
        graph = onnx.load(str(onnx_path), load_external_data=False).graph
        wanted = {v.name for v in graph.input} | {v.name for v in graph.output}

    def pick(port) -> str:
        return next((n for n in sorted(port.get_names()) if n in wanted), port.get_any_name())

    return [pick(p) for p in compiled.inputs], [pick(p) for p in compiled.outputs]

def _verify_precision(compiled, precision: Precision) -> dict[str, dict[str, int]]:
    """Read back what runs; refuse an fp32 build with non-f32 compute or an int8 build without int8."""
    actual = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
    if actual != HINTS[precision]:
        raise Unsupported(f"OpenVINO runs {actual} although {HINTS[precision]} was requested for {precision.value}")
    by_layer = execution_precisions(compiled)
    compute = {k: v for k, v in by_layer.items() if k in COMPUTE_LAYERS}
    if precision is Precision.fp32 and any(set(v) - {"f32"} for v in compute.values()):
        raise Unsupported(f"OpenVINO fp32 build runs compute layers in other precisions: {compute}")
    if precision is Precision.int8 and not any(set(v) & {"u8", "i8"} for v in compute.values()):
        raise Unsupported(f"OpenVINO ran no compute layer in int8 (Q/DQ pattern not recognised): {compute}")
    return by_layer

@dataclass(frozen=True)
class StaticCompiler:
    """Builds one static compile per input-shape signature, with the build's config, each verified."""

    path: Path
    config: dict[str, str]
    precision: Precision

    def read(self):
        return _read(self.path)

    def compile(self, model, shapes: dict[str, list[int]]):
        compiled = _compile_model(model, self.config, shapes)
        _verify_precision(compiled, self.precision)
        return compiled
