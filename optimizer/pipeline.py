"""The one orchestrator: the order of stages, their timing and status, and the artifact folder.

Domain modules are plain functions (path in -> path out, data in -> report out); only this module
knows the sequence load -> cleanup -> precision -> compile -> accuracy -> benchmark -> artifacts.
A stage either passes, is skipped (with the reason), or fails: a failed accuracy gate still
produces reports (not signed off, exit 1); any other failure raises and leaves no artifact.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from accel_opt import artifacts, hardware, htmlreport, preprocess, records, report, runtime
from accel_opt.accuracy import AccuracyReport, compare
from accel_opt.backends import Backend, CompiledModel, compile_for, get_backend
from accel_opt.backends.base import casting_inputs
from accel_opt.backends.gpu_timing import last_stage_ms, median_stage_ms
from accel_opt.backends.onnxruntime import OnnxRuntimeBackend, float_run_quantized_ops, reference_runner
from accel_opt.bench import BenchmarkReport, Target, application, deployment_target, run_benchmark
from accel_opt.bench.efficiency import efficiency, node_flops
from accel_opt.bench.sweep import capacity, recommend, sweep, sweep_checks
from accel_opt.data import (
    DataSummary,
    Sample,
    batch_of,
    check_sample,
    load_samples,
    shapes_of,
    split_indices,
    synthetic_samples,
    to_model_input,
)
from accel_opt.errors import AccelOptError, Unsupported, UsageError, first_line, no_space_error
from accel_opt.graph.cleanup import CleanupReport, cleanup
from accel_opt.graph.fuse import fuse_normalize, fused_shape
from accel_opt.graph.inspect import ResolvedShapes, TensorSpec, io_specs, resolve_shapes, with_batch
from accel_opt.graph.load import LoadedModel, load_model
from accel_opt.graph.save import save_model
from accel_opt.precision import PrecisionReport, fallback, transform
from accel_opt.precision.diagnose import Diagnosis, diagnose, emulate_bfloat16
from accel_opt.recipe import Precision, Recipe, load_recipe
from accel_opt.results import BuildResult, StageResult, StageStatus, fill_headline
from accel_opt.runtime import DeployedInput, Deployment, ResourceConfig

log = logging.getLogger(__name__)

CLEANUP_VERIFY_SAMPLES = 4


@dataclass
class BuildContext:
    model_path: Path
    recipe: Recipe
    data_dir: Path | None
    workdir: Path
    staging: Path
    cache_dir: Path | None
    backend: Backend
    threads: int
    notes: list[str] = field(default_factory=list)
    factory: Any = None  # a torch ModuleFactory when the input is FILE.py:FACTORY
    torch_module: Any = None  # the exported module: the accuracy reference and a baseline row
    export: dict[str, Any] | None = None  # export + verification reports
    loaded: LoadedModel | None = None
    source_path: Path | None = None  # the ONNX file given (or exported); model_path may become a cleaned copy
    model_sha256: str = ""
    external_data_sha256: dict[str, str] = field(default_factory=dict)
    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[TensorSpec] = field(default_factory=list)
    shapes: ResolvedShapes | None = None
    deploy_batch: int = 1  # rows per call of the shipped model: what the gate evaluates and `run` uses
    data: DataSummary | None = None
    calibration_samples: list[Sample] = field(default_factory=list)
    eval_samples: list[Sample] = field(default_factory=list)
    eval_names: list[str] = field(default_factory=list)
    deploy_samples: list[Sample] = field(default_factory=list)  # the eval samples as the artifact takes them (fused: uint8 crops)
    host_crops: list[Sample] = field(default_factory=list)  # fused preprocessing: every --data image as uint8 HWC crops
    draft_samples: list[Sample] = field(default_factory=list)  # draft_decode: every --data image as the artifact takes it
    max_feed: Sample | None = None  # a feed at --max-shapes, for the capacity check
    cleanup: CleanupReport | None = None
    fp32_path: Path | None = None  # after cleanup: the baseline every precision is compared with
    precision: PrecisionReport | None = None
    fallback: fallback.FallbackReport | None = None
    candidate_path: Path | None = None
    compiled: CompiledModel | None = None  # the compile in the workdir (its settings go to the resource config)
    resource_config: ResourceConfig | None = None
    deployment: Deployment | None = None  # the staged artifact, loaded as a user would: what is checked and timed
    deployed_hashes: dict[str, str] = field(default_factory=dict)  # its files' sha256 when it was loaded
    accuracy: AccuracyReport | None = None
    bench: BenchmarkReport | None = None


class _Skip(Exception):
    """Raised by a stage that has nothing to do; the message is the reason."""


def build(
    model: str | Path,
    recipe: Recipe | None = None,
    data_dir: str | Path | None = None,
    out_dir: str | Path = "artifacts",
    cache_dir: str | Path | None = None,
    on_stage: Callable[[StageResult], None] | None = None,
    force: bool = False,
) -> BuildResult:
    """Build, check, benchmark and package `model`; never raises for a failed gate (exit_code 1).

    A complete folder of the same identity (model, recipe, data, tool versions, CPU) under `out_dir`
    that verifies is reused instead of rebuilt (`reused` is set), unless `force`. Raises
    AccelOptError subclasses for everything else (a full disk: ResourceExhausted); nothing but the
    calibration cache is left in `out_dir` then.
    """
    recipe = recipe or load_recipe()
    factory = _factory_or_none(str(model))
    model_path = Path(model) if factory is None else Path(str(model).rpartition(":")[2] + ".onnx")
    out_dir = Path(out_dir)
    backend = get_backend(recipe.backend, providers=recipe.onnxruntime.providers,
                          allow_cpu_nodes=recipe.onnxruntime.allow_cpu_nodes)
    support = backend.supports(recipe.precision)
    if not support:
        raise Unsupported(f"--precision {recipe.precision.value} on {backend.name}: {support.reason}")
    if recipe.precision is Precision.int8 and data_dir is None:
        raise UsageError("--precision int8 needs --data: calibrating on random inputs would set meaningless scales")
    stages: list[StageResult] = []
    try:
        with artifacts.build_folder(out_dir, model_path.stem) as (staging, work):
            ctx = BuildContext(
                model_path=model_path, recipe=recipe, data_dir=Path(data_dir) if data_dir else None, workdir=work,
                staging=staging, cache_dir=Path(cache_dir) if cache_dir else out_dir / ".cache", backend=backend,
                threads=recipe.benchmark.threads or hardware.available_cpus(), factory=factory,
            )
            if model_path.is_file():  # the staged artifact holds at least a copy of the model
                artifacts.ensure_free_space(work, model_path.stat().st_size)
            for name, stage in STAGES:
                _run_stage(ctx, name, stage, stages, on_stage)
                if name == "load" and not force:
                    reused = records.reuse(ctx, out_dir / records.artifact_name(ctx), str(model), stages, on_stage)
                    if reused is not None:
                        return reused

            failures = ctx.accuracy.failures + ctx.bench.failures
            signed_off = not failures
            final = out_dir / records.artifact_name(ctx)
            result = BuildResult(
                model=str(model), precision=recipe.precision.value, backend=backend.name, signed_off=signed_off,
                exit_code=0 if signed_off else 1, artifact_dir=str(final), failures=failures, stages=stages,
                worst_cosine=ctx.accuracy.worst_cosine, data=records.data_record(ctx), evaluated=ctx.accuracy.evaluation.deployment,
            )
            fill_headline(result, ctx.bench)
            result._eval_samples = ctx.deploy_samples
            records.write_manifest(ctx, staging, result)  # last file: the folder is complete when it is renamed into place
            artifacts.publish(staging, final)
    except Exception as exc:
        full = no_space_error(exc, out_dir)
        if full is None:
            raise
        raise full from exc
    return result


def _run_stage(ctx: BuildContext, name: str, stage, stages: list[StageResult], on_stage) -> None:
    """Run one stage, timed; record (and report) it as passed, skipped or failed; failures re-raise."""
    started = time.perf_counter()
    try:
        status, detail = stage(ctx)
    except _Skip as skip:
        status, detail = "skipped", str(skip)
    except BaseException as exc:
        detail = str(exc) if isinstance(exc, AccelOptError) else f"{type(exc).__name__}: {exc}"
        stages.append(StageResult(name=name, status="failed", seconds=time.perf_counter() - started, detail=detail))
        if on_stage:
            on_stage(stages[-1])
        raise
    stages.append(StageResult(name=name, status=status, seconds=time.perf_counter() - started, detail=detail))
    if on_stage:
        on_stage(stages[-1])


# ---- stages: each returns (status, detail) or raises _Skip / AccelOptError -----------------------


def _stage_export(ctx: BuildContext) -> tuple[StageStatus, str]:
    if ctx.factory is None:
        raise _Skip("the input is an ONNX model")
    from accel_opt.export import export, verify

    if not ctx.recipe.shapes:
        raise UsageError(f"{ctx.factory.spec}: a PyTorch factory needs --shapes to build its example inputs")
    ctx.torch_module = ctx.factory()
    onnx_path = ctx.workdir / "export" / ctx.model_path.name
    exported = export(ctx.torch_module, ctx.recipe.shapes, onnx_path, **ctx.factory.export_hints)
    verification = verify(ctx.torch_module, onnx_path, ctx.recipe.shapes, threads=ctx.threads)  # GateFailed on mismatch
    ctx.model_path = onnx_path
    ctx.export = {"factory": ctx.factory.spec, "export": exported.model_dump(mode="json"),
                  "verification": verification.model_dump(mode="json")}
    ctx.notes += exported.notes
    ctx.notes.append(f"Exported from {ctx.factory.spec} ({exported.exporter} exporter, opset {exported.opset}); "
                     "the PyTorch module is the accuracy reference.")
    return "passed", f"{exported.exporter} exporter, opset {exported.opset}, verified against PyTorch"


def _factory_or_none(spec: str):
    """A torch ModuleFactory when `spec` names one (FILE.py:FACTORY or package.module:FACTORY)."""
    from accel_opt.backends.torch import load_factory, looks_like_factory

    return load_factory(spec) if looks_like_factory(spec) else None


def _reference(ctx: BuildContext):
    """The accuracy reference: the PyTorch module for torch inputs, else the original ONNX on ORT."""
    if ctx.torch_module is not None:
        from accel_opt.backends.torch import torch_runner

        return torch_runner(ctx.torch_module, ctx.model_path, ctx.threads, name="reference-pytorch")
    return reference_runner(ctx.model_path, ctx.threads)


def _stage_load(ctx: BuildContext) -> tuple[StageStatus, str]:
    ctx.source_path = ctx.model_path
    ctx.loaded = load_model(ctx.model_path, ctx.workdir)
    ctx.model_sha256 = artifacts.sha256_file(ctx.source_path)
    ctx.external_data_sha256 = {p.name: artifacts.sha256_file(p) for p in ctx.loaded.external_data_files}
    ctx.notes += ctx.loaded.notes
    ctx.model_path = ctx.loaded.path
    ctx.inputs, ctx.outputs = io_specs(ctx.loaded.proto)
    recipe = ctx.recipe = preprocess.fit_preprocessing(ctx.recipe, ctx.inputs, ctx.notes)  # before any image is read
    if _fused(ctx) and (ctx.data_dir is None or any(Path(ctx.data_dir).glob("*.npz"))):
        raise UsageError("preprocessing.fused needs --data with image files: the fused model takes decoded crops")
    if ctx.data_dir is not None:
        samples, ctx.data = _read_data(ctx)
        ctx.shapes = resolve_shapes(ctx.inputs, recipe.shapes, shapes_of(samples), recipe.batch_axes)
    else:
        ctx.shapes = resolve_shapes(ctx.inputs, recipe.shapes, given_batch_axes=recipe.batch_axes)
        samples, ctx.data = synthetic_samples(ctx.inputs, ctx.shapes.shapes, recipe.accuracy.synthetic_samples,
                                              recipe.accuracy.seed, ctx.loaded.index_bounds)
        ctx.notes.append(f"No --data given: {len(samples)} synthetic samples (seed {recipe.accuracy.seed}) were used for the accuracy check.")
    ctx.notes += ctx.shapes.notes
    if recipe.precision is Precision.int8:
        calib, evaluation = split_indices(len(samples), recipe.precision_options.calibration.samples, recipe.accuracy.seed)
        ctx.calibration_samples = [samples[i] for i in calib]
    else:
        evaluation = list(range(len(samples)))
    evaluation = evaluation[: recipe.accuracy.max_samples]
    ctx.eval_samples = [samples[i] for i in evaluation]
    ctx.eval_names = [ctx.data.names[i] for i in evaluation]
    ctx.deploy_samples = ctx.eval_samples
    if _fused(ctx):
        ctx.deploy_samples = [ctx.host_crops[i] for i in evaluation]
    elif ctx.draft_samples:
        ctx.deploy_samples = [ctx.draft_samples[i] for i in evaluation]
    ctx.deploy_batch = recipe.selection.target_batch_size if ctx.shapes.batch_dynamic else ctx.shapes.batch_size
    ctx.max_feed = _max_feed(ctx)  # checked now: a wrong --max-shapes is a usage error before any work
    shapes = ", ".join(f"{k}:{'x'.join(map(str, v)) or 'scalar'}" for k, v in ctx.shapes.shapes.items())
    return "passed", (
        f"opset {ctx.loaded.opset}, {len(ctx.loaded.proto.graph.node)} nodes, inputs {shapes}; "
        f"{len(ctx.calibration_samples)} calibration + {len(ctx.eval_samples)} evaluation samples ({ctx.data.source})"
    )


def _read_data(ctx: BuildContext) -> tuple[list[Sample], DataSummary]:
    """The --data samples as the model takes them. With fused preprocessing the images are decoded once,
    to the host's uint8 crops (kept: what the fused artifact takes), and normalized from those."""
    pre = ctx.recipe.preprocessing
    draft = pre is not None and pre.draft_decode and not any(Path(ctx.data_dir).glob("*.npz"))
    reference_pre = pre.model_copy(update={"draft_decode": False}) if draft else pre
    if not _fused(ctx):
        samples, data = load_samples(ctx.data_dir, ctx.inputs, reference_pre)
        if draft:  # the candidate takes what `accel-opt run` will feed it; the reference, full decodes
            ctx.draft_samples = load_samples(ctx.data_dir, ctx.inputs, pre)[0]
        return samples, data
    name = _image_input(ctx)
    spec = TensorSpec(name=name, dtype="uint8", shape=["batch", pre.crop, pre.crop, 3])
    crops, data = load_samples(ctx.data_dir, [spec], pre.host_part().model_copy(update={"input": name}))
    ctx.host_crops = crops
    if draft:
        crops = load_samples(ctx.data_dir, [spec], reference_pre.host_part().model_copy(update={"input": name}))[0]
    samples = [{name: to_model_input(c[name], pre)} for c in crops]
    for sample, where in zip(samples, data.names):
        check_sample(sample, ctx.inputs, f"--data {where}")
    return samples, data


