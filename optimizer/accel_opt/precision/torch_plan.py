"""The precision stage of a torch build: a plan (precision and the submodules kept in float32) that the torch backend's
compile() applies to the module before torch.export, instead of a rewritten ONNX graph."""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel_opt.backends.torch_package import PLAN_SUFFIX, REDUCED_DTYPES, PrecisionPlan, write_plan
from accel_opt.precision.report import PrecisionReport
from accel_opt.recipe import Precision
from accel_opt.report.results import StageStatus

if TYPE_CHECKING:
    from accel_opt.build_context import BuildContext


def torch_precision(ctx: BuildContext) -> tuple[StageStatus, str]:
    """Write the plan the compile stage exports; record what it does in the build's precision report."""
    precision = ctx.recipe.precision
    plan = PrecisionPlan(precision=precision)
    ctx.candidate_path = write_plan(ctx.workdir / f"{precision.value}{PLAN_SUFFIX}", plan)
    if precision is Precision.int8:
        transform = ("PT2E static int8 (X86InductorQuantizer: uint8 activations, int8 per-channel weights), "
                     f"calibrated on {len(ctx.calibration_samples)} samples")
    else:
        transform = (f"{REDUCED_DTYPES[precision]} weights and compute (module transform before torch.export), "
                     "float32 inputs and outputs")
    ctx.precision = PrecisionReport(precision=precision, transform=transform, opset_before=ctx.loaded.opset,
                                    opset_after=ctx.loaded.opset, keep_io_types=True)
    return "passed", f"{transform}; {len(plan.keep_fp32)} submodules kept in float32"
