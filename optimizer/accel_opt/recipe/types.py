"""The enumerations every recipe key names (precisions, backends, calibration methods, int8 targets, CPU
classes) and the strict base every recipe section derives from (unknown keys refused)."""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import BaseModel, ConfigDict


class Precision(str, enum.Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"
    int8 = "int8"


class BackendName(str, enum.Enum):
    onnxruntime = "onnxruntime"
    openvino = "openvino"
    tensorrt = "tensorrt"
    torch = "torch"  # PyTorch 2: torch.export + AOTInductor, for models given as a PyTorch factory


class CalibrationMethod(str, enum.Enum):
    minmax = "minmax"
    entropy = "entropy"
    percentile = "percentile"


class QuantTarget(str, enum.Enum):
    """Which hardware the Q/DQ graph is tuned for (see optimizer/accel_opt/precision/int8_presets.py)."""

    auto = "auto"  # follows the backend
    ort_cpu = "ort_cpu"
    openvino = "openvino"
    tensorrt = "tensorrt"


class _Strict(BaseModel):
    # Every recipe number is finite: YAML's .nan/.inf would pass a bound like ge=0 (inf) or none at all (nan, which
    # compares false either way) and surface as a crash far from the recipe.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


ErrorStat = Literal["mean", "median", "max"]
# CPU kernel classes (accel_opt.machine.cpu.CPU_CLASSES plus the non-x86 ones), or "host": this machine's.
TargetCpu = Literal["host", "avx2", "avx512", "avx_vnni", "avx512_vnni", "amx", "arm64", "other"]
