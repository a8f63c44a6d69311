"""The one orchestrator: the order of stages, their timing and status, and the artifact folder.

Domain modules are plain functions (path in -> path out, data in -> report out); only this module knows the
sequence export -> load -> cleanup -> precision -> compile -> accuracy -> benchmark -> verdict -> reports. Each stage
returns its frozen result (builder/context.py), handed to the next in a new BuildSoFar. A stage passes, is skipped
(with the reason), or fails: a failed accuracy gate still produces reports (not signed off, exit 1); any other failure
raises and leaves no artifact."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

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
from accel_opt.builder.context import BuildSoFar, CandidateLimits, Checked, Cleaned, Exported, Loaded, Reduced, Setup
from accel_opt.builder.fallback_actions import fallback_actions
from accel_opt.builder.records import artifact_name, data_record, made_mark, reuse, write_manifest, write_reports
from accel_opt.builder.samples import data_samples_needed, read_and_split, too_few_to_certify
from accel_opt.builder.sources import factory_of, recipe_for
from accel_opt.builder.staging import batch_problem, deploy_shapes, stage_deployment
from accel_opt.builder.torch_plan import torch_precision
from accel_opt.data.npz import array_names
from accel_opt.errors import AccelOptError, Unsupported, UsageError, no_space_error, termination_requested
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
    """Raised by a stage that has nothing to do; the message is the reason, `results` what it still hands on."""

    def __init__(self, reason: str, **results):
        super().__init__(reason)
        self.results = results


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
        raise Unsupported(f"--backend torch builds PyTorch factories (FILE.py:FACTORY), not {Path(str(model)).name}: "
                          "an "
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
            ctx = BuildSoFar(Setup(
                model_path=model_path, recipe=recipe, data_dir=Path(data_dir) if data_dir else None, workdir=work,
                staging=staging, cache_dir=Path(cache_dir) if cache_dir else out_dir / ".cache", backend=backend,
                threads=recipe.benchmark.threads or available_cpus(), factory=factory,
                eval_data_dir=Path(eval_data_dir) if eval_data_dir else None, limits=limits,
                reference_caches=reference_caches, cpu=cpu, signer=signer, notes=tuple(source_notes)))
            if model_path.is_file():  # the staged artifact holds at least a copy of the model
                ensure_free_space(work, model_path.stat().st_size)
            for name, stage in STAGES:
                ctx = _run_stage(ctx, name, stage, stages, on_stage)
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
                worst_cosine=ctx.checked.accuracy.worst_cosine, data=data_record(ctx),
                evaluated=ctx.checked.accuracy.evaluation.deployment,
                samples_needed=ctx.checked.accuracy.samples_needed, trial_unit=ctx.checked.accuracy.trial_unit,
                data_samples_needed=data_samples_needed(ctx, ctx.checked.accuracy.samples_needed),
                timed_samples=ctx.dealt.samples.timed_deployed,
            )
            fill_headline(result, ctx.measured)
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


def _run_stage(ctx: BuildSoFar, name: str, stage: Stage, stages: list[StageResult], on_stage) -> BuildSoFar:
    """Run one stage, timed; record (and report) it as passed, skipped or failed; failures re-raise. Returns what the
    next stage is handed: `ctx` with this stage's results added."""
    progress.info("%s", name, extra={"stage": name})  # a live progress line shows it begin
    started = time.perf_counter()
    try:
        status, detail, results = stage(ctx)
    except _Skip as skip:
        status, detail, results = "skipped", str(skip), skip.results
    except BaseException as exc:
        detail = str(exc) if isinstance(exc, AccelOptError) else f"{type(exc).__name__}: {exc}"
        stages.append(StageResult(name=name, status="failed", seconds=time.perf_counter() - started, detail=detail))
        if on_stage:
            on_stage(stages[-1])
        raise
    if (asked := termination_requested()) is not None:  # a SIGTERM a library swallowed: stop here all the same
        raise asked
    stages.append(StageResult(name=name, status=status, seconds=time.perf_counter() - started, detail=detail))
    if on_stage:
        on_stage(stages[-1])
    return replace(ctx, **results)


# ---- stages: each returns (status, detail, its results by BuildSoFar field) or raises _Skip / AccelOptError ----


