"""Precision as graph transforms: the model a backend compiles already carries its precision.

`transform()` is the single entry point the pipeline calls. fp16/bf16 rewrite tensor types with a
block list kept in fp32 (fp16.py); int8 inserts calibrated QuantizeLinear/DequantizeLinear pairs
(int8.py, with calibration.py adapting samples to ONNX Runtime's calibration contract).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel

from accel_opt.data import Sample
from accel_opt.recipe import Precision, Recipe


class KeptNode(BaseModel):
    node: str
    op_type: str
    reason: str


class CalibrationReport(BaseModel):
    method: str  # minmax / entropy / percentile
    preset: str  # ort_cpu / tensorrt
    preset_reason: str  # the hardware reason, as written in the preset
    activation_type: str  # uint8 / int8
    weight_type: str
    per_channel: bool
    symmetric_activations: bool
    sample_count: int
    target_cpu: str = "host"  # the CPU class the integer ranges were chosen for
    reduce_range: bool = False  # 7-bit weights
    reduce_range_reason: str = ""
    seconds: float
    cache_hit: bool
    cache_key: str


class PrecisionReport(BaseModel):
    precision: Precision
    transform: str  # what was done, in words
    opset_before: int
    opset_after: int
    keep_io_types: bool
    kept_in_higher_precision: list[KeptNode] = []
    calibration: CalibrationReport | None = None
    seconds: float = 0.0
    notes: list[str] = []


def transform(
    model_path: Path,
    precision: Precision,
    recipe: Recipe,
    backend_name: str,
    calibration_samples: list[Sample],
    out_path: Path,
    cache_dir: Path | None,
    keep_float: Sequence[str] = (),
) -> PrecisionReport:
    """Write the `precision` version of `model_path` to `out_path` (validated: checker + session load).
    `keep_float`: nodes kept in fp32 besides the recipe's block lists (the fallback's choice)."""
    if precision in (Precision.fp16, Precision.bf16):
        from accel_opt.precision.fp16 import convert_float

        options = recipe.precision_options
        if keep_float:
            options = options.model_copy(update={"block_nodes": [*options.block_nodes, *keep_float]})
        return convert_float(model_path, precision, options, out_path)
    if precision is Precision.int8:
        from accel_opt.precision.int8 import quantize

        return quantize(model_path, calibration_samples, recipe.precision_options.calibration, backend_name, out_path,
                        cache_dir, exclude=keep_float)
    raise ValueError(f"no transform for {precision.value}")
