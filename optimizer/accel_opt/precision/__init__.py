"""Precision as graph transforms: the model a backend compiles already carries its precision.

`transform()` is the single entry point the pipeline calls. fp16/bf16 rewrite tensor types with a
block list kept in fp32 (fp16.py); int8 inserts calibrated QuantizeLinear/DequantizeLinear pairs
(int8.py, with calibration.py adapting samples to ONNX Runtime's calibration contract), or, with
`calibration.quantizer: nncf`, NNCF quantizes the OpenVINO model and the build ships its IR (nncf_openvino.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from accel_opt.data import Sample
from accel_opt.machine.cpu import CpuProfile
from accel_opt.precision.report import CalibrationReport, KeptNode, PrecisionReport
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.types import Precision

__all__ = ["CalibrationReport", "KeptNode", "PrecisionReport", "transform", "written_path"]


def transform(
    model_path: Path,
    precision: Precision,
    recipe: Recipe,
    backend_name: str,
    calibration_samples: list[Sample],
    out_path: Path,
    cache_dir: Path | None,
    cpu: CpuProfile,
    keep_float: Sequence[str] = (),
) -> PrecisionReport:
    """Write the `precision` version of `model_path` to `written_path(out_path, ...)` (validated: checker + session
    load). `keep_float`: nodes kept in fp32 besides the recipe's block lists (the fallback's choice)."""
    if precision in (Precision.fp16, Precision.bf16):
        from accel_opt.precision.fp16 import convert_float

        options = recipe.precision_options
        if keep_float:
            options = options.model_copy(update={"block_nodes": [*options.block_nodes, *keep_float]})
        return convert_float(model_path, precision, options, out_path)
    if _by_nncf(precision, recipe):
        from accel_opt.precision.nncf_openvino import quantize_ir

        return quantize_ir(model_path, calibration_samples, recipe.precision_options.calibration, backend_name,
                           written_path(out_path, precision, recipe), exclude=keep_float)
    if precision is Precision.int8:
        from accel_opt.precision.int8 import quantize

        return quantize(model_path, calibration_samples, recipe.precision_options.calibration, backend_name, out_path,
                        cache_dir, cpu, exclude=keep_float)
    raise ValueError(f"no transform for {precision.value}")


def written_path(out_path: Path, precision: Precision, recipe: Recipe) -> Path:
    """Where `transform(..., out_path)` writes: `out_path`, or its OpenVINO IR (.xml, beside it) where NNCF quantizes.
    """
    return Path(out_path).with_suffix(".xml") if _by_nncf(precision, recipe) else Path(out_path)


def _by_nncf(precision: Precision, recipe: Recipe) -> bool:
    return precision is Precision.int8 and recipe.precision_options.calibration.quantizer == "nncf"