def _image_input(ctx: BuildContext) -> str:
    pre = ctx.recipe.preprocessing
    return pre.input if pre and pre.input else ctx.inputs[0].name


def _fused(ctx: BuildContext) -> bool:
    return ctx.recipe.preprocessing is not None and ctx.recipe.preprocessing.fused


def _deploy_shapes(ctx: BuildContext, fused: bool = True) -> dict[str, list[int]]:
    """The input shapes the artifact is compiled and checked for: the resolved shapes at the deployed batch
    (the image input in HWC order when its preprocessing is fused, unless `fused` is False: the model
    without the fused steps, as the fp32 baseline runs)."""
    shapes = ctx.shapes.shapes
    if ctx.shapes.batch_dynamic:
        shapes = with_batch(shapes, ctx.deploy_batch, ctx.shapes.batch_axes)
    if fused and _fused(ctx):
        name = _image_input(ctx)
        shapes = {**shapes, name: fused_shape(shapes[name], ctx.recipe.preprocessing.layout)}
    return shapes


def _stage_cleanup(ctx: BuildContext) -> tuple[StageStatus, str]:
    ctx.fp32_path = ctx.model_path
    if not ctx.recipe.cleanup.enabled:
        raise _Skip("disabled by the recipe")
    total_bytes = sum(p.stat().st_size for p in [ctx.model_path, *ctx.loaded.external_data_files])
    ctx.fp32_path, ctx.cleanup = cleanup(
        ctx.model_path, total_bytes, ctx.eval_samples[:CLEANUP_VERIFY_SAMPLES], ctx.recipe.accuracy.tolerances[Precision.fp32],
        ctx.threads, ctx.workdir / "cleaned.onnx",
    )
    if not ctx.cleanup.applied:
        raise _Skip(ctx.cleanup.reason)
    return "passed", f"{ctx.cleanup.nodes_before} -> {ctx.cleanup.nodes_after} nodes; {ctx.cleanup.reason}"


