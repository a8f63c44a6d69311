"""What a precision transform did, as data: the build's `precision` record (its own module, so the transforms
and the fallback can import it without importing the package's entry point, which imports them)."""

from __future__ import annotations

from pydantic import BaseModel

from accel_opt.recipe.types import Precision


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
