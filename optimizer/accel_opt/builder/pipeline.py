"""The one orchestrator: the order of stages, their timing and status, and the artifact folder.

Domain modules are plain functions (path in -> path out, data in -> report out); only this module
knows the sequence load -> cleanup -> precision -> compile -> accuracy -> benchmark -> artifacts.
A stage either passes, is skipped (with the reason), or fails: a failed accuracy gate still
produces reports (not signed off, exit 1); any other failure raises and leaves no artifact.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from accel_opt import runtime
from accel_opt.accuracy import SteeringVerdict, compare
from accel_opt.accuracy.run import ReferenceCache
from accel_opt.artifact.folder import MANIFEST, build_folder, publish
from accel_opt.artifact.signing import Signer
from accel_opt.backends import get_backend
from accel_opt.backends.onnxruntime.backend import reference_runner
from accel_opt.builder.benchmark import benchmark_build, max_feed
from accel_opt.builder.checks import (
    cleanup,
    exercise_image_path,
    refuse_oversized,
    refuse_oversubscribed_threads,
    refuse_recipe_misfits,
)
from accel_opt.builder.context import BuildContext, CandidateLimits
from accel_opt.builder.fallback_actions import fallback_actions
from accel_opt.builder.records import artifact_name, data_record, made_mark, reuse, write_manifest, write_reports
from accel_opt.builder.samples import data_samples_needed, dealt, read_and_split, too_few_to_certify
from accel_opt.builder.sources import factory_of, recipe_for
from accel_opt.builder.staging import batch_problem, deploy_shapes, stage_deployment
from accel_opt.builder.torch_plan import torch_precision
from accel_opt.data.npz import array_names
from accel_opt.errors import AccelOptError, Unsupported, UsageError, no_space_error
from accel_opt.files import ensure_free_space, mark_made, progress, sha256_file
from accel_opt.graph.inspect import io_specs
from accel_opt.graph.load import load_model
from accel_opt.machine.cpu import CpuProfile, available_cpus
from accel_opt.precision import fallback
from accel_opt.preprocess.fit import fit_preprocessing, image_path_agreement
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.types import BackendName, Precision
from accel_opt.report.results import BuildResult, StageResult, StageStatus, fill_headline
from accel_opt.report.verdict import benefit_of, decide

log = logging.getLogger(__name__)

CLEANUP_VERIFY_SAMPLES = 4
EXAMPLE_TOKENS = 16  # the sequence length a text factory is exported at when no --shapes is given


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
    eval_data_dir: str | Path | None = None,
    limits: CandidateLimits | None = None,
    reference_caches: dict[str, ReferenceCache] | None = None,
    cpu: CpuProfile | None = None,
    signer: Signer | None = None,
    task: str | None = None,
    export_hints: dict | None = None,
) -> BuildResult:
    """Build, check, benchmark and package `model`; never raises for a failed gate (exit_code 1) or for held-out
    samples too few to certify it (exit_code 6).

    `data_dir` is split into samples that calibrate, steer and judge (recipe accuracy.split); `eval_data_dir`, when
    given, holds the held-out samples that judge the verdict instead of a share of `data_dir`. `limits`: the build is a
    candidate of --precision auto (auto.py), which may stop it early (CandidateDropped) and bounds its search's time;
    `reference_caches` (auto: one for all its candidates) keeps the reference's outputs, run once per sample. `cpu`:
    the CPU every class-dependent choice is made for and the manifest records (this machine's, read here, by default).
    `signer` (artifact.signing.signer_of) signs the finished folder before it is published; with it, a folder found
    under `out_dir` is reused only when it carries that key's signature. `model` is an ONNX file, a PyTorch factory
    (FILE.py:FACTORY) or a Hugging Face model folder, whose `task` its config says unless given (builder.sources);
    `export_hints` (input_dtypes, dynamic) go over a factory's own.

    A complete folder of the same identity (model, recipe, data, tool versions, CPU) under `out_dir`
    that verifies is reused instead of rebuilt (`reused` is set), unless `force`. Raises
    AccelOptError subclasses for everything else (a full disk: ResourceExhausted); nothing but the
    calibration cache is left in `out_dir` then.
    """
    recipe, source_notes = recipe_for(model, recipe, task, data_dir is not None)
    cpu = cpu or CpuProfile.here()
    factory = factory_of(str(model), task, export_hints)
    if recipe.backend is BackendName.torch and factory is None:
        raise Unsupported(f"--backend torch builds PyTorch factories (FILE.py:FACTORY), not {Path(str(model)).name}: an "
                          "ONNX model takes --backend onnxruntime, openvino or tensorrt")
    model_path = Path(model) if factory is None else Path(factory.name + ".onnx")
    out_dir = Path(out_dir)
    backend = get_backend(recipe.backend, providers=recipe.onnxruntime.providers,
                          allow_cpu_nodes=recipe.onnxruntime.allow_cpu_nodes, device=recipe.torch.device, cpu=cpu)
    support = backend.supports(recipe.precision)
    if not support:
        raise Unsupported(f"--precision {recipe.precision.value} on {backend.name}: {support.reason}")
    if recipe.precision is Precision.int8 and data_dir is None:
        raise UsageError("--precision int8 needs --data: calibrating on random inputs would set meaningless scales")
    refuse_oversubscribed_threads(recipe.benchmark.threads)
    stages: list[StageResult] = []
    try:
        with build_folder(out_dir, model_path.stem) as (staging, work):
            ctx = BuildContext(
                model_path=model_path, recipe=recipe, data_dir=Path(data_dir) if data_dir else None, workdir=work,
                staging=staging, cache_dir=Path(cache_dir) if cache_dir else out_dir / ".cache", backend=backend,
                threads=recipe.benchmark.threads or available_cpus(), factory=factory,
                eval_data_dir=Path(eval_data_dir) if eval_data_dir else None, limits=limits,
                reference_caches=reference_caches, cpu=cpu, signer=signer, notes=list(source_notes))
            if model_path.is_file():  # the staged artifact holds at least a copy of the model
                ensure_free_space(work, model_path.stat().st_size)
            for name, stage in STAGES:
                _run_stage(ctx, name, stage, stages, on_stage)
                if name != "load":
                    continue
                if limits is not None and (too_few := too_few_to_certify(ctx)):  # no build of it could sign off
                    raise too_few
                if not force:
                    reused = reuse(ctx, out_dir / artifact_name(ctx), str(model), stages, on_stage)
                    if reused is not None:
                        return reused

            final = out_dir / artifact_name(ctx)
            result = BuildResult(
                model=str(model), precision=recipe.precision.value, backend=backend.name, verdict=ctx.verdict,
                artifact_dir=str(final), stages=stages,
                worst_cosine=ctx.accuracy.worst_cosine, data=data_record(ctx),
                evaluated=ctx.accuracy.evaluation.deployment,
                samples_needed=ctx.accuracy.samples_needed, trial_unit=ctx.accuracy.trial_unit,
                data_samples_needed=data_samples_needed(ctx, ctx.accuracy.samples_needed),
                timed_samples=ctx.samples.timed_deployed,
            )
            fill_headline(result, ctx.bench)
            write_manifest(ctx, staging, result)  # last file: the folder is complete when it is renamed into place
            if signer is not None:  # over every file, manifest included: published signed or not at all
                signer(staging)
            publish(staging, final)
            mark_made(final / MANIFEST, made_mark(ctx, final))  # what lets a later build reuse it (records.reuse)
    except Exception as exc:
        full = no_space_error(exc, out_dir)
        if full is None:
            raise
        raise full from exc
    return result


def _run_stage(ctx: BuildContext, name: str, stage, stages: list[StageResult], on_stage) -> None:
    """Run one stage, timed; record (and report) it as passed, skipped or failed; failures re-raise."""
    progress.info("%s", name, extra={"stage": name})  # a live progress line shows it begin
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
    from accel_opt.accuracy.export_check import verify
    from accel_opt.backends.torch.export import export

    if not ctx.recipe.shapes and ctx.recipe.text is not None and "input_dtypes" in ctx.factory.export_hints:
        # Token inputs: a short example sequence (the factory's `dynamic` hint keeps the sequence axis free).
        example = [1, min(EXAMPLE_TOKENS, ctx.recipe.text.max_length)]
        ctx.recipe = ctx.recipe.with_overrides(shapes={name: example for name in ctx.factory.export_hints["input_dtypes"]})
    if not ctx.recipe.shapes:
        raise UsageError(f"{ctx.factory.spec}: a PyTorch factory needs --shapes to build its example inputs")
    ctx.torch_module = ctx.factory()
    if ctx.torch:  # what ships is torch.export's program: a module it cannot trace fails here, with its reason
        ctx.backend.check_traceable(ctx.torch_module, ctx.recipe.shapes, ctx.factory.export_hints.get("input_dtypes"))
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


def _reference(ctx: BuildContext):
    """The accuracy reference: the PyTorch module for torch inputs, else the original ONNX on ORT."""
    if ctx.torch_module is not None:
        from accel_opt.backends.torch.backend import torch_runner

        return torch_runner(ctx.torch_module, ctx.model_path, ctx.threads, name="reference-pytorch")
    return reference_runner(ctx.model_path, ctx.threads)


def _stage_load(ctx: BuildContext) -> tuple[StageStatus, str]:
    ctx.source_path = ctx.model_path
    ctx.loaded = load_model(ctx.model_path, ctx.workdir, fed=array_names(ctx.data_dir) if ctx.data_dir else set())
    ctx.model_sha256 = sha256_file(ctx.source_path)
    ctx.external_data_sha256 = {p.name: sha256_file(p) for p in ctx.loaded.external_data_files}
    ctx.notes += ctx.loaded.notes
    ctx.model_path = ctx.loaded.path
    ctx.inputs, ctx.outputs = io_specs(ctx.loaded.proto)
    recipe = ctx.recipe = fit_preprocessing(ctx.recipe, ctx.inputs, ctx.notes)  # before any image is read
    if recipe.text is not None:
        _load_text_stage(ctx)
    refuse_recipe_misfits(ctx)
    ctx.samples = dealt(ctx, read_and_split(ctx))  # by role, once: no stage rewrites them
    ctx.notes += ctx.shapes.notes
    split = ctx.split
    ctx.deploy_batch = recipe.selection.target_batch_size if ctx.shapes.batch_dynamic else ctx.shapes.batch_size
    if recipe.text is not None and not recipe.benchmark.max_shapes:  # capacity at the longest text the job takes
        ctx.recipe = recipe.with_overrides(**{"benchmark.max_shapes": {
            name: [ctx.deploy_batch, recipe.text.max_length] for name in ctx.text_encoder.inputs}})
    ctx.max_feed = max_feed(ctx, ctx.fused)  # checked now: a wrong --max-shapes is a usage error before any work
    refuse_oversized(ctx)  # before the reference runs: an allocation that cannot succeed never starts
    shapes = ", ".join(f"{k}:{'x'.join(map(str, v)) or 'scalar'}" for k, v in ctx.shapes.shapes.items())
    roles = split.counts()
    return "passed", (
        f"opset {ctx.loaded.opset}, {len(ctx.loaded.proto.graph.node)} nodes, inputs {shapes}; {roles['calibration']} "
        f"calibration + {roles['steering']} steering + {roles['verdict']} held-out samples ({ctx.data.source})"
    )


def _load_text_stage(ctx: BuildContext) -> None:
    from accel_opt.preprocess.text import TextEncoder, find_tokenizer

    hint = getattr(ctx.factory.fn, "tokenizer_file", None) if ctx.factory is not None else None
    ctx.tokenizer_path = find_tokenizer(ctx.recipe.text, hint, ctx.source_path, ctx.inputs)
    ctx.text_encoder = TextEncoder(ctx.tokenizer_path, ctx.recipe.text, {s.name: s.dtype for s in ctx.inputs})
    ctx.notes.append(ctx.text_encoder.describe())


def _stage_cleanup(ctx: BuildContext) -> tuple[StageStatus, str]:
    ctx.fp32_path = ctx.model_path
    if not ctx.recipe.cleanup.enabled:
        raise _Skip("disabled by the recipe")
    if ctx.torch:
        raise _Skip("the torch backend compiles the PyTorch module, not the ONNX graph")
    checked_on = (ctx.samples.steering or ctx.samples.calibration)[:CLEANUP_VERIFY_SAMPLES]  # never held-out ones
    if not checked_on:
        raise _Skip("no steering sample to check the rewrite on (held-out samples judge the verdict only)")
    total_bytes = sum(p.stat().st_size for p in [ctx.model_path, *ctx.loaded.external_data_files])
    ctx.fp32_path, ctx.cleanup = cleanup(ctx.model_path, total_bytes, checked_on,
                                         ctx.recipe.accuracy.tolerances[Precision.fp32], ctx.threads,
                                         ctx.workdir / "cleaned.onnx")
    if not ctx.cleanup.applied:
        raise _Skip(ctx.cleanup.reason)
    return "passed", f"{ctx.cleanup.nodes_before} -> {ctx.cleanup.nodes_after} nodes; {ctx.cleanup.reason}"


def _stage_precision(ctx: BuildContext) -> tuple[StageStatus, str]:
    ctx.candidate_path = ctx.fp32_path
    precision, config = ctx.recipe.precision, ctx.recipe.precision_options.fallback
    if ctx.torch:  # what compile() exports: the module, its inputs and outputs, the calibration samples for int8
        ctx.backend.bind(ctx.torch_module, ctx.inputs, ctx.outputs, ctx.shapes.batch_axes, ctx.samples.calibration,
                         cache_dir=ctx.cache_dir)
    if precision is Precision.fp32:
        raise _Skip("fp32: the graph keeps its precision")
    if ctx.torch:
        return torch_precision(ctx)
    # The search is steered by the steering samples only: neither calibration (the ranges fit those) nor the verdict's
    # held-out samples (a search that picks the variant doing best on them would judge itself).
    probes = ctx.samples.steering[: config.probe_samples]
    fixed = fallback.wide_weight_consumers(ctx.fp32_path) if precision is Precision.fp16 else []
    out = ctx.workdir / f"{precision.value}.onnx"
    _, _, hopeless = ctx.steering_gate()
    skipped = None
    if config.enabled and hopeless:
        skipped = ("insufficient evidence", f"not searched: {hopeless[0]}, so no build it rescued could sign off")
    elif config.enabled and not probes:
        skipped = ("disabled", "not searched: no steering samples to judge variants on (give --data with more samples)")
    if skipped:
        config = config.model_copy(update={"enabled": False})
    ctx.precision, ctx.fallback, ctx.candidate_path = fallback.run(
        precision, config, fallback_actions(ctx, probes, deploy_shapes(ctx, fused=False)), out, len(probes),
        "steering samples", fixed, ctx.limits)
    if skipped:
        ctx.fallback.status, ctx.fallback.reason = skipped
    ctx.fallback.probe_slack = fallback.PROBE_MARGIN
    ctx.precision.notes.append(f"Fallback: {ctx.fallback.status}, {ctx.fallback.reason}.")
    kept = len(ctx.precision.kept_in_higher_precision)
    detail = f"{ctx.precision.transform}; {kept} nodes kept in higher precision; fallback {ctx.fallback.status}"
    if ctx.fallback.steps:
        detail += f" ({len(ctx.fallback.steps)} steps in {ctx.fallback.search_seconds:.0f} s, " \
                  f"{ctx.fallback.fp32_flops_fraction:.1%} of FLOPs in float)"
    return "passed", detail


def _stage_compile(ctx: BuildContext) -> tuple[StageStatus, str]:
    stage_deployment(ctx, deploy_shapes(ctx))
    problem = batch_problem(ctx)
    if problem:  # a batch axis the model's dims do not name (silero_vad.onnx's state): deploy as given
        axes = ", ".join(f"{n}:{'none' if a is None else a}" for n, a in ctx.shapes.batch_axes.items())
        ctx.notes.append(f"The model fails at batch {ctx.deploy_batch} with batch axes {axes} ({problem}); deployed "
                         f"and benchmarked at the shapes given. Give --batch-axes NAME:AXIS for an input whose batch "
                         "axis the model does not name.")
        ctx.shapes = ctx.shapes.model_copy(update={"batch_dynamic": False})
        ctx.deploy_batch = ctx.shapes.batch_size
        for path in ctx.staging.iterdir():
            path.unlink()
        stage_deployment(ctx, ctx.shapes.shapes)
    c = ctx.compiled
    detail = f"{c.backend} on {c.device} via {', '.join(c.providers)}, {c.threads} threads, {c.build_seconds:.2f} s"
    if "int8_check" in c.settings:  # what the package's kernels compute in (torch: PT2E int8)
        ctx.notes.append(f"Kernels of the int8 package: {c.settings['int8_check']}.")
        detail += f"; {c.settings['int8_check']}"
    return "passed", detail


def _stage_accuracy(ctx: BuildContext) -> tuple[StageStatus, str]:
    recipe, deployment = ctx.recipe, ctx.deployment
    reference = _reference(ctx)
    identity = f"{reference.name}:{ctx.model_sha256}"
    cache = ctx.reference_caches.setdefault(identity, ReferenceCache(identity)) if ctx.reference_caches is not None \
        else None
    candidate = deployment.runner(runtime.feed_dtypes_of(ctx.samples.held_out_deployed))
    ctx.accuracy = compare(
        reference, candidate, ctx.samples.held_out, recipe.tolerance, recipe.accuracy.task_metrics, names=ctx.samples.held_out_names,
        batch_size=deployment.batch_size, batch_axes=deployment.batch_axes, candidate_samples=ctx.samples.held_out_deployed,
        noise_reference=reference_runner(ctx.model_path, ctx.threads, optimize=True), padding=deployment.padding,
        confidence=recipe.accuracy.confidence, bounded=ctx.bounded, reference_cache=cache,
        groups=ctx.eval_groups, labels=ctx.eval_labels, labels_config=recipe.accuracy.labels)
    ctx.accuracy.roles = ctx.split.counts()
    if ctx.samples.steering:  # what auto's shortlist reads: the deployed build on samples the verdict never sees
        tolerance, metrics, hopeless = ctx.steering_gate()
        steered = compare(reference, candidate, ctx.samples.steering, tolerance, metrics, names=ctx.samples.steering_names,
                          batch_size=deployment.batch_size, batch_axes=deployment.batch_axes,
                          candidate_samples=ctx.samples.steering_deployed, padding=deployment.padding,
                          noise_floor={o.name: o.noise_floor for o in ctx.accuracy.outputs}, reference_cache=cache,
                          labels=ctx.steering_labels, labels_config=recipe.accuracy.labels)
        ctx.accuracy.steering = SteeringVerdict(sample_count=steered.sample_count, passed=steered.passed and not hopeless,
                                                loss=steered.loss, worst_cosine=steered.worst_cosine,
                                                failures=(hopeless + steered.failures)[:3])
    ctx.accuracy.evaluation.deployment = deployment.describe(artifact_name(ctx))
    # What the gate found (where each output holds a batch's samples) is part of how the artifact runs.
    deployment.config = deployment.config.model_copy(update={"output_batch_axes": ctx.accuracy.evaluation.output_batch_axes})
    ctx.notes += exercise_image_path(deployment, ctx.data.source, ctx.workdir, ctx.recipe.accuracy.seed)
    if ctx.torch and ctx.job_samples:
        ctx.notes.append(image_path_agreement(_reference(ctx), ctx.samples.held_out_deployed, ctx.accuracy._reference_outputs,
                                              ctx.outputs[0].name))
    evaluation = ctx.accuracy.evaluation
    calls = f"{evaluation.calls} calls of batch {evaluation.batch_size}" if evaluation.mode == "batched" else "one per sample"
    summary = f"{ctx.accuracy.sample_count} held-out samples ({calls}), worst cosine {ctx.accuracy.worst_cosine:.6f}"
    bounds = [c.evidence.line() for c in ctx.accuracy.checks if c.evidence is not None and c.evidence.minimum < 1]
    if ctx.accuracy.bounded and bounds:
        summary += "; " + "; ".join(bounds)
    if ctx.accuracy.verdict == "insufficient":
        return "failed", (f"{summary}; not enough held-out samples to sign off: {ctx.accuracy.samples_needed} needed "
                          "(--data with more samples, or --eval-data)")
    if not ctx.accuracy.passed:
        return "failed", summary + "; " + "; ".join(ctx.accuracy.failures)
    return "passed", summary


def _stage_benchmark(ctx: BuildContext) -> tuple[StageStatus, str]:
    return benchmark_build(ctx, deploy_shapes(ctx, fused=False), ctx.image_input)


def _stage_verdict(ctx: BuildContext) -> tuple[StageStatus, str]:
    """The build's one verdict (report.verdict.decide): the accuracy gate, the benchmark's budgets, and for a reduced
    precision the benefit over its fp32 build at the deployed batch."""
    benefit = None
    if ctx.recipe.precision is not Precision.fp32:
        benefit = benefit_of(ctx.bench, ctx.deploy_batch, ctx.recipe.benchmark.min_speedup, ctx.recipe.accuracy.confidence)
    ctx.verdict = decide(ctx.accuracy, ctx.bench.failures, benefit)
    return ("passed" if ctx.verdict.signed_off else "failed"), ctx.verdict.line()


def _stage_reports(ctx: BuildContext) -> tuple[StageStatus, str]:
    return "passed", write_reports(ctx)


STAGES: list[tuple[str, Callable[[BuildContext], tuple[StageStatus, str]]]] = [
    ("export", _stage_export),
    ("load", _stage_load),
    ("cleanup", _stage_cleanup),
    ("precision", _stage_precision),
    ("compile", _stage_compile),
    ("accuracy", _stage_accuracy),
    ("benchmark", _stage_benchmark),
    ("verdict", _stage_verdict),
    ("reports", _stage_reports),
]
