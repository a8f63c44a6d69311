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
from accel_opt.bench import BenchmarkReport, JobTiming, Target, application, deployment_target, run_benchmark
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
    from accel_opt.builder.context import BuildSoFar

log = logging.getLogger(__name__)


def benchmark_build(ctx: BuildSoFar, unfused_shapes: dict[str, list[int]],
                    image_input: str) -> tuple[StageStatus, str, BenchmarkReport]:
    """The build's benchmark stage: the deployment next to the fp32 baseline (and the naive build, and PyTorch)
    interleaved; the concurrency and batch sweep, the recommendation and the capacity check; the application's
    stages and jobs on the --data files; efficiency against the FLOP count. It times ctx.dealt.samples.timed (texts
    padded to one length; the verdict's samples stay as the gate judged them). `unfused_shapes`: the deployed shapes
    without fused preprocessing (how the baselines compile); `image_input`: the input the naive job feeds. Returns the
    status, its detail and the measurements."""
    backend, workdir, samples = ctx.setup.backend, ctx.setup.workdir, ctx.dealt.samples
    targets = [deployment_target(ctx.deployment, runtime.feed_dtypes_of(samples.timed_deployed),
                                 samples=samples.timed_deployed)]
    if ctx.recipe.precision is not Precision.fp32:
        baseline = compile_for(backend, ctx.fp32_path, Precision.fp32, ctx.recipe, workdir / "baseline", unfused_shapes)
        targets.append(Target(f"{backend.name}-fp32", backend.runner(baseline), backend.synchronize))
    if ctx.fallback is not None and ctx.fallback.kept:  # the fallback's speed cost, in the same interleaved run
        naive = compile_for(backend, workdir / ctx.fallback.naive_model, ctx.recipe.precision, ctx.recipe,
                            workdir / "naive-build", unfused_shapes)
        targets.append(Target(f"{backend.name}-{ctx.recipe.precision.value}-naive", backend.runner(naive),
                              backend.synchronize))
    if ctx.torch_module is not None:
        from accel_opt.backends.torch.factory import torch_runner

        targets.append(Target("pytorch-eager", torch_runner(ctx.torch_module, ctx.model_path, ctx.setup.threads)))
    batch_sizes = ctx.recipe.benchmark.batch_sizes if ctx.shapes.batch_dynamic else [ctx.shapes.batch_size]
    if ctx.recipe.precision is not Precision.fp32:  # the verdict's benefit is read at the deployed batch: time it
        batch_sizes = sorted({*batch_sizes, ctx.deploy_batch})
    axes = ctx.shapes.batch_axes
    bench = run_benchmark(targets, samples.timed, batch_sizes, ctx.recipe.benchmark, ctx.setup.threads, axes,
                          rounds=rounds_needed(ctx.recipe.accuracy.confidence))
    streams = getattr(backend, "concurrency_sweep", None)
    if streams is not None:  # streams x async requests: the concurrency a server would run
        feed = batch_of(samples.timed_deployed, ctx.deploy_batch, axes)
        bench.concurrency = streams(ctx.deployment.compiled, feed,
                                    seconds=max(0.2, ctx.recipe.benchmark.min_seconds / 2))
    config, dtypes = ctx.recipe.benchmark, runtime.feed_dtypes_of(samples.timed_deployed)
    bench.sweep = sweep(lambda: ctx.deployment.runner(dtypes), samples.timed_deployed, batch_sizes, config, axes,
                        backend.synchronize)
    bench.recommended, bench.recommendation = recommend(bench.sweep, config)
    bench.capacity = capacity(bench.sweep, config, lambda: ctx.deployment.runner(dtypes), ctx.dealt.max_feed,
                              backend.synchronize)
    bench.checks = sweep_checks(bench.recommended, bench.recommendation, bench.capacity, config)
    if ctx.loaded.text_encoder is not None:  # activations grow with the tokens: a batch size per length
        encoder = ctx.loaded.text_encoder
        fill = {name: -1 if field == "ids" else 1 if field == "attention_mask" else 0
                for name, (field, _) in encoder.inputs.items()}
        bench.length_buckets = length_capacity(
            lambda: ctx.deployment.runner(dtypes), fill, encoder.tokenizer.get_vocab_size(),
            lengths_to_measure(encoder.stage.max_length, list(encoder.stage.length_buckets)), ctx.deploy_batch,
            max(config.concurrency), config.memory_budget_mib)
    application_times(ctx, bench, batch_sizes, image_input)
    batch1 = with_batch(ctx.shapes.shapes, 1, axes) if ctx.shapes.batch_dynamic else ctx.shapes.shapes
    try:
        p50_ms = {b.batch_size: b.latency.p50_ms for b in bench.models[0].batches}
        bench.efficiency = efficiency(ctx.fp32_path, batch1, p50_ms, ctx.recipe.precision.value)
    except (ValueError, RuntimeError, onnx.shape_inference.InferenceError) as exc:  # > 2 GB protos, odd graphs
        log.warning("no efficiency figures: %s", first_line(exc))
    first = bench.models[0].batches[0]
    detail = f"batch {first.batch_size}: p50 {first.latency.p50_ms:.2f} ms over {first.latency.iterations} iterations"
    detail += f"; sweep of {len(bench.sweep)} points: " + (bench.recommendation if bench.recommended is None else
              f"best batch {bench.recommended.batch_size} x {bench.recommended.concurrency} concurrent, "
              f"{bench.recommended.throughput_per_s:.1f} samples/s")
    if bench.failures:
        return "failed", detail + "; " + "; ".join(bench.failures), bench
    return "passed", detail, bench