def _stage_precision(ctx: BuildContext) -> tuple[StageStatus, str]:
    ctx.candidate_path = ctx.fp32_path
    precision, config = ctx.recipe.precision, ctx.recipe.precision_options.fallback
    if precision is Precision.fp32:
        raise _Skip("fp32: the graph keeps its precision")
    # int8 probes on calibration samples, so the gate's evaluation samples stay unseen; fp16/bf16 have no
    # calibration split: the fallback only ever moves the build towards fp32 on the first evaluation samples.
    probes = (ctx.calibration_samples if precision is Precision.int8 else ctx.eval_samples)[: config.probe_samples]
    source = "calibration samples" if precision is Precision.int8 else "the first evaluation samples"
    fixed = fallback.wide_weight_consumers(ctx.fp32_path) if precision is Precision.fp16 else []
    ctx.precision, ctx.fallback, ctx.candidate_path = fallback.run(
        precision, config, _fallback_actions(ctx, probes), ctx.workdir / f"{precision.value}.onnx", len(probes), source, fixed)
    ctx.fallback.probe_slack = fallback.PROBE_MARGIN if precision is Precision.int8 else 1.0
    ctx.precision.notes.append(f"Fallback: {ctx.fallback.status}, {ctx.fallback.reason}.")
    kept = len(ctx.precision.kept_in_higher_precision)
    detail = f"{ctx.precision.transform}; {kept} nodes kept in higher precision; fallback {ctx.fallback.status}"
    if ctx.fallback.rounds:
        detail += f" ({len(ctx.fallback.rounds)} rounds, {ctx.fallback.fp32_flops_fraction:.1%} of FLOPs in fp32)"
    return "passed", detail