def _stage_export(ctx: BuildSoFar) -> Outcome:
    factory, recipe = ctx.setup.factory, ctx.recipe
    if factory is None:
        raise _Skip("the input is an ONNX model")
    from accel_opt.accuracy.export_check import verify
    from accel_opt.backends.torch.export import export

    if not recipe.shapes and recipe.text is not None and "input_dtypes" in factory.export_hints:
        # Token inputs: a short example sequence (the factory's `dynamic` hint keeps the sequence axis free).
        example = [1, min(EXAMPLE_TOKENS, recipe.text.max_length)]
        recipe = recipe.with_overrides(shapes={name: example for name in factory.export_hints["input_dtypes"]})
    if not recipe.shapes:
        raise UsageError(f"{factory.spec}: a PyTorch factory needs --shapes to build its example inputs")
    module = factory()
    if ctx.torch:  # what ships is torch.export's program: a module it cannot trace fails here, with its reason
        ctx.setup.backend.check_traceable(module, recipe.shapes, factory.export_hints.get("input_dtypes"))
    onnx_path = ctx.setup.workdir / "export" / ctx.model_path.name
    exported = export(module, recipe.shapes, onnx_path, **factory.export_hints)
    verification = verify(module, onnx_path, recipe.shapes, threads=ctx.setup.threads)  # GateFailed on mismatch
    record = {"factory": factory.spec, "export": exported.model_dump(mode="json"),
              "verification": verification.model_dump(mode="json")}
    notes = [*exported.notes, f"Exported from {factory.spec} ({exported.exporter} exporter, opset {exported.opset}); "
                              "the PyTorch module is the accuracy reference."]
    return "passed", f"{exported.exporter} exporter, opset {exported.opset}, verified against PyTorch", {
        "exported": Exported(torch_module=module, onnx_path=onnx_path, record=record, recipe=recipe,
                             notes=tuple(notes))}


def _reference(ctx: BuildSoFar):
    """The accuracy reference: the PyTorch module for torch inputs, else the original ONNX on ORT."""
    if ctx.torch_module is not None:
        from accel_opt.backends.torch.factory import torch_runner

        return torch_runner(ctx.torch_module, ctx.model_path, ctx.setup.threads, name="reference-pytorch")
    return reference_runner(ctx.model_path, ctx.setup.threads)


def _stage_load(ctx: BuildSoFar) -> Outcome:
    source = ctx.model_path
    data_dir = ctx.setup.data_dir
    model = load_model(source, ctx.setup.workdir, fed=array_names(data_dir) if data_dir else set())
    inputs, outputs = io_specs(model.proto)
    notes = list(model.notes)
    recipe = fit_preprocessing(ctx.recipe, inputs, notes)  # before any image is read
    encoder = tokenizer = None
    if recipe.text is not None:
        from accel_opt.preprocess.text import TextEncoder, find_tokenizer

        factory = ctx.setup.factory
        hint = getattr(factory.fn, "tokenizer_file", None) if factory is not None else None
        tokenizer = find_tokenizer(recipe.text, hint, source, inputs)
        encoder = TextEncoder(tokenizer, recipe.text, {s.name: s.dtype for s in inputs})
        notes.append(encoder.describe())
    loaded = Loaded(model=model, source_path=source, model_sha256=sha256_file(source),
                    external_data_sha256={p.name: sha256_file(p) for p in model.external_data_files},
                    inputs=inputs, outputs=outputs, recipe=recipe, text_encoder=encoder, tokenizer_path=tokenizer,
                    notes=tuple(notes))
    refuse_recipe_misfits(replace(ctx, loaded=loaded))
    dealt = read_and_split(replace(ctx, loaded=loaded))  # by role, once: no stage rewrites them
    if recipe.text is not None and not recipe.benchmark.max_shapes:  # capacity at the longest text the job takes
        loaded = replace(loaded, recipe=recipe.with_overrides(**{"benchmark.max_shapes": {
            name: [dealt.deploy_batch, recipe.text.max_length] for name in encoder.inputs}}))
    so_far = replace(ctx, loaded=loaded, dealt=dealt)
    # Checked now: a wrong --max-shapes is a usage error before any work.
    dealt = replace(dealt, max_feed=max_feed(so_far, so_far.fused))
    refuse_oversized(so_far)  # before the reference runs: an allocation that cannot succeed never starts
    shapes = ", ".join(f"{k}:{'x'.join(map(str, v)) or 'scalar'}" for k, v in dealt.shapes.shapes.items())
    roles = dealt.split.counts()
    return "passed", (
        f"opset {model.opset}, {len(model.proto.graph.node)} nodes, inputs {shapes}; {roles['calibration']} "
        f"calibration + {roles['steering']} steering + {roles['verdict']} held-out samples ({dealt.data.source})"
    ), {"loaded": loaded, "dealt": dealt}