def application_times(ctx: BuildSoFar, bench: BenchmarkReport, batch_sizes: list[int], image_input: str) -> None:
    """Where a batch's time goes and the whole job, naive against accel-opt's, on the --data files (added to `bench`,
    the stage's own report while it is made)."""
    data_dir, data, encoder = ctx.setup.data_dir, ctx.dealt.data, ctx.loaded.text_encoder
    if data_dir is None:
        bench.stage_note = "no --data: the application's stages and the job need real input files"
        return
    # The files the samples were read from (class folders too, with --labels folders); texts: their files.
    files = [data_dir / name for name in data.names] if data.source in ("npz", "images") else \
        application.data_files(data_dir)
    config = ctx.compiled.resource_config
    if encoder is not None:  # tokenizing is the texts' preprocessing
        host = application.text_host_stage_ms(files, encoder)
    else:
        host = application.host_stage_ms(files,
                                         ctx.recipe.preprocessing.host_part() if ctx.recipe.preprocessing else None)
    candidate = bench.models[0]
    outputs, device = {}, {}
    with ctx.deployment.runner(runtime.feed_dtypes_of(ctx.dealt.samples.timed_deployed)) as runner:
        for b in batch_sizes:  # GPU runners time h2d / compute / d2h apart, each ended by a synchronization
            feed = batch_of(ctx.dealt.samples.timed_deployed, b, ctx.shapes.batch_axes)
            outputs[b] = runner.infer(feed, check_inputs=False)
            calls = [last_stage_ms(runner)]
            if calls[0]:
                for _ in range(application.DEVICE_STAGE_CALLS - 1):
                    runner.infer(feed, check_inputs=False)
                    calls.append(last_stage_ms(runner))
            device[b] = median_stage_ms(calls) if calls[0] else None
    bench.stages_ms = [
        application.stage_times(host, candidate.at(b).latency.p50_ms,
                                application.postprocess_ms(outputs[b], config.postprocess,
                                                           config.outputs[0].name, b), b,
                                device_ms=device[b])
        for b in batch_sizes]
    note = application.CPU_NOTE if ctx.compiled.compiled.device == "cpu" else application.DEVICE_NOTE
    bench.stage_note = (f"host stages timed per input on {min(len(files), application.STAGE_FILES)} files (one core, "
                        f"median), x batch; {note}")
    pre, job_files = ctx.recipe.preprocessing, files[: application.JOB_FILES]
    bench.jobs = [accel_opt_job(job_files, ctx.deployment)]
    try:  # the naive job runs the fp32 model on ONNX Runtime, the portable default
        ort = OnnxRuntimeBackend()
        naive_runner = ort.runner(ort.compile(ctx.fp32_path, Precision.fp32, ctx.recipe, ctx.setup.workdir / "naive"))
        naive = (application.naive_text_job(job_files, naive_runner, encoder, ctx.deploy_batch)
                 if encoder is not None else application.naive_job(job_files, naive_runner, pre, image_input))
        bench.jobs.insert(0, naive)
    except AccelOptError as exc:
        bench.stage_note += f"; no naive job: {exc}"


def max_feed(ctx: BuildSoFar, fused: bool) -> Sample | None:
    """A seeded feed at --max-shapes (inputs not named there keep the largest benchmarked batch)."""
    given = ctx.recipe.benchmark.max_shapes
    if not given:
        return None
    if fused:
        raise UsageError("--max-shapes with fused preprocessing is not supported yet: the image input changes layout")
    batch = max(ctx.recipe.benchmark.batch_sizes) if ctx.shapes.batch_dynamic else ctx.shapes.batch_size
    base = with_batch(ctx.shapes.shapes, batch,
                      ctx.shapes.batch_axes) if ctx.shapes.batch_dynamic else ctx.shapes.shapes
    # checks ranks, fixed dims
    resolved = resolve_shapes(ctx.loaded.inputs, {**base, **given}, given_batch_axes=ctx.recipe.batch_axes)
    feed = synthetic_samples(ctx.loaded.inputs, resolved.shapes, 1, ctx.recipe.accuracy.seed,
                             ctx.loaded.model.index_bounds)[0][0]
    return {name: array.astype(ctx.dealt.samples.timed[0][name].dtype) for name, array in feed.items()}


def accel_opt_job(files: list[Path], deployment) -> JobTiming:
    """`accel-opt run` of the deployed artifact over the build's files, timed from loading to the last answer."""
    with tempfile.TemporaryDirectory(prefix="accel-opt-job-") as tmp:
        start = time.perf_counter()
        summary = run_job(deployment, files, Path(tmp) / "predictions.jsonl")
        seconds = time.perf_counter() - start
    how = (f"texts sorted by length in windows, batches of {summary.batch_size} padded to their longest"
           if summary.text is not None
           else f"reader threads ({summary.workers}) overlapping batches of {summary.batch_size}")
    return application.timing("accel-opt run", how + " on the deployed artifact", summary.inputs, seconds,
                              summary.bottleneck)