def _fallback_actions(ctx: BuildContext, probes: list[Sample]) -> fallback.Actions:
    """The fallback's build / judge / diagnose: the recipe's transform, the gate's tolerance on the probes
    run on the build's backend, and the per-layer diagnosis on ONNX Runtime (bf16 emulated)."""
    precision, recipe = ctx.recipe.precision, ctx.recipe
    calibration_cache = ctx.cache_dir / "calibration" if ctx.cache_dir else None

    tolerance = (recipe.tolerance, recipe.accuracy.task_metrics)
    if precision is Precision.int8:  # in-sample probes: judged with half the slack
        tolerance = fallback.stricter(*tolerance)

    def build(keep: list[str], out: Path) -> PrecisionReport:
        return transform(ctx.fp32_path, precision, recipe, ctx.backend.name, ctx.calibration_samples, out,
                         calibration_cache, keep_float=keep)

    def judge(path: Path) -> fallback.ProbeVerdict:
        compiled = compile_for(ctx.backend, path, precision, recipe, ctx.workdir / "probe" / path.stem,
                               _deploy_shapes(ctx, fused=False))
        deployed = {spec.name: spec.dtype for spec in io_specs(onnx.load(str(path), load_external_data=False))[0]}
        runner = casting_inputs(ctx.backend.runner(compiled), runtime.feed_dtypes_of(probes), deployed)
        result = compare(reference_runner(ctx.fp32_path, ctx.threads), runner, probes, *tolerance, batch_size=ctx.deploy_batch,
                         batch_axes=ctx.shapes.batch_axes, noise_reference=reference_runner(ctx.fp32_path, ctx.threads, optimize=True))
        return fallback.ProbeVerdict(passed=result.passed, worst_cosine=result.worst_cosine, failures=result.failures[:3])

    def judge_emulated(path: Path) -> fallback.ProbeVerdict:  # Q/DQ in float, graph optimizations off: as diagnosed
        result = compare(reference_runner(ctx.fp32_path, ctx.threads), reference_runner(path, ctx.threads), probes, *tolerance,
                         noise_reference=reference_runner(ctx.fp32_path, ctx.threads, optimize=True))
        return fallback.ProbeVerdict(passed=result.passed, worst_cosine=result.worst_cosine, failures=result.failures[:3])

    def examine(path: Path) -> Diagnosis:
        if precision is Precision.bf16:
            (ctx.workdir / "probe").mkdir(parents=True, exist_ok=True)
            path = emulate_bfloat16(path, ctx.workdir / "probe" / f"emulated-{path.name}")
        return diagnose(ctx.fp32_path, path, probes[: recipe.precision_options.fallback.diagnosis_samples], ctx.threads)

    batch1 = with_batch(ctx.shapes.shapes, 1, ctx.shapes.batch_axes) if ctx.shapes.batch_dynamic else ctx.shapes.shapes

    def flops_of(path: Path) -> dict[str, int]:
        try:
            return node_flops(path, batch1)
        except (ValueError, RuntimeError, onnx.shape_inference.InferenceError) as exc:  # > 2 GB protos, odd graphs
            log.warning("no FLOP counts for the fallback budget: %s", first_line(exc))
            return {}
    companions = None
    if precision is Precision.int8 and isinstance(ctx.backend, OnnxRuntimeBackend):
        def companions(path: Path) -> list[str]:
            return float_run_quantized_ops(path, ctx.threads)
    return fallback.Actions(build=build, judge=judge, diagnose=examine, flops_of=flops_of, companions=companions,
                            judge_emulated=judge_emulated if precision is Precision.int8 else None)


