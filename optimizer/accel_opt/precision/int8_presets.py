"""int8 presets: the integer types and Q/DQ placement each target's kernels want, and the weights' range for the
CPU class the build targets. Each constraint is explained where it is set."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from accel_opt.errors import Unsupported
from accel_opt.machine.cpu import CpuProfile, saturating_int8
from accel_opt.recipe.stages import CalibrationConfig
from accel_opt.recipe.types import QuantTarget


@dataclass(frozen=True)
class QuantPreset:
    """Integer types and Q/DQ placement for one kind of hardware; `reason` says why."""

    name: str
    reason: str
    activation_type: Literal["uint8", "int8"]
    weight_type: Literal["int8"]
    symmetric_activations: bool
    symmetric_weights: bool
    keep_removable_activations: bool  # Relu/Clip stay explicit instead of folding into the Q range
    dedicated_qdq_pairs: bool  # one Q/DQ pair per consumer instead of one shared pair
    quantize_bias: bool  # int32 bias through a DequantizeLinear, or float bias
    symmetric_signed_inputs: bool = False  # graph inputs that go negative: symmetric int8 instead of activation_type


# ORT's CPU EP runs u8 activations x s8 weights on its VNNI/AMX integer GEMM kernels; signed
# activations (quantize_static's default) take a slower path: measured here, ResNet-50 batch 8:
# fp32 163 ms, u8/s8 59 ms, s8/s8 201 ms. Per-channel s8 weights cost no speed and keep
# accuracy; asymmetric u8 lets Relu fold into the quantization range (zero point at 0).
ORT_CPU = QuantPreset(
    name="ort_cpu",
    # A reason is printed into every user's sign-off: it says why, never a speed measured on some other machine
    # (the build's own benchmark states this build's speed).
    reason="ONNX Runtime CPU EP: uint8 activations x int8 per-channel weights run on its u8s8 integer kernels; "
    "int8 activations take a path slower than fp32",
    activation_type="uint8",
    weight_type="int8",
    symmetric_activations=False,
    symmetric_weights=True,
    keep_removable_activations=False,
    dedicated_qdq_pairs=False,
    quantize_bias=True,
)

# TensorRT's explicit quantization accepts only symmetric int8 (zero point 0) for activations and
# weights. A dedicated Q/DQ pair per consumer lets TensorRT fuse each pair into the layer after it
# (as optimum's AutoQuantizationConfig.tensorrt() does); biases stay float, as ModelOpt emits them,
# since TensorRT folds them into its int8 kernels; Relu stays explicit so the graph stays correct
# when TensorRT runs a layer in higher precision and drops its Q/DQ pair.
TENSORRT = QuantPreset(
    name="tensorrt",
    reason="TensorRT explicit quantization: symmetric int8 activations and weights (zero point 0), "
    "a dedicated Q/DQ pair per consumer for layer fusion, float biases",
    activation_type="int8",
    weight_type="int8",
    symmetric_activations=True,
    symmetric_weights=True,
    keep_removable_activations=True,
    dedicated_qdq_pairs=True,
    quantize_bias=False,
)

# OpenVINO runs the ort_cpu graph on its AMX u8s8 kernels too, but a uint8 input with a non-zero zero
# point (a normalized image) costs it zero-point compensation in the first convolution: ResNet-50's
# stem took 3.4 ms vs 1.8 ms with symmetric int8 input at batch 8 here (NNCF quantizes it that way),
# 3-5% of the whole model. On ORT's CPU EP an int8 input would take its slow s8s8 path instead.
OPENVINO = dataclasses.replace(
    ORT_CPU,
    name="openvino",
    reason="OpenVINO CPU: uint8 activations x int8 per-channel weights on its integer kernels, and graph "
    "inputs that go negative as symmetric int8, which spares the first layer zero-point compensation",
    symmetric_signed_inputs=True,
)

PRESETS = {QuantTarget.ort_cpu: ORT_CPU, QuantTarget.openvino: OPENVINO, QuantTarget.tensorrt: TENSORRT}
_AUTO = {"onnxruntime": QuantTarget.ort_cpu, "openvino": QuantTarget.openvino, "tensorrt": QuantTarget.tensorrt}


def weight_range(preset: QuantPreset, config: CalibrationConfig, cpu: CpuProfile) -> tuple[str, bool, str]:
    """(target CPU class, reduce_range, why) for the int8 weights; `target_cpu: host` means the class whose kernels
    the preset's backend runs on `cpu` (oneDNN's ISA cap lowers OpenVINO's).

    ONNX Runtime's MLAS and oneDNN (OpenVINO) run u8 x s8 on AVX2 and on AVX-512 without VNNI with VPMADDUBSW,
    which sums each pair of products into int16 and saturates (255 * 127 * 2 = 64770 > 32767); ORT's
    quantization guide and NNCF's overflow_fix answer it with 7-bit weights (255 * 63 * 2 = 32130). VNNI and AMX
    accumulate in int32: full 8-bit weights there. Measured on an AVX2 CPU, EfficientNet-Lite0 int8 (per-channel,
    64 photos) kept top-1 on 52% of 300 held-out photos with 8-bit weights, 66% with 7-bit ones."""
    target = cpu.kernel_class(preset.name) if config.target_cpu == "host" else config.target_cpu
    if preset.name == TENSORRT.name:
        return target, bool(config.reduce_range), "TensorRT runs int8 on the GPU: the host CPU's kernels do not apply"
    if config.reduce_range is not None:
        return (target, config.reduce_range,
                f"set by the recipe (precision_options.calibration.reduce_range: {config.reduce_range})")
    if saturating_int8(target):
        return target, True, (f"{target} CPU: its u8 x s8 kernels sum pairs in int16 (VPMADDUBSW) and saturate with "
                              "8-bit weights; 7-bit weights keep the pair sums in range")
    return (target, False,
            f"{target} CPU: its int8 kernels accumulate in int32 (VNNI/AMX or non-x86): full 8-bit weights")


def resolve_preset(target: QuantTarget, backend_name: str) -> QuantPreset:
    """`auto` follows the backend: ONNX Runtime -> ort_cpu (u8s8), OpenVINO -> openvino, TensorRT -> tensorrt."""
    if target is QuantTarget.auto:
        if backend_name not in _AUTO:
            raise Unsupported(f"no int8 preset for backend {backend_name!r}; set precision_options.calibration.target")
        target = _AUTO[backend_name]
    return PRESETS[target]
