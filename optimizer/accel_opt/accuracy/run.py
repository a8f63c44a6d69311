"""Running the reference and the candidate for the gate: the reference per sample, the candidate as deployed
(batches of the deployed size, cut back into samples), and the float32 noise floor from a second fp32 run."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
from polygraphy.backend.base import BaseRunner

from accel_opt.accuracy.evidence import DEFAULT_CONFIDENCE
from accel_opt.accuracy.judge import judge, quiet_polygraphy
from accel_opt.accuracy.labeled import labeled_accuracy
from accel_opt.accuracy.models import (
    FP32_NOISE_ULPS,
    NOISE_FLOOR_MARGIN,
    NOISE_SAMPLES,
    AccuracyReport,
    Check,
    Evaluation,
)
from accel_opt.data import (
    UNBATCHED,
    BatchAxes,
    Sample,
    concat_samples,
    leading_axes,
    output_batch_axis,
    pack_batches,
    rows_of,
    sample_key,
    split_output,
)
from accel_opt.errors import AccelOptError, InputRejected, first_line
from accel_opt.preprocess.text import Padding
from accel_opt.recipe.gate import LabelsConfig, TaskMetric, Tolerance

log = logging.getLogger(__name__)



def compare(
    reference: BaseRunner,
    candidate: BaseRunner,
    samples: list[Sample],
    tolerance: Tolerance,
    task_metrics: Sequence[TaskMetric] = (),
    names: list[str] | None = None,
    batch_size: int = 1,
    batch_axes: BatchAxes | None = None,
    candidate_samples: list[Sample] | None = None,
    noise_reference: BaseRunner | None = None,
    noise_floor: dict[str, float] | None = None,
    reference_outputs: list[dict[str, np.ndarray]] | None = None,
    padding: Padding | None = None,
    confidence: float = DEFAULT_CONFIDENCE,
    bounded: bool = False,
    reference_cache: ReferenceCache | None = None,
    groups: list[str] | None = None,
    labels: list[int] | None = None,
    labels_config: LabelsConfig | None = None,
) -> AccuracyReport:
    """Run the reference per sample and the candidate in batches of `batch_size` rows (along
    `batch_axes`; default: axis 0 of every input that has one), then judge every output of every sample.
    `candidate_samples`: the same samples as the candidate takes them (a model with fused preprocessing
    takes the host's uint8 crops), one per sample. `noise_reference`: the same fp32 model through other
    kernels (graph optimizations on); its distance to the reference on the first samples is the float32
    noise floor below which no error counts (see fp32_noise_floor), unless `noise_floor` gives it.
    `reference_outputs`: the reference's outputs on these samples from an earlier call (report._reference_outputs),
    for callers that judge many candidates against one reference; the reference is then not run again.
    `padding`: texts of several lengths (preprocess.text.Padding): the candidate's batches are padded as the job pads
    them, while the reference runs each text alone, so an answer that depends on its batch-mates fails the gate.
    `bounded`: rates are judged by their lower bound at `confidence` (judge()): a sign-off on held-out samples.
    `reference_cache`: the reference's outputs kept across calls (one --precision auto run's candidates): samples it
    already ran are not run again. `groups`: each sample's group, where samples share sources: rates count groups.
    `labels`: each sample's class (--labels): accuracy under both models is reported, and gated as `labels_config`
    says (labeled_checks)."""
    names = names or [f"sample-{i:04d}" for i in range(len(samples))]
    if reference_outputs is not None:
        ref_outs = reference_outputs
    else:
        ref_outs = run_reference(reference, samples, names, reference_cache)
    if noise_floor is None and noise_reference is not None:
        noise_floor = fp32_noise_floor(noise_reference, samples, ref_outs)
    fed = candidate_samples if candidate_samples is not None else samples
    axes = batch_axes if batch_axes is not None else leading_axes(fed[0])
    with quiet_polygraphy(), candidate:
        cand_outs, evaluation = run_candidate(candidate, fed, ref_outs, batch_size, axes, padding)
    report = judge(ref_outs, cand_outs, names, tolerance, task_metrics, reference.name, candidate.name, evaluation,
                   noise_floor, confidence, bounded, groups)
    if labels:
        add_labeled_checks(report, ref_outs, cand_outs, labels, labels_config or LabelsConfig(), bounded)
    report._reference_outputs = ref_outs
    return report


class ReferenceCache:
    """The reference's outputs by (reference, input content): one --precision auto run builds every candidate against
    the same reference on (mostly) the same samples, so each sample runs through it once. `identity` names the
    reference (its model's sha256 and kind); an entry is a sample's content hash (data.sample_key)."""

    def __init__(self, identity: str):
        self.identity, self.outputs = identity, {}

    def get(self, sample: Sample) -> dict[str, np.ndarray] | None:
        return self.outputs.get(sample_key(sample))

    def put(self, sample: Sample, outputs: dict[str, np.ndarray]) -> None:
        self.outputs[sample_key(sample)] = outputs


def run_reference(reference: BaseRunner, samples: list[Sample], names: list[str],
                  cache: ReferenceCache | None = None) -> list[dict[str, np.ndarray]]:
    """The reference's outputs on every sample, one sample per call; from `cache` where it has them."""
    outputs = [cache.get(s) if cache is not None else None for s in samples]
    missing = [i for i, out in enumerate(outputs) if out is None]
    if missing:
        with quiet_polygraphy(), reference:
            for i in missing:
                outputs[i] = _infer(reference, samples[i], names[i])
                if cache is not None:
                    cache.put(samples[i], outputs[i])
    return outputs


def fp32_noise_floor(other_fp32: BaseRunner, samples: list[Sample],
                     ref_outs: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Per float output, how far two valid float32 evaluations of the model lie apart: NOISE_FLOOR_MARGIN x the
    largest |other - reference| over the first NOISE_SAMPLES samples, and at least FP32_NOISE_ULPS float32 ulps
    of the output's peak. A nearly constant output (PP-OCRv4's probability map on synthetic inputs: std 2.3e-4)
    made 4e-6 of reordering noise read as 1.8% of its scale; errors below this floor are not errors."""
    diffs: dict[str, float] = {}
    peaks: dict[str, float] = {}
    with quiet_polygraphy(), other_fp32:
        for sample, ref in list(zip(samples, ref_outs))[:NOISE_SAMPLES]:
            other = _infer(other_fp32, sample, "a noise probe")
            for name, r in ref.items():
                r = np.asarray(r)
                if r.dtype.kind != "f" or name not in other or np.shape(other[name]) != r.shape:
                    continue
                finite = np.isfinite(r) & np.isfinite(other[name])
                delta = np.abs(np.asarray(other[name], np.float64) - r)[finite]
                diffs[name] = max(diffs.get(name, 0.0), float(delta.max()) if delta.size else 0.0)
                peaks[name] = max(peaks.get(name, 0.0), float(np.abs(r[finite]).max()) if finite.any() else 0.0)
    eps = float(np.finfo(np.float32).eps)
    return {name: max(NOISE_FLOOR_MARGIN * diffs[name], FP32_NOISE_ULPS * eps * peaks[name]) for name in diffs}


def _infer(runner: BaseRunner, feed: Sample, name: str) -> dict[str, np.ndarray]:
    """One inference; a model that fails on an evaluation input is an input problem (exit 3), not a crash."""
    try:
        return dict(runner.infer(feed, check_inputs=False))
    except AccelOptError:
        raise
    except Exception as exc:  # the runtimes' own error types
        raise InputRejected(f"{runner.name} failed on {name}: {first_line(exc)}") from None


def run_candidate(runner: BaseRunner, samples: list[Sample], ref_outs: list[dict[str, np.ndarray]], batch_size: int,
                   axes: BatchAxes, padding: Padding | None = None) -> tuple[list[dict[str, np.ndarray]], Evaluation]:
    note = None
    if padding is not None:  # texts: batched as the job batches them (by length, within its token budget)
        groups = padding.plan([next(iter(s.values())).shape[1] for s in samples],
                              batch_size) if batch_size > 1 else None
    else:
        groups = pack_batches(samples, batch_size, axes) if batch_size > 1 else None
    if batch_size > 1 and groups is None:
        note = f"the samples cannot be packed into batches of exactly {batch_size} rows: run one sample per call"
    if groups is not None:
        outs: list[dict[str, np.ndarray] | None] = [None] * len(samples)
        output_axes: dict[str, int] = {}
        for group in groups:
            members = [samples[i] for i in group]
            feed = padding.batch(members) if padding is not None else concat_samples(members, axes)
            batch_out = runner.infer(feed, check_inputs=False)
            for name, array in batch_out.items():
                shapes = [ref_outs[i][name].shape for i in group if name in ref_outs[i]]
                axis = output_batch_axis(np.shape(array), shapes) if len(shapes) == len(group) else None
                if axis is None:
                    note = f"output {name} cannot be cut back into samples: run one sample per call"
                    break
                output_axes[name] = axis
                parts = split_output(np.asarray(array), axis, [s[axis] if axis != UNBATCHED else 1 for s in shapes])
                for index, part in zip(group, parts):
                    outs[index] = outs[index] or {}
                    outs[index].setdefault(name, part)  # a padded repeat keeps its first result
            if note:
                break
        if note is None:
            sizes = sorted({len(set(group)) for group in groups})
            varied = (f"texts batched by length as the job batches them, {sizes[0]}-{sizes[-1]} per call, each batch "
                      "padded to its longest" if padding is not None and len(sizes) > 1 else None)
            return outs, Evaluation(mode="batched", batch_size=batch_size, calls=len(groups),
                                    output_batch_axes=output_axes,
                                    note=varied)
    outs = [_infer(runner, s, f"sample {i}") for i, s in enumerate(samples)]
    rows = min(rows_of(s, axes) for s in samples)
    return outs, Evaluation(mode="per-sample", batch_size=rows, calls=len(samples), note=note)


def add_labeled_checks(report: AccuracyReport, ref_outs: list[dict[str, np.ndarray]],
                       cand_outs: list[dict[str, np.ndarray]], labels: list[int], config: LabelsConfig,
                       bounded: bool) -> None:
    """Add the labels' checks to `report` (at its confidence); under `gate: labels` the checks already there
    (agreement with fp32) stay reported but no longer gate: the verdict and its failures are the labels' alone."""
    report.checks += labeled_checks(ref_outs, cand_outs, labels, config, report.confidence, bounded)
    if config.labels_only:
        for check in report.checks:
            check.gated = check.labeled is not None
    report.failures = [c.line for c in report.checks if c.gated and not c.passed]


def labeled_checks(ref_outs: list[dict[str, np.ndarray]], cand_outs: list[dict[str, np.ndarray]], labels: list[int],
                   config, confidence: float, bounded: bool = True) -> list:
    """The gate's checks on the labels (recipe.gate.LabelsConfig `config`): top-1 gated when a limit is given, every
    other k (up to the number of classes) reported as a passing check, so each lands in signoff.md, JUnit and JSON.
    Not `bounded` (fp32 builds, steering samples): the observed drop is judged, its bound reported, like every rate."""
    output = config.output or next(iter(ref_outs[0]))
    classes = int(np.asarray(ref_outs[0][output]).size)
    if max(labels, default=0) >= classes:
        raise InputRejected(f"a label is {max(labels)}, and output {output!r} scores {classes} classes")
    checks = []
    for k in sorted({k for k in config.top_k if k < classes} | {1}):
        gated = k == 1
        result = labeled_accuracy(ref_outs, cand_outs, labels, output, k, confidence,
                                  config.max_drop if gated else None, config.min_relative if gated else None, bounded)
        checks.append(Check(name=f"labels: top-{k} accuracy", passed=result.status == "pass", line=result.line(),
                            labeled=result))
    return checks