def _stage_compile(ctx: BuildContext) -> tuple[StageStatus, str]:
    _stage_deployment(ctx, _deploy_shapes(ctx))
    problem = _batch_problem(ctx)
    if problem:  # a batch axis the model's dims do not name (silero_vad.onnx's state): deploy as given
        axes = ", ".join(f"{n}:{'none' if a is None else a}" for n, a in ctx.shapes.batch_axes.items())
        ctx.notes.append(f"The model fails at batch {ctx.deploy_batch} with batch axes {axes} ({problem}); deployed "
                         f"and benchmarked at the shapes given. Give --batch-axes NAME:AXIS for an input whose batch "
                         "axis the model does not name.")
        ctx.shapes = ctx.shapes.model_copy(update={"batch_dynamic": False})
        ctx.deploy_batch = ctx.shapes.batch_size
        for path in ctx.staging.iterdir():
            path.unlink()
        _stage_deployment(ctx, ctx.shapes.shapes)
    c = ctx.compiled
    return "passed", f"{c.backend} on {c.device} via {', '.join(c.providers)}, {c.threads} threads, {c.build_seconds:.2f} s"


def _stage_deployment(ctx: BuildContext, shapes: dict[str, list[int]]) -> None:
    """Write the model, the backend's compiled files and the resource config into the staged artifact,
    then load it back through the runtime: from here on the build checks and times that folder."""
    model_file = ctx.staging / "model.onnx"
    source = ctx.candidate_path
    if _fused(ctx):
        source = fuse_normalize(source, _image_input(ctx), ctx.recipe.preprocessing, ctx.workdir / "fused" / source.name)
    save_model(onnx.load(str(source)), model_file)  # external data resolved next to the source
    ctx.compiled = c = compile_for(ctx.backend, model_file, ctx.recipe.precision, ctx.recipe, ctx.workdir, shapes)
    deployed_inputs, deployed_outputs = io_specs(onnx.load(str(model_file), load_external_data=False))
    for extra in c.extra_files:
        if extra.parent != ctx.staging:
            shutil.copy2(extra, ctx.staging / extra.name)
    ctx.resource_config = ResourceConfig(
        backend=c.backend, device=c.device, providers=c.providers, precision=c.precision, threads=c.threads,
        settings=c.settings, model_file=c.path.name, extra_files=[p.name for p in c.extra_files],
        inputs=[DeployedInput(**s.model_dump(), shape_used=shapes[s.name], batch_axis=ctx.shapes.batch_axes.get(s.name))
                for s in deployed_inputs],
        outputs=deployed_outputs, batch_size=ctx.deploy_batch, batch_dynamic=ctx.shapes.batch_dynamic,
        preprocessing=ctx.recipe.preprocessing, postprocess=ctx.recipe.postprocess,
    )
    artifacts.write_json(ctx.staging / runtime.RESOURCE_CONFIG, ctx.resource_config)
    ctx.deployed_hashes = artifacts.file_hashes(ctx.staging)  # hashed once: build.json reuses them
    ctx.deployment = runtime.load(ctx.staging, expected_files=ctx.deployed_hashes)