def _stage_cleanup(ctx: BuildSoFar) -> Outcome:
    if not ctx.recipe.cleanup.enabled:
        raise _Skip("disabled by the recipe")
    if ctx.torch:
        raise _Skip("the torch backend compiles the PyTorch module, not the ONNX graph")
    samples = ctx.dealt.samples
    checked_on = (samples.steering or samples.calibration)[:CLEANUP_VERIFY_SAMPLES]  # never held-out ones
    if not checked_on:
        raise _Skip("no steering sample to check the rewrite on (held-out samples judge the verdict only)")
    total_bytes = sum(p.stat().st_size for p in [ctx.model_path, *ctx.loaded.model.external_data_files])
    cleaned = Cleaned(*cleanup(ctx.model_path, total_bytes, checked_on, ctx.recipe.accuracy.tolerances[Precision.fp32],
                               ctx.setup.threads, ctx.setup.workdir / "cleaned.onnx"))
    report = cleaned.report
    if not report.applied:
        raise _Skip(report.reason, cleaned=cleaned)
    return "passed", f"{report.nodes_before} -> {report.nodes_after} nodes; {report.reason}", {"cleaned": cleaned}


def _stage_precision(ctx: BuildSoFar) -> Outcome:
    precision, config = ctx.recipe.precision, ctx.recipe.precision_options.fallback
    if precision is Precision.fp32:
        raise _Skip("fp32: the graph keeps its precision")
    if ctx.torch:
        return torch_precision(ctx)
    # The search is steered by the steering samples only: neither calibration (the ranges fit those) nor the verdict's
    # held-out samples (a search that picks the variant doing best on them would judge itself).
    steering = ctx.dealt.samples.steering[: config.steering_samples]
    fixed = fallback.wide_weight_consumers(ctx.fp32_path) if precision is Precision.fp16 else []
    out = ctx.setup.workdir / f"{precision.value}.onnx"
    _, _, hopeless = ctx.steering_gate()
    skipped = None
    if config.enabled and hopeless:
        skipped = ("insufficient evidence", f"not searched: {hopeless[0]}, so no build it rescued could sign off")
    elif config.enabled and not steering:
        skipped = ("disabled", "not searched: no steering samples to judge variants on (give --data with more samples)")
    if skipped:
        config = config.model_copy(update={"enabled": False})
    report, searched, candidate = fallback.run(
        precision, config, fallback_actions(ctx, steering, deploy_shapes(ctx, fused=False)), out, len(steering),
        "steering samples", fixed, ctx.setup.limits)
    if skipped:
        searched.status, searched.reason = skipped
    searched.steering_slack = fallback.STEERING_MARGIN
    report.notes.append(f"Fallback: {searched.status}, {searched.reason}.")
    kept = len(report.kept_in_higher_precision)
    detail = f"{report.transform}; {kept} nodes kept in higher precision; fallback {searched.status}"
    if searched.steps:
        detail += f" ({len(searched.steps)} steps in {searched.search_seconds:.0f} s, " \
                  f"{searched.fp32_flops_fraction:.1%} of FLOPs in float)"
    return "passed", detail, {"reduced": Reduced(candidate_path=candidate, precision=report, fallback=searched)}


def _stage_compile(ctx: BuildSoFar) -> Outcome:
    compiled = stage_deployment(ctx, deploy_shapes(ctx))
    problem = batch_problem(replace(ctx, compiled=compiled))
    if problem:  # a batch axis the model's dims do not name (silero_vad.onnx's state): deploy as given
        axes = ", ".join(f"{n}:{'none' if a is None else a}" for n, a in ctx.shapes.batch_axes.items())
        note = (f"The model fails at batch {ctx.deploy_batch} with batch axes {axes} ({problem}); deployed and "
                f"benchmarked at the shapes given. Give --batch-axes NAME:AXIS for an input whose batch axis the "
                "model does not name.")
        shapes = ctx.shapes.model_copy(update={"batch_dynamic": False})
        for path in ctx.setup.staging.iterdir():
            path.unlink()
        as_given = replace(ctx, dealt=replace(ctx.dealt, shapes=shapes, deploy_batch=shapes.batch_size))
        compiled = stage_deployment(as_given, shapes.shapes)
        compiled = replace(compiled, notes=(note, *compiled.notes))
    c = compiled.compiled
    detail = f"{c.backend} on {c.device} via {', '.join(c.providers)}, {c.threads} threads, {c.build_seconds:.2f} s"
    if "int8_check" in c.settings:  # what the package's kernels compute in (torch: PT2E int8)
        compiled = replace(compiled, notes=(*compiled.notes,
                                            f"Kernels of the int8 package: {c.settings['int8_check']}."))
        detail += f"; {c.settings['int8_check']}"
    return "passed", detail, {"compiled": compiled}


