"""The precision stage of a torch build: a plan (precision and the submodules kept in float32) that the torch backend's
compile() applies to the module before torch.export, instead of a rewritten ONNX graph.

When a bf16/fp16 plan fails the recipe's tolerance and task metrics on the steering samples, the same measured search
as the ONNX path's (precision/search.py) grows its block list: the units are groups of same-shaped leaf modules
(the same layer of every repeated block), each measured restored to float32 alone, then added by measured gain and
pruned. Its builds are the module transformed in eager PyTorch, judged against the eager fp32 module: compiling a
package per variant would cost a minute each on a CPU. The compiled package is what the gate then judges, and the
search does not time its variants (eager speed says nothing of Inductor's kernels): the build's benchmark does."""

from __future__ import annotations

import math
import time
from pathlib import Path

from accel_opt.backends.torch.package import PLAN_SUFFIX, REDUCED_DTYPES, PrecisionPlan, write_plan
from accel_opt.builder.context import BuildSoFar, Reduced
from accel_opt.precision.callbacks import SearchActions
from accel_opt.precision.fallback import STEERING_MARGIN, FallbackReport, VariantVerdict, stricter
from accel_opt.precision.report import KeptNode, PrecisionReport
from accel_opt.precision.search import Build, Unit, search
from accel_opt.recipe.types import Precision
from accel_opt.report.results import StageStatus


def torch_precision(ctx: BuildSoFar) -> tuple[StageStatus, str, dict[str, Reduced]]:
    """Write the plan the compile stage exports (grown by the search when it fails on the steering samples); record what
    it does."""
    precision, config = ctx.recipe.precision, ctx.recipe.precision_options.fallback
    plan, searched = PrecisionPlan(precision=precision), None
    if precision is Precision.int8:
        transform = ("PT2E static int8 (X86InductorQuantizer: uint8 activations, int8 per-channel weights), "
                     f"calibrated on {len(ctx.dealt.samples.calibration)} samples")
    else:
        transform = (f"{REDUCED_DTYPES[precision]} weights and compute (module transform before torch.export), "
                     "float32 inputs and outputs")
        if config.enabled:
            plan, searched = _fallback(ctx, plan)
    opset = ctx.loaded.model.opset
    report = PrecisionReport(precision=precision, transform=transform, opset_before=opset, opset_after=opset,
                             keep_io_types=True, kept_in_higher_precision=list(searched.kept if searched else []))
    reduced = Reduced(candidate_path=write_plan(ctx.setup.workdir / f"{precision.value}{PLAN_SUFFIX}", plan),
                      precision=report, fallback=searched)
    detail = f"{transform}; {len(plan.keep_fp32)} submodules kept in float32"
    return "passed", detail + (f"; fallback {searched.status}" if searched else ""), {"reduced": reduced}


def _fallback(ctx: BuildSoFar, plan: PrecisionPlan) -> tuple[PrecisionPlan, FallbackReport]:
    """The naive plan judged on the steering samples; the search when it fails. Returns the plan and the report."""
    from accel_opt.accuracy import compare
    from accel_opt.backends.torch.modules import leaf_modules, precision_module
    from accel_opt.backends.torch.runner import TorchRunner

    config = ctx.recipe.precision_options.fallback
    steering = ctx.dealt.samples.steering[: config.steering_samples]  # never the held-out samples, which judge
    names = [o.name for o in ctx.loaded.outputs]
    report = FallbackReport(status="not needed", reason="", precision=plan.precision.value,
                            steering_samples=len(steering),
                            steering_source="steering samples (eager PyTorch)", max_rounds=config.max_rounds,
                            max_fp32_flops_fraction=config.max_fp32_flops_fraction, time_budget_s=config.time_budget_s,
                            min_speedup=config.min_speedup, steering_slack=STEERING_MARGIN)
    tolerance, metrics, hopeless = ctx.steering_gate()
    if hopeless or not steering:
        report.status = "insufficient evidence" if hopeless else "disabled"
        report.reason = (f"not searched: {hopeless[0]}, so no plan it found could sign off" if hopeless else
                         "not searched: no steering samples to judge plans on (give --data with more samples)")
        return plan, report
    tolerance = stricter(tolerance)

    reference = TorchRunner(ctx.torch_module, ctx.loaded.inputs, names, threads=ctx.setup.threads,
                            name="reference-pytorch")
    reference_outputs: list[dict] = []  # the eager fp32 module's, run once: every variant is judged against them

    def build_and_judge(keep: list[str], path: Path, calibration: str | None = None) -> Build:
        candidate = TorchRunner(precision_module(ctx.torch_module, plan.precision, keep), ctx.loaded.inputs, names,
                                threads=ctx.setup.threads, name=f"eager-{plan.precision.value}")
        verdict = compare(reference, candidate, steering, tolerance, metrics, batch_axes=ctx.shapes.batch_axes,
                          reference_outputs=reference_outputs or None)
        reference_outputs[:] = verdict._reference_outputs
        write_plan(path.with_suffix(PLAN_SUFFIX), PrecisionPlan(precision=plan.precision, keep_fp32=keep))
        return Build(path=path, loss=verdict.loss, passed=verdict.passed, failures=verdict.failures[:3],
                     worst_cosine=verdict.worst_cosine)

    naive = build_and_judge([], ctx.setup.workdir / "naive")
    report.naive = VariantVerdict(passed=naive.passed, worst_cosine=naive.worst_cosine, failures=naive.failures,
                                loss=naive.loss)
    if naive.passed:
        report.reason = "the plan passes the recipe's tolerance on the steering samples"
        return plan, report
    groups: dict[str, list[str]] = {}
    for name, module in leaf_modules(ctx.torch_module):
        shapes = "x".join("x".join(map(str, p.shape)) for p in module.parameters(recurse=False))
        groups.setdefault(f"{type(module).__name__} {shapes}", []).append(name)
    units = [Unit(key=key, nodes=members) for key, members in groups.items()][: config.max_measured_units]
    started = time.monotonic()
    limits = ctx.setup.limits
    budget_s = limits.search_budget_s if limits is not None else config.time_budget_s
    found = search(naive, units, SearchActions(build_and_judge=build_and_judge, speedup=lambda path: None),
                   ctx.setup.workdir / "search", time_budget_s=budget_s, min_speedup=config.min_speedup,
                   max_additions=config.max_rounds, on_step=limits.on_step if limits is not None else None)
    report.search_seconds = round(time.monotonic() - started, 1)
    report.status, report.reason, report.steps = found.status, found.reason, found.steps
    report.kept = [KeptNode(node=n, op_type=_unit_of(n, units), reason="restored to float32 by the measured search")
                   for n in found.kept]
    return (PrecisionPlan(precision=plan.precision, keep_fp32=found.kept) if math.isfinite(found.best.loss) else plan,
            report)


def _unit_of(node: str, units: list[Unit]) -> str:
    return next((u.key.split(" ")[0] for u in units if node in u.nodes), "")