def _batch_problem(ctx: BuildContext) -> str | None:
    """Why the deployment cannot run a batch of its size (None: it can, or nothing needs checking).
    Only checked when some input is left unbatched: that is when a batch axis may have gone unseen."""
    axes = ctx.shapes.batch_axes
    if ctx.deploy_batch == 1 or all(a is not None for a in axes.values()):
        return None
    try:
        with ctx.deployment.runner(runtime.feed_dtypes_of(ctx.deploy_samples)) as runner:
            runner.infer(batch_of(ctx.deploy_samples, ctx.deploy_batch, axes), check_inputs=False)
    except AccelOptError:
        raise
    except Exception as exc:  # the runtime's own error types
        return first_line(exc, limit=200)
    return None


def _stage_accuracy(ctx: BuildContext) -> tuple[StageStatus, str]:
    recipe, deployment = ctx.recipe, ctx.deployment
    ctx.accuracy = compare(
        _reference(ctx),
        deployment.runner(runtime.feed_dtypes_of(ctx.deploy_samples)),
        ctx.eval_samples,
        recipe.tolerance,
        recipe.accuracy.task_metrics,
        names=ctx.eval_names,
        batch_size=deployment.batch_size,
        batch_axes=deployment.batch_axes,
        candidate_samples=ctx.deploy_samples,
        noise_reference=reference_runner(ctx.model_path, ctx.threads, optimize=True),
    )
    ctx.accuracy.evaluation.deployment = deployment.describe(records.artifact_name(ctx))
    # What the gate found (where each output holds a batch's samples) is part of how the artifact runs.
    deployment.config = deployment.config.model_copy(update={"output_batch_axes": ctx.accuracy.evaluation.output_batch_axes})
    ctx.notes += preprocess.exercise_image_path(deployment, ctx.data.source, ctx.workdir, ctx.recipe.accuracy.seed)
    evaluation = ctx.accuracy.evaluation
    calls = f"{evaluation.calls} calls of batch {evaluation.batch_size}" if evaluation.mode == "batched" else "one per sample"
    summary = f"{ctx.accuracy.sample_count} samples ({calls}), worst cosine {ctx.accuracy.worst_cosine:.6f}"
    if not ctx.accuracy.passed:
        return "failed", summary + "; " + "; ".join(ctx.accuracy.failures)
    return "passed", summary


