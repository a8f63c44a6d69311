"""Checks a build makes of its own intermediate results, with the gate's rules: the simplified graph against the
original (cleanup), and the artifact's image path on generated images where the build's data were not images; and
of the recipe against the loaded model (refuse_recipe_misfits) and against this machine
(refuse_oversubscribed_threads)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from accel_opt.accuracy import compare
from accel_opt.backends.onnxruntime.backend import reference_runner
from accel_opt.data import Sample
from accel_opt.errors import AccelOptError, ResourceExhausted, UsageError
from accel_opt.graph.cleanup import CleanupReport, simplify
from accel_opt.machine.cpu import available_cpus
from accel_opt.preprocess.fit import generated_images, image_input
from accel_opt.preprocess.images import preprocess_image, read_image
from accel_opt.recipe.gate import Tolerance
from accel_opt.runtime.local.job import errors_path, run_job

log = logging.getLogger(__name__)


def refuse_oversubscribed_threads(threads: int | None) -> None:
    """UsageError (exit 2) for more intra-op threads than this process may use CPUs: they only contend with each other
    (measured: a fuzzed recipe's 7919 threads kept a build of a two-node model on 2 vCPUs running for minutes)."""
    if threads is not None and threads > available_cpus():
        raise UsageError(f"benchmark.threads (--threads) {threads} is more than the {available_cpus()} CPUs this "
                         "process may use: give at most that many, or none for all of them")


def cleanup(
    model_path: Path, total_bytes: int, samples: list[Sample], tolerance: Tolerance, threads: int, out_path: Path
) -> tuple[Path, CleanupReport]:
    """Return (model to use, report): `out_path` when the simplified model matches the original within the recipe's
    fp32 tolerance on `samples` (both run unoptimized on the ORT CPU EP, judged like any build), else `model_path`."""
    simplified, partial = simplify(model_path, total_bytes, out_path)
    if simplified is None:
        return model_path, partial
    counts = partial.model_dump(include={"nodes_before", "nodes_after", "ops_before", "ops_after"})
    try:
        report = compare(reference_runner(model_path, threads), reference_runner(out_path, threads), samples, tolerance,
                         noise_reference=reference_runner(model_path, threads, optimize=True))
    except AccelOptError as exc:
        reason = f"simplified model does not load ({exc}); original kept"
        return model_path, CleanupReport(applied=False, reason=reason, **counts)
    max_abs = max((o.max_abs_error for o in report.outputs), default=0.0)
    cosine = report.worst_cosine
    if not report.passed:
        reason = f"simplified model differs from the original ({'; '.join(report.failures)}); original kept"
        log.warning(reason)
        return model_path, CleanupReport(applied=False, reason=reason, max_abs_error=max_abs, cosine=cosine, **counts)
    reason = f"verified on {report.sample_count} samples (max abs error {max_abs:.3g})"
    return out_path, CleanupReport(applied=True, reason=reason, max_abs_error=max_abs, cosine=cosine, **counts)


def exercise_image_path(deployment, data_source: str, workdir: Path, seed: int = 0) -> list[str]:
    """Run `accel-opt run`'s job (its reader, batching and the deployed model) on generated images when
    the artifact takes images (`preprocessing`) but the build's data were not images (.npz feed dicts
    or synthetic); returns the build note ([] when not needed). Raises UsageError, in one line, when
    the recorded preprocessing does not make what the artifact takes."""
    pre = deployment.config.preprocessing
    if pre is None or data_source == "images":
        return []
    images = generated_images(workdir / "image-check", pre, seed=seed)
    spec = image_input(pre, list(deployment.config.inputs))
    made = preprocess_image(read_image(images[0], pre), pre.host_part())
    if made.dtype.name != spec.dtype:
        raise UsageError(f"the recorded preprocessing makes {spec.name} as {made.dtype.name}, the artifact takes "
                         f"{spec.dtype}")
    predictions = workdir / "image-check.jsonl"
    summary = run_job(deployment, [images[0].parent], predictions, overwrite=True, workers=1)
    if summary.rejected:
        first = errors_path(predictions).read_text().splitlines()[0]
        raise UsageError(f"the artifact does not take images with its recorded preprocessing (resize {pre.resize}, "
                         f"crop {pre.crop}): {json.loads(first)['error']}")
    return [f"The image path was exercised: `accel-opt run`'s job (decode, resize {pre.resize}, crop {pre.crop}, "
            f"normalize, {pre.layout}) ran the artifact on {summary.predicted} generated images, as the build's data "
            f"were {'synthetic' if data_source == 'synthetic' else data_source + ' feed dicts'}."]


def refuse_recipe_misfits(ctx) -> None:
    """UsageError (exit 2) for a recipe that does not fit the loaded model, before any sample is read: an output it
    names that the model lacks (a task metric's, the postprocess's), or fused preprocessing where it cannot apply."""
    recipe, outputs = ctx.recipe, [o.name for o in ctx.loaded.outputs]
    named = [(f"accuracy.task_metrics[{i}].output", m.output) for i, m in enumerate(recipe.accuracy.task_metrics)]
    if recipe.postprocess is not None:
        named.append(("postprocess.output", recipe.postprocess.output))
        if recipe.postprocess.embedding is not None:
            named.append(("postprocess.embedding.output", recipe.postprocess.embedding.output))
    for key, name in named:
        if name is not None and name not in outputs:
            raise UsageError(f"the recipe's {key} names {name!r}, which the model does not output (its outputs: "
                             f"{', '.join(outputs)})")
    from accel_opt.accuracy.detection import output_misfit

    for i, metric in enumerate(recipe.accuracy.task_metrics):
        spec = next((o for o in ctx.loaded.outputs if o.name == metric.output), ctx.loaded.outputs[0])
        if metric.kind == "detection" and (misfit := output_misfit(spec.shape, metric.decoded, metric.layout,
                                                                   metric.has_objectness)):
            raise UsageError(f"the recipe's accuracy.task_metrics[{i}] (detection) reads output {spec.name!r}, which "
                             f"{misfit}: not a detector's output (another recipe, or task_metrics for this model)")
    if ctx.fused and ctx.torch:
        raise UsageError("preprocessing.fused rewrites the ONNX graph; the torch backend ships the PyTorch module and "
                         "runs its image preprocessing as tensor ops on its device instead: drop `fused`")
    data_dir = ctx.setup.data_dir
    if ctx.fused and (data_dir is None or any(Path(data_dir).glob("*.npz"))):
        raise UsageError("preprocessing.fused needs --data with image files: the fused model takes decoded crops")


def refuse_oversized(ctx, available_bytes: int | None = None) -> None:
    """ResourceExhausted (exit 5) naming the estimate when the model declares more memory than this machine has
    available (`available_bytes`, read here by default): its largest tensor at the build's input shapes, or its weights
    together. Checked before the reference runs, so an allocation that cannot succeed never starts."""
    from accel_opt.graph.sizes import largest_tensor, weights
    from accel_opt.machine.memory import available_memory_bytes

    available = available_bytes if available_bytes is not None else available_memory_bytes()
    if available is None:
        return
    proto = ctx.loaded.model.proto
    for declared in (largest_tensor(proto, ctx.shapes.shapes), weights(proto)):
        if declared is not None and declared.bytes > available:
            raise ResourceExhausted(f"{ctx.model_path.name}: {declared.what} takes {_gib(declared.bytes)}, more than "
                                    "the "
                                    f"{_gib(available)} of memory available here: refused before anything runs it")


def _gib(size: int) -> str:
    return f"{size / (1 << 30):,.1f} GiB"
