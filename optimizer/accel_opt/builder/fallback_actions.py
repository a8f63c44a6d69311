"""The fallback's actions for one build: how it builds a variant (the recipe's transform), judges it (the gate's
tolerance on the steering samples, on the build's backend and, for int8, with Q/DQ emulated in float), diagnoses it
layer by layer and counts its FLOPs. fallback.py decides what to keep; this wires those decisions to the build's
context."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from accel_opt import runtime
from accel_opt.accuracy import compare
from accel_opt.backends import compile_for
from accel_opt.backends.base import casting_inputs
from accel_opt.backends.onnxruntime.backend import OnnxRuntimeBackend, float_run_quantized_ops, reference_runner
from accel_opt.bench import Target, run_benchmark
from accel_opt.bench.efficiency import node_flops
from accel_opt.data import Sample
from accel_opt.errors import first_line
from accel_opt.graph.inspect import io_specs, with_batch
from accel_opt.precision import fallback, transform, written_path
from accel_opt.precision.callbacks import Actions
from accel_opt.precision.diagnose import Diagnosis, diagnose, emulate_bfloat16
from accel_opt.precision.remedies import ModelSize, plan
from accel_opt.precision.report import PrecisionReport
from accel_opt.recipe.stages import BenchmarkConfig
from accel_opt.recipe.types import Precision

if TYPE_CHECKING:
    from accel_opt.builder.context import BuildSoFar

log = logging.getLogger(__name__)

# The search's speed check: short, interleaved rounds of the build and its fp32 at the deployed batch.
SPEED_CHECK = BenchmarkConfig(warmup_iterations=3, min_iterations=20, min_seconds=0.5, max_iterations=400)


def fallback_actions(ctx: BuildSoFar, steering: list[Sample], shapes: dict[str, list[int]]) -> Actions:
    """The fallback's build / judge / diagnose: the recipe's transform, the gate's tolerance on the steering samples
    run on the build's backend (compiled for `shapes`), and the per-layer diagnosis on ONNX Runtime (bf16 emulated)."""
    precision, recipe = ctx.recipe.precision, ctx.recipe
    cache_dir = ctx.setup.cache_dir
    calibration_cache = cache_dir / "calibration" if cache_dir else None

    gate, metrics, _ = ctx.steering_gate()  # the rates the held-out verdict can certify
    tolerance = (fallback.stricter(gate), metrics)
    encoder = ctx.loaded.text_encoder
    padding = encoder.padding if encoder is not None else None  # texts of several lengths
    timed = padding.same_length(steering) if padding is not None else steering  # timed batches have one shape
    # the first steering samples'
    steering_labels = ctx.steering_labels[:len(steering)] if ctx.steering_labels else None

    def chosen(overrides: dict | None):
        return recipe.with_overrides(**overrides) if overrides else recipe

    def build(keep: list[str], out: Path, overrides: dict | None = None) -> PrecisionReport:
        return transform(ctx.fp32_path, precision, chosen(overrides), ctx.setup.backend.name,
                         ctx.dealt.samples.calibration, out, calibration_cache, ctx.setup.cpu, keep_float=keep)

    # The fp32 model's outputs and float32 noise on the steering samples: measured once, every build of the search
    # reuses them.
    noise_floor: dict[str, float] = {}
    reference_outputs: list[dict] = []

    def verdict(candidate) -> fallback.VariantVerdict:
        result = compare(reference_runner(ctx.fp32_path, ctx.setup.threads), candidate, steering, *tolerance,
                         batch_size=ctx.deploy_batch,
                         batch_axes=ctx.shapes.batch_axes, noise_floor=noise_floor or None,
                         noise_reference=None if noise_floor
                         else reference_runner(ctx.fp32_path, ctx.setup.threads, optimize=True),
                         reference_outputs=reference_outputs or None, padding=padding, labels=steering_labels,
                         labels_config=recipe.accuracy.labels)
        noise_floor.update({o.name: o.noise_floor for o in result.outputs})
        reference_outputs[:] = result._reference_outputs
        return fallback.VariantVerdict(passed=result.passed, worst_cosine=result.worst_cosine,
                                     failures=result.failures[:3],
                                     loss=result.loss, output_loss=result.output_loss, changed=result.changed_samples)

    compiled: dict[Path, object] = {}  # each build compiled once: judged, then perhaps timed

    def deployed_runner(path: Path, as_precision: Precision = precision):
        if path not in compiled:
            compiled[path] = compile_for(ctx.setup.backend, path, as_precision, recipe,
                                         ctx.setup.workdir / "variants" / path.stem, shapes)
        graph = path if fallback.is_onnx(path) else ctx.fp32_path  # NNCF's IR keeps the fp32 model's inputs
        deployed = {spec.name: spec.dtype for spec in io_specs(onnx.load(str(graph), load_external_data=False))[0]}
        return casting_inputs(ctx.setup.backend.runner(compiled[path]), runtime.feed_dtypes_of(steering), deployed)

    def judge(path: Path) -> fallback.VariantVerdict:
        return verdict(deployed_runner(path))

    def speedup(path: Path) -> float | None:
        """The build against the same backend's fp32 build, on the deployed kernels at the deployed batch, timed
        interleaved (the host's noise hits both alike): fp32's p50 over the build's."""
        targets = [Target("candidate", deployed_runner(path), ctx.setup.backend.synchronize),
                   Target("fp32", deployed_runner(ctx.fp32_path, Precision.fp32), ctx.setup.backend.synchronize)]
        report = run_benchmark(targets, timed, [ctx.deploy_batch], SPEED_CHECK, ctx.setup.threads,
                               ctx.shapes.batch_axes)
        candidate, fp32 = (m.batches[0].latency.p50_ms for m in report.models)
        return fp32 / candidate if candidate > 0 else None

    def judge_emulated(path: Path) -> fallback.VariantVerdict:  # Q/DQ in float, graph optimizations off: as diagnosed
        return verdict(reference_runner(path, ctx.setup.threads))

    def examine(path: Path) -> Diagnosis | None:
        if not fallback.is_onnx(path):  # NNCF's IR: the diagnosis runs ONNX graphs on ONNX Runtime
            return None
        if precision is Precision.bf16:
            (ctx.setup.workdir / "variants").mkdir(parents=True, exist_ok=True)
            path = emulate_bfloat16(path, ctx.setup.workdir / "variants" / f"emulated-{path.name}")
        return diagnose(ctx.fp32_path, path, steering[: recipe.precision_options.fallback.diagnosis_samples],
                        ctx.setup.threads)

    batch1 = with_batch(ctx.shapes.shapes, 1, ctx.shapes.batch_axes) if ctx.shapes.batch_dynamic else ctx.shapes.shapes

    counted: dict[Path, dict[str, int]] = {}  # the fp32 graph's: the remedies' plan and the fallback both read them

    def flops_of(path: Path) -> dict[str, int]:
        if path not in counted:
            try:
                counted[path] = node_flops(path, batch1)
            except (ValueError, RuntimeError, onnx.shape_inference.InferenceError) as exc:  # > 2 GB protos, odd graphs
                log.warning("no FLOP counts for the fallback budget: %s", first_line(exc))
                counted[path] = {}
        return counted[path]

    companions = None
    if precision is Precision.int8 and isinstance(ctx.setup.backend, OnnxRuntimeBackend):
        def companions(path: Path) -> list[str]:
            return float_run_quantized_ops(path, ctx.setup.threads)
    remedies = ()
    if precision is Precision.int8:  # planned cheapest first for this model's size
        calibration = recipe.precision_options.calibration
        size = ModelSize(gflops=sum(flops_of(ctx.fp32_path).values()) / 1e9,
                         calibration_samples=min(len(ctx.dealt.samples.calibration), calibration.samples))
        remedies = plan(calibration, ctx.setup.backend.name, ctx.fused, size)
    return Actions(build=build, judge=judge, diagnose=examine, flops_of=flops_of, companions=companions,
                   judge_emulated=judge_emulated if precision is Precision.int8 else None, speedup=speedup,
                   remedies=remedies, structure=ctx.fp32_path,
                   written=lambda path, overrides: written_path(path, precision, chosen(overrides)))