def _stage_benchmark(ctx: BuildContext) -> tuple[StageStatus, str]:
    targets = [deployment_target(ctx.deployment, runtime.feed_dtypes_of(ctx.deploy_samples), samples=ctx.deploy_samples)]
    if ctx.recipe.precision is not Precision.fp32:
        baseline = compile_for(ctx.backend, ctx.fp32_path, Precision.fp32, ctx.recipe, ctx.workdir / "baseline",
                               _deploy_shapes(ctx, fused=False))
        targets.append(Target(f"{ctx.backend.name}-fp32", ctx.backend.runner(baseline), ctx.backend.synchronize))
    if ctx.fallback is not None and ctx.fallback.kept:  # the fallback's speed cost, in the same interleaved run
        naive = compile_for(ctx.backend, ctx.workdir / ctx.fallback.naive_model, ctx.recipe.precision, ctx.recipe,
                            ctx.workdir / "naive-build", _deploy_shapes(ctx, fused=False))
        targets.append(Target(f"{ctx.backend.name}-{ctx.recipe.precision.value}-naive", ctx.backend.runner(naive),
                              ctx.backend.synchronize))
    if ctx.torch_module is not None:
        from accel_opt.backends.torch import torch_runner

        targets.append(Target("pytorch-eager", torch_runner(ctx.torch_module, ctx.model_path, ctx.threads)))
    batch_sizes = ctx.recipe.benchmark.batch_sizes if ctx.shapes.batch_dynamic else [ctx.shapes.batch_size]
    axes = ctx.shapes.batch_axes
    ctx.bench = run_benchmark(targets, ctx.eval_samples, batch_sizes, ctx.recipe.benchmark, ctx.threads, axes)
    streams = getattr(ctx.backend, "concurrency_sweep", None)
    if streams is not None:  # streams x async requests: the concurrency a server would run
        feed = batch_of(ctx.deploy_samples, ctx.deploy_batch, axes)
        ctx.bench.concurrency = streams(ctx.deployment.compiled, feed, seconds=max(0.2, ctx.recipe.benchmark.min_seconds / 2))
    config, dtypes = ctx.recipe.benchmark, runtime.feed_dtypes_of(ctx.deploy_samples)
    ctx.bench.sweep = sweep(lambda: ctx.deployment.runner(dtypes), ctx.deploy_samples, batch_sizes, config, axes,
                            ctx.backend.synchronize)
    ctx.bench.recommended, ctx.bench.recommendation = recommend(ctx.bench.sweep, config)
    ctx.bench.capacity = capacity(ctx.bench.sweep, config, lambda: ctx.deployment.runner(dtypes), ctx.max_feed,
                                  ctx.backend.synchronize)
    ctx.bench.checks = sweep_checks(ctx.bench.recommended, ctx.bench.recommendation, ctx.bench.capacity, config)
    _application_times(ctx, batch_sizes)
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


def _max_feed(ctx: BuildContext) -> Sample | None:
    """A seeded feed at --max-shapes (inputs not named there keep the largest benchmarked batch)."""
    given = ctx.recipe.benchmark.max_shapes
    if not given:
        return None
    if _fused(ctx):
        raise UsageError("--max-shapes with fused preprocessing is not supported yet: the image input changes layout")
    batch = max(ctx.recipe.benchmark.batch_sizes) if ctx.shapes.batch_dynamic else ctx.shapes.batch_size
    base = with_batch(ctx.shapes.shapes, batch, ctx.shapes.batch_axes) if ctx.shapes.batch_dynamic else ctx.shapes.shapes
    resolved = resolve_shapes(ctx.inputs, {**base, **given}, given_batch_axes=ctx.recipe.batch_axes)  # checks ranks, fixed dims
    feed = synthetic_samples(ctx.inputs, resolved.shapes, 1, ctx.recipe.accuracy.seed, ctx.loaded.index_bounds)[0][0]
    return {name: array.astype(ctx.eval_samples[0][name].dtype) for name, array in feed.items()}


