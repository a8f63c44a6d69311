"""The build's benchmark stage, over the build's context: what is timed next to the deployment, the sweep and
capacity wiring, and the application's stages and whole jobs (the measuring itself lives in bench/)."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from accel_opt import runtime
from accel_opt.backends import compile_for
from accel_opt.backends.gpu_timing import last_stage_ms, median_stage_ms
from accel_opt.backends.onnxruntime.backend import OnnxRuntimeBackend
from accel_opt.bench import JobTiming, Target, application, deployment_target, run_benchmark
from accel_opt.bench.efficiency import efficiency
from accel_opt.bench.sweep import capacity, recommend, sweep, sweep_checks
from accel_opt.bench.text_capacity import length_capacity, lengths_to_measure
from accel_opt.data import Sample, batch_of, synthetic_samples
from accel_opt.errors import AccelOptError, UsageError, first_line
from accel_opt.graph.inspect import resolve_shapes, with_batch
from accel_opt.recipe.types import Precision
from accel_opt.report.results import StageStatus
from accel_opt.report.verdict import rounds_needed
from accel_opt.runtime.local.job import run_job

if TYPE_CHECKING:
    from accel_opt.builder.context import BuildContext

log = logging.getLogger(__name__)


def benchmark_build(ctx: BuildContext, unfused_shapes: dict[str, list[int]], image_input: str) -> tuple[StageStatus, str]:
    """The build's benchmark stage: the deployment next to the fp32 baseline (and the naive build, and PyTorch)
    interleaved; the concurrency and batch sweep, the recommendation and the capacity check; the application's
    stages and jobs on the --data files; efficiency against the FLOP count. It times ctx.samples.timed (texts
    padded to one length; the verdict's samples stay as the gate judged them). `unfused_shapes`: the deployed shapes
    without fused preprocessing (how the baselines compile); `image_input`: the input the naive job feeds."""
    targets = [deployment_target(ctx.deployment, runtime.feed_dtypes_of(ctx.samples.timed_deployed), samples=ctx.samples.timed_deployed)]
    if ctx.recipe.precision is not Precision.fp32:
        baseline = compile_for(ctx.backend, ctx.fp32_path, Precision.fp32, ctx.recipe, ctx.workdir / "baseline",
                               unfused_shapes)
        targets.append(Target(f"{ctx.backend.name}-fp32", ctx.backend.runner(baseline), ctx.backend.synchronize))
    if ctx.fallback is not None and ctx.fallback.kept:  # the fallback's speed cost, in the same interleaved run
        naive = compile_for(ctx.backend, ctx.workdir / ctx.fallback.naive_model, ctx.recipe.precision, ctx.recipe,
                            ctx.workdir / "naive-build", unfused_shapes)
        targets.append(Target(f"{ctx.backend.name}-{ctx.recipe.precision.value}-naive", ctx.backend.runner(naive),
                              ctx.backend.synchronize))
    if ctx.torch_module is not None:
        from accel_opt.backends.torch.backend import torch_runner

        targets.append(Target("pytorch-eager", torch_runner(ctx.torch_module, ctx.model_path, ctx.threads)))
    batch_sizes = ctx.recipe.benchmark.batch_sizes if ctx.shapes.batch_dynamic else [ctx.shapes.batch_size]
    if ctx.recipe.precision is not Precision.fp32:  # the verdict's benefit is read at the deployed batch: time it
        batch_sizes = sorted({*batch_sizes, ctx.deploy_batch})
    axes = ctx.shapes.batch_axes
    ctx.bench = run_benchmark(targets, ctx.samples.timed, batch_sizes, ctx.recipe.benchmark, ctx.threads, axes,
                              rounds=rounds_needed(ctx.recipe.accuracy.confidence))
    streams = getattr(ctx.backend, "concurrency_sweep", None)
    if streams is not None:  # streams x async requests: the concurrency a server would run
        feed = batch_of(ctx.samples.timed_deployed, ctx.deploy_batch, axes)
        ctx.bench.concurrency = streams(ctx.deployment.compiled, feed, seconds=max(0.2, ctx.recipe.benchmark.min_seconds / 2))
    config, dtypes = ctx.recipe.benchmark, runtime.feed_dtypes_of(ctx.samples.timed_deployed)
    ctx.bench.sweep = sweep(lambda: ctx.deployment.runner(dtypes), ctx.samples.timed_deployed, batch_sizes, config, axes,
                            ctx.backend.synchronize)
    ctx.bench.recommended, ctx.bench.recommendation = recommend(ctx.bench.sweep, config)
    ctx.bench.capacity = capacity(ctx.bench.sweep, config, lambda: ctx.deployment.runner(dtypes), ctx.max_feed,
                                  ctx.backend.synchronize)
    ctx.bench.checks = sweep_checks(ctx.bench.recommended, ctx.bench.recommendation, ctx.bench.capacity, config)
    if ctx.text_encoder is not None:  # activations grow with the tokens: a batch size per length
        encoder = ctx.text_encoder
        fill = {name: -1 if field == "ids" else 1 if field == "attention_mask" else 0
                for name, (field, _) in encoder.inputs.items()}
        ctx.bench.length_buckets = length_capacity(
            lambda: ctx.deployment.runner(dtypes), fill, encoder.tokenizer.get_vocab_size(),
            lengths_to_measure(encoder.stage.max_length, list(encoder.stage.length_buckets)), ctx.deploy_batch,
            max(config.concurrency), config.memory_budget_mib)
    application_times(ctx, batch_sizes, image_input)
    batch1 = with_batch(ctx.shapes.shapes, 1, axes) if ctx.shapes.batch_dynamic else ctx.shapes.shapes
    try:
        ctx.bench.efficiency = efficiency(ctx.fp32_path, batch1, {b.batch_size: b.latency.p50_ms for b in
                                                                  ctx.bench.models[0].batches}, ctx.recipe.precision.value)
    except (ValueError, RuntimeError, onnx.shape_inference.InferenceError) as exc:  # > 2 GB protos, odd graphs
        log.warning("no efficiency figures: %s", first_line(exc))
    first = ctx.bench.models[0].batches[0]
    detail = f"batch {first.batch_size}: p50 {first.latency.p50_ms:.2f} ms over {first.latency.iterations} iterations"
    detail += f"; sweep of {len(ctx.bench.sweep)} points: " + (ctx.bench.recommendation if ctx.bench.recommended is None else
              f"best batch {ctx.bench.recommended.batch_size} x {ctx.bench.recommended.concurrency} concurrent, "
              f"{ctx.bench.recommended.throughput_per_s:.1f} samples/s")
    if ctx.bench.failures:
        return "failed", detail + "; " + "; ".join(ctx.bench.failures)
    return "passed", detail


def application_times(ctx: BuildContext, batch_sizes: list[int], image_input: str) -> None:
    """Where a batch's time goes and the whole job, naive against accel-opt's, on the --data files."""
    if ctx.data_dir is None:
        ctx.bench.stage_note = "no --data: the application's stages and the job need real input files"
        return
    # The files the samples were read from (class folders too, with --labels folders); texts: their files.
    files = [ctx.data_dir / name for name in ctx.data.names] if ctx.data.source in ("npz", "images") else \
        application.data_files(ctx.data_dir)
    config = ctx.resource_config
    if ctx.text_encoder is not None:  # tokenizing is the texts' preprocessing
        host = application.text_host_stage_ms(files, ctx.text_encoder)
    else:
        host = application.host_stage_ms(files, ctx.recipe.preprocessing.host_part() if ctx.recipe.preprocessing else None)
    candidate = ctx.bench.models[0]
    outputs, device = {}, {}
    with ctx.deployment.runner(runtime.feed_dtypes_of(ctx.samples.timed_deployed)) as runner:
        for b in batch_sizes:  # GPU runners time h2d / compute / d2h apart, each ended by a synchronization
            feed = batch_of(ctx.samples.timed_deployed, b, ctx.shapes.batch_axes)
            outputs[b] = runner.infer(feed, check_inputs=False)
            calls = [last_stage_ms(runner)]
            if calls[0]:
                for _ in range(application.DEVICE_STAGE_CALLS - 1):
                    runner.infer(feed, check_inputs=False)
                    calls.append(last_stage_ms(runner))
            device[b] = median_stage_ms(calls) if calls[0] else None
    ctx.bench.stages_ms = [
        application.stage_times(host, candidate.at(b).latency.p50_ms,
                                application.postprocess_ms(outputs[b], config.postprocess, config.outputs[0].name, b), b,
                                device_ms=device[b])
        for b in batch_sizes]
    note = application.CPU_NOTE if ctx.compiled.device == "cpu" else application.DEVICE_NOTE
    ctx.bench.stage_note = f"host stages timed per input on {min(len(files), application.STAGE_FILES)} files (one core, median), x batch; {note}"
    pre, job_files = ctx.recipe.preprocessing, files[: application.JOB_FILES]
    ctx.bench.jobs = [accel_opt_job(job_files, ctx.deployment)]
    try:  # the naive job runs the fp32 model on ONNX Runtime, the portable default
        ort = OnnxRuntimeBackend()
        naive_runner = ort.runner(ort.compile(ctx.fp32_path, Precision.fp32, ctx.recipe, ctx.workdir / "naive"))
        naive = (application.naive_text_job(job_files, naive_runner, ctx.text_encoder, ctx.deploy_batch)
                 if ctx.text_encoder is not None else application.naive_job(job_files, naive_runner, pre, image_input))
        ctx.bench.jobs.insert(0, naive)
    except AccelOptError as exc:
        ctx.bench.stage_note += f"; no naive job: {exc}"


def max_feed(ctx: BuildContext, fused: bool) -> Sample | None:
    """A seeded feed at --max-shapes (inputs not named there keep the largest benchmarked batch)."""
    given = ctx.recipe.benchmark.max_shapes
    if not given:
        return None
    if fused:
        raise UsageError("--max-shapes with fused preprocessing is not supported yet: the image input changes layout")
    batch = max(ctx.recipe.benchmark.batch_sizes) if ctx.shapes.batch_dynamic else ctx.shapes.batch_size
    base = with_batch(ctx.shapes.shapes, batch, ctx.shapes.batch_axes) if ctx.shapes.batch_dynamic else ctx.shapes.shapes
    resolved = resolve_shapes(ctx.inputs, {**base, **given}, given_batch_axes=ctx.recipe.batch_axes)  # checks ranks, fixed dims
    feed = synthetic_samples(ctx.inputs, resolved.shapes, 1, ctx.recipe.accuracy.seed, ctx.loaded.index_bounds)[0][0]
    return {name: array.astype(ctx.samples.timed[0][name].dtype) for name, array in feed.items()}


def accel_opt_job(files: list[Path], deployment) -> JobTiming:
    """`accel-opt run` of the deployed artifact over the build's files, timed from loading to the last answer."""
    with tempfile.TemporaryDirectory(prefix="accel-opt-job-") as tmp:
        start = time.perf_counter()
        summary = run_job(deployment, files, Path(tmp) / "predictions.jsonl")
        seconds = time.perf_counter() - start
    how = (f"texts sorted by length in windows, batches of {summary.batch_size} padded to their longest"
           if summary.text is not None else f"reader threads ({summary.workers}) overlapping batches of {summary.batch_size}")
    return application.timing("accel-opt run", how + " on the deployed artifact", summary.inputs, seconds, summary.bottleneck)