def _stage_accuracy(ctx: BuildSoFar) -> Outcome:
    recipe, deployment, samples = ctx.recipe, ctx.deployment, ctx.dealt.samples
    reference = _reference(ctx)
    identity = f"{reference.name}:{ctx.loaded.model_sha256}"
    caches = ctx.setup.reference_caches
    cache = caches.setdefault(identity, ReferenceCache(identity)) if caches is not None else None
    candidate = deployment.runner(runtime.feed_dtypes_of(samples.held_out_deployed))
    accuracy = compare(
        reference, candidate, samples.held_out, recipe.tolerance, recipe.accuracy.task_metrics,
        names=samples.held_out_names, batch_size=deployment.batch_size, batch_axes=deployment.batch_axes,
        candidate_samples=samples.held_out_deployed, noise_reference=reference_runner(ctx.model_path, ctx.setup.threads,
                                                                                      optimize=True),
        padding=deployment.padding, confidence=recipe.accuracy.confidence, bounded=ctx.bounded, reference_cache=cache,
        groups=ctx.eval_groups, labels=ctx.eval_labels, labels_config=recipe.accuracy.labels)
    accuracy.roles = ctx.dealt.split.counts()
    if samples.steering:  # what auto's shortlist reads: the deployed build on samples the verdict never sees
        tolerance, metrics, hopeless = ctx.steering_gate()
        steered = compare(reference, candidate, samples.steering, tolerance, metrics, names=samples.steering_names,
                          batch_size=deployment.batch_size, batch_axes=deployment.batch_axes,
                          candidate_samples=samples.steering_deployed, padding=deployment.padding,
                          noise_floor={o.name: o.noise_floor for o in accuracy.outputs}, reference_cache=cache,
                          labels=ctx.steering_labels, labels_config=recipe.accuracy.labels)
        accuracy.steering = SteeringVerdict(sample_count=steered.sample_count, passed=steered.passed and not hopeless,
                                            loss=steered.loss, worst_cosine=steered.worst_cosine,
                                            failures=(hopeless + steered.failures)[:3])
    accuracy.evaluation.deployment = deployment.describe(artifact_name(ctx))
    # What the gate found (where each output holds a batch's samples) is part of how the artifact runs.
    deployment = replace(deployment, config=deployment.config.model_copy(
        update={"output_batch_axes": accuracy.evaluation.output_batch_axes}))
    notes = exercise_image_path(deployment, ctx.dealt.data.source, ctx.setup.workdir, recipe.accuracy.seed)
    if ctx.torch and ctx.dealt.data.source == "images":  # the folder takes its device path's own image inputs
        notes.append(image_path_agreement(_reference(ctx), samples.held_out_deployed, accuracy._reference_outputs,
                                          ctx.loaded.outputs[0].name))
    checked = {"checked": Checked(accuracy=accuracy, deployment=deployment, notes=tuple(notes))}
    evaluation = accuracy.evaluation
    calls = (f"{evaluation.calls} calls of batch {evaluation.batch_size}" if evaluation.mode == "batched"
             else "one per sample")
    summary = f"{accuracy.sample_count} held-out samples ({calls}), worst cosine {accuracy.worst_cosine:.6f}"
    bounds = [c.evidence.line() for c in accuracy.checks if c.evidence is not None and c.evidence.minimum < 1]
    if accuracy.bounded and bounds:
        summary += "; " + "; ".join(bounds)
    if accuracy.verdict == "insufficient":
        return "failed", (f"{summary}; not enough held-out samples to sign off: {accuracy.samples_needed} needed "
                          "(--data with more samples, or --eval-data)"), checked
    if not accuracy.passed:
        return "failed", summary + "; " + "; ".join(accuracy.failures), checked
    return "passed", summary, checked


def _stage_benchmark(ctx: BuildSoFar) -> Outcome:
    status, detail, bench = benchmark_build(ctx, deploy_shapes(ctx, fused=False), ctx.image_input)
    return status, detail, {"measured": bench}


def _stage_verdict(ctx: BuildSoFar) -> Outcome:
    """The build's one verdict (report.verdict.decide): the accuracy gate, the benchmark's budgets, and for a reduced
    precision the benefit over its fp32 build at the deployed batch."""
    benefit = None
    if ctx.recipe.precision is not Precision.fp32:
        benefit = benefit_of(ctx.measured, ctx.deploy_batch, ctx.recipe.benchmark.min_speedup,
                             ctx.recipe.accuracy.confidence)
    verdict = decide(ctx.checked.accuracy, ctx.measured.failures, benefit)
    return ("passed" if verdict.signed_off else "failed"), verdict.line(), {"verdict": verdict}


def _stage_reports(ctx: BuildSoFar) -> Outcome:
    return "passed", write_reports(ctx), {}


Outcome = tuple[StageStatus, str, dict[str, Any]]  # status, one-line detail, the results handed on by field name
Stage = Callable[[BuildSoFar], Outcome]
STAGES: list[tuple[str, Stage]] = [
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