def _application_times(ctx: BuildContext, batch_sizes: list[int]) -> None:
    """Where a batch's time goes and the whole job, naive against accel-opt's, on the --data files."""
    if ctx.data_dir is None:
        ctx.bench.stage_note = "no --data: the application's stages and the job need real input files"
        return
    files, config = application.data_files(ctx.data_dir), ctx.resource_config
    host = application.host_stage_ms(files, ctx.recipe.preprocessing.host_part() if ctx.recipe.preprocessing else None)
    candidate = ctx.bench.models[0]
    outputs, device = {}, {}
    with ctx.deployment.runner(runtime.feed_dtypes_of(ctx.deploy_samples)) as runner:
        for b in batch_sizes:  # GPU runners time h2d / compute / d2h apart, each ended by a synchronization
            feed = batch_of(ctx.deploy_samples, b, ctx.shapes.batch_axes)
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
    ctx.bench.jobs = [application.accel_opt_job(job_files, ctx.deployment)]
    try:  # the naive job runs the fp32 model on ONNX Runtime, the portable default
        ort = OnnxRuntimeBackend()
        naive_runner = ort.runner(ort.compile(ctx.fp32_path, Precision.fp32, ctx.recipe, ctx.workdir / "naive"))
        ctx.bench.jobs.insert(0, application.naive_job(job_files, naive_runner, pre, _image_input(ctx)))
    except AccelOptError as exc:
        ctx.bench.stage_note += f"; no naive job: {exc}"


def _stage_reports(ctx: BuildContext) -> tuple[StageStatus, str]:
    staging, name = ctx.staging, ctx.model_path.stem
    signed_off = ctx.accuracy.passed and not ctx.bench.failures
    artifacts.write_json(staging / "accuracy.json", ctx.accuracy)
    artifacts.write_text(
        staging / "signoff.md",
        report.signoff_markdown(name, signed_off, ctx.accuracy, ctx.precision, ctx.data, len(ctx.calibration_samples),
                                ctx.notes + (ctx.precision.notes if ctx.precision else [])
                                + [f"Benchmark gate failed: {line}" for line in ctx.bench.failures],
                                fallback=ctx.fallback, bench=ctx.bench),
    )
    if ctx.fallback is not None and ctx.fallback.naive_profile:
        (staging / "layer_error.png").write_bytes(htmlreport.layer_error_png(ctx.fallback.model_dump(mode="json")))
    artifacts.write_json(staging / "benchmark.json", ctx.bench)
    artifacts.write_text(staging / "benchmark.md", report.benchmark_markdown(name, ctx.bench))
    artifacts.write_json(staging / runtime.RESOURCE_CONFIG, records.measured_config(ctx))
    config = ctx.resource_config
    build_info = {
        "model_name": name,
        "created_utc": artifacts.now_utc(),
        "cleanup": ctx.cleanup.model_dump(mode="json") if ctx.cleanup else None,
        "precision": ctx.precision.model_dump(mode="json") if ctx.precision else None,
        "fallback": ctx.fallback.model_dump(mode="json") if ctx.fallback else None,
        "data": ctx.data.model_dump(mode="json"),
        "export": ctx.export,
        "notes": ctx.notes,
        "environment": {"tools": artifacts.tool_versions(), "cpu": hardware.cpu_info()},
        "files_sha256": {f: ctx.deployed_hashes[f] for f in [config.model_file, *config.extra_files]},
    }
    records.write_probe_set(ctx, staging)
    artifacts.write_json(staging / "build.json", build_info)
    artifacts.write_text(staging / "signoff.html", htmlreport.render(staging))  # from the JSON reports above only
    return "passed", f"{len(list(staging.iterdir()))} files"


STAGES: list[tuple[str, Callable[[BuildContext], tuple[StageStatus, str]]]] = [
    ("export", _stage_export),
    ("load", _stage_load),
    ("cleanup", _stage_cleanup),
    ("precision", _stage_precision),
    ("compile", _stage_compile),
    ("accuracy", _stage_accuracy),
    ("benchmark", _stage_benchmark),
    ("reports", _stage_reports),
]
