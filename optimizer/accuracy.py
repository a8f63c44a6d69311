"""Accuracy gate: every sample and every output of a candidate against the fp32 reference.

The reference runs sample by sample; the candidate runs as deployed: batches of the deployed batch
size, cut back into samples (data.output_batch_axis). Each output is judged at its own scale (see
recipe.Tolerance, the one definition of "within tolerance"): over all samples together (scaled
error, cosine, gain, and Polygraphy's absolute statistics) and within each sample (scaled error,
cosine), so one broken sample among many fails and is named. Task metrics (top-k agreement,
embedding cosine, detection precision/recall) are computed here because Polygraphy has none.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
from polygraphy.backend.base import BaseRunner
from polygraphy.comparator import CosineSimilarityCompareFunc, SimpleCompareFunc
from polygraphy.comparator.struct import IterationResult
from polygraphy.logger import G_LOGGER
from pydantic import BaseModel, PrivateAttr

from accel_opt.data import (
    UNBATCHED,
    BatchAxes,
    Sample,
    concat_samples,
    leading_axes,
    output_batch_axis,
    pack_batches,
    rows_of,
    split_output,
)
from accel_opt.errors import AccelOptError, InputRejected, first_line
from accel_opt.recipe import CosineMetric, DetectionMetric, TaskMetric, Tolerance, TopKMetric

log = logging.getLogger(__name__)

NEAR_ZERO_RMS_FRACTION = 1e-2  # a sample whose reference RMS is below 1% of the output's has no direction
NOISE_SAMPLES = 4  # samples run through a second fp32 evaluation to measure the float32 noise floor
NOISE_FLOOR_MARGIN = 2.0  # x the measured fp32-vs-fp32 distance: other kernels' reordering lands within it
FP32_NOISE_ULPS = 64  # the floor is at least this many float32 ulps of an output's peak |value|
WORST_SAMPLES_PER_OUTPUT = 3  # listed in the sign-off besides every failing sample
MAX_LISTED_SAMPLES = 20


class SampleAccuracy(BaseModel):
    sample: str  # the file it came from (or synthetic-NNNN)
    output: str
    error: float  # the error statistic of |cand - ref| / scale within this sample
    cosine: float | None  # None: the reference is ~all zeros here, no direction to compare
    non_finite_count: int
    passed: bool


class OutputAccuracy(BaseModel):
    name: str
    shape: list[int]  # of one sample's reference output
    scale: float  # what errors are divided by
    # std of the reference; its max |value| if constant; 1 if all zero; "exact": an integer/bool output, compared
    # element by element (its error is the fraction of elements that differ, its cosine and gain are 1)
    scale_basis: Literal["std", "max abs", "unit", "exact"]
    error: float  # error statistic of the scaled error over all samples
    worst_sample_error: float
    cosine: float  # over all samples (Polygraphy)
    worst_sample_cosine: float | None
    samples_without_direction: int  # per-sample cosine skipped: reference ~all zeros
    failed_samples: int
    gain: float  # least-squares gain <cand, ref> / <ref, ref>; 1 = no systematic scale error
    max_abs_error: float  # absolute statistics over all samples (Polygraphy)
    mean_abs_error: float
    median_abs_error: float
    max_rel_error: float
    mean_rel_error: float
    non_finite_count: int  # NaN or Inf in the candidate output
    passed: bool
    agreement: float | None = None  # "exact" outputs: the fraction of elements equal to the reference
    noise_floor: float = 0.0  # absolute: differences below it are float32 noise, not error (fp32_noise_floor)


class TaskMetricResult(BaseModel):
    kind: str
    output: str
    values: dict[str, float]
    thresholds: dict[str, float]
    passed: bool
    note: str | None = None  # e.g. too few samples for the threshold to tolerate a single change
    worst_samples: list[str] = []  # samples whose prediction changed (top-k) or that lost most (detection)


class Check(BaseModel):
    """One check of the gate (an output's numeric check, a task metric threshold): what CI lists."""

    name: str  # e.g. "logits: per-sample", "task topk: top1"
    passed: bool
    line: str  # the one-line result, the failure reason when it failed


class Evaluation(BaseModel):
    """How the candidate was run: what the verdict rests on besides the data."""

    mode: Literal["batched", "per-sample"]
    batch_size: int  # rows per candidate call
    calls: int
    note: str | None = None  # why batching fell back to one sample per call
    output_batch_axes: dict[str, int] = {}  # batched: where each output holds its samples (-1: the same for all)
    deployment: str | None = None  # the artifact folder and file the candidate was loaded from (set by the build)


class AccuracyReport(BaseModel):
    reference: str
    candidate: str
    tolerance: Tolerance
    sample_count: int
    evaluation: Evaluation
    outputs: list[OutputAccuracy]
    worst_samples: list[SampleAccuracy]  # every failing sample and the worst few that passed, worst first
    task_metrics: list[TaskMetricResult]
    checks: list[Check]  # every check, passed or not
    failures: list[str]  # one line per failed check, empty when passed
    # compare(): the reference's outputs per sample, kept in memory (not serialized) for the folder's probe set
    _reference_outputs: list[dict[str, np.ndarray]] = PrivateAttr(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def worst_cosine(self) -> float:
        return min((o.cosine for o in self.outputs if o.agreement is None), default=1.0)


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
) -> AccuracyReport:
    """Run the reference per sample and the candidate in batches of `batch_size` rows (along
    `batch_axes`; default: axis 0 of every input that has one), then judge every output of every sample.
    `candidate_samples`: the same samples as the candidate takes them (a model with fused preprocessing
    takes the host's uint8 crops), one per sample. `noise_reference`: the same fp32 model through other
    kernels (graph optimizations on); its distance to the reference on the first samples is the float32
    noise floor below which no error counts (see fp32_noise_floor), unless `noise_floor` gives it."""
    names = names or [f"sample-{i:04d}" for i in range(len(samples))]
    with _quiet_polygraphy(), reference:
        ref_outs = [_infer(reference, s, name) for s, name in zip(samples, names)]
    if noise_floor is None and noise_reference is not None:
        noise_floor = fp32_noise_floor(noise_reference, samples, ref_outs)
    fed = candidate_samples if candidate_samples is not None else samples
    axes = batch_axes if batch_axes is not None else leading_axes(fed[0])
    with _quiet_polygraphy(), candidate:
        cand_outs, evaluation = run_candidate(candidate, fed, ref_outs, batch_size, axes)
    report = judge(ref_outs, cand_outs, names, tolerance, task_metrics, reference.name, candidate.name, evaluation,
                   noise_floor)
    report._reference_outputs = ref_outs
    return report


def fp32_noise_floor(other_fp32: BaseRunner, samples: list[Sample],
                     ref_outs: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Per float output, how far two valid float32 evaluations of the model lie apart: NOISE_FLOOR_MARGIN x the
    largest |other - reference| over the first NOISE_SAMPLES samples, and at least FP32_NOISE_ULPS float32 ulps
    of the output's peak. A nearly constant output (PP-OCRv4's probability map on synthetic inputs: std 2.3e-4)
    made 4e-6 of reordering noise read as 1.8% of its scale; errors below this floor are not errors."""
    diffs: dict[str, float] = {}
    peaks: dict[str, float] = {}
    with _quiet_polygraphy(), other_fp32:
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


def _quiet_polygraphy():
    """Polygraphy logs to stdout, which must stay clean for --json: only our own report speaks."""
    return G_LOGGER.verbosity(G_LOGGER.INFO if log.isEnabledFor(logging.DEBUG) else G_LOGGER.CRITICAL)


def run_candidate(runner: BaseRunner, samples: list[Sample], ref_outs: list[dict[str, np.ndarray]], batch_size: int,
                   axes: BatchAxes) -> tuple[list[dict[str, np.ndarray]], Evaluation]:
    note = None
    groups = pack_batches(samples, batch_size, axes) if batch_size > 1 else None
    if batch_size > 1 and groups is None:
        note = f"the samples cannot be packed into batches of exactly {batch_size} rows: run one sample per call"
    if groups is not None:
        outs: list[dict[str, np.ndarray] | None] = [None] * len(samples)
        output_axes: dict[str, int] = {}
        for group in groups:
            batch_out = runner.infer(concat_samples([samples[i] for i in group], axes), check_inputs=False)
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
            return outs, Evaluation(mode="batched", batch_size=batch_size, calls=len(groups), output_batch_axes=output_axes)
    outs = [_infer(runner, s, f"sample {i}") for i, s in enumerate(samples)]
    rows = min(rows_of(s, axes) for s in samples)
    return outs, Evaluation(mode="per-sample", batch_size=rows, calls=len(samples), note=note)


def judge(
    ref_outs: list[dict[str, np.ndarray]],
    cand_outs: list[dict[str, np.ndarray]],
    names: list[str],
    tolerance: Tolerance,
    task_metrics: Sequence[TaskMetric] = (),
    reference_name: str = "reference",
    candidate_name: str = "candidate",
    evaluation: Evaluation | None = None,
    noise_floor: dict[str, float] | None = None,
) -> AccuracyReport:
    """The verdict on per-sample outputs of the reference and the candidate (same order as `names`).
    A reference with NaN in an output is refused (InputRejected): nothing can be judged against it.
    `noise_floor`: per output, an absolute error below which a difference is float32 noise (fp32_noise_floor)."""
    _refuse_undefined_reference(ref_outs, names, reference_name)
    outputs: list[OutputAccuracy] = []
    per_sample: list[SampleAccuracy] = []
    checks: list[Check] = []
    for name in ref_outs[0]:
        missing = [n for n, out in zip(names, cand_outs) if name not in out]
        if missing:
            checks.append(Check(name=f"{name}: present", passed=False,
                                line=f"{name}: missing from the candidate's outputs ({len(missing)} samples)"))
            continue
        bad_shape = next(((n, c[name].shape, r[name].shape) for n, r, c in zip(names, ref_outs, cand_outs)
                          if np.shape(c[name]) != np.shape(r[name])), None)
        if bad_shape:
            checks.append(Check(name=f"{name}: shape", passed=False, line=f"{name}: sample {bad_shape[0]}: candidate "
                                f"shape {list(bad_shape[1])} != reference {list(bad_shape[2])}"))
            continue
        output, samples = _judge_output(name, [r[name] for r in ref_outs], [c[name] for c in cand_outs], names, tolerance,
                                        (noise_floor or {}).get(name, 0.0))
        outputs.append(output)
        per_sample += samples
        checks += _output_checks(output, samples, tolerance)

    task_results = [_task_metric(metric, ref_outs, cand_outs, names) for metric in task_metrics]
    for r in task_results:
        extra = (f" ({r.note})" if r.note else "") + (f"; worst: {', '.join(r.worst_samples[:3])}" if r.worst_samples else "")
        for key, minimum in r.thresholds.items():
            passed = r.values[key] >= minimum
            checks.append(Check(name=f"task {r.kind} on {r.output}: {key}", passed=passed,
                                line=f"task metric {r.kind} on {r.output}: {key}={r.values[key]:.4f} (min {minimum})"
                                + ("" if passed else extra)))
    failures = [c.line for c in checks if not c.passed]
    return AccuracyReport(
        reference=reference_name,
        candidate=candidate_name,
        tolerance=tolerance,
        sample_count=len(ref_outs),
        evaluation=evaluation or Evaluation(mode="per-sample", batch_size=1, calls=len(ref_outs)),
        outputs=outputs,
        worst_samples=_worst(per_sample, tolerance),
        task_metrics=task_results,
        checks=checks,
        failures=failures,
    )


def _refuse_undefined_reference(ref_outs: list[dict[str, np.ndarray]], names: list[str], reference_name: str) -> None:
    for name in ref_outs[0]:
        undefined = [n for n, out in zip(names, ref_outs) if name in out and np.asarray(out[name]).dtype.kind in "fc"
                     and np.isnan(out[name]).any()]  # only float outputs can hold NaN: no copies
        if undefined:
            raise InputRejected(
                f"the reference ({reference_name}) outputs NaN in {name} on {len(undefined)} of {len(names)} samples "
                f"(first: {undefined[0]}): the model is undefined on these inputs, so no build can be checked against "
                "it; give --data with inputs in the model's domain")


def _stat(values: np.ndarray, stat: str) -> float:
    if values.size == 0:
        return 0.0
    return float({"mean": np.mean, "median": np.median, "max": np.max}[stat](values))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b / norms) if norms > 0 else 0.0


def _judge_output(name: str, refs: list[np.ndarray], cands: list[np.ndarray], names: list[str],
                  tol: Tolerance, noise_floor: float = 0.0) -> tuple[OutputAccuracy, list[SampleAccuracy]]:
    if np.asarray(refs[0]).dtype.kind in "biu":
        return _judge_exact(name, refs, cands, names, tol)
    ref_raw = [np.asarray(r, dtype=np.float64).ravel() for r in refs]
    cand_raw = [np.asarray(c, dtype=np.float64).ravel() for c in cands]
    # A reference +-inf (a masked log-probability) is matched only by the same infinity, and then compares equal
    # (Polygraphy's infinities_compare_equal); it is left out of the statistics. Anywhere else a candidate NaN/Inf
    # fails apart: `ok` is False there, and the statistics see 0.
    kept = [np.isfinite(r) for r in ref_raw]
    ok = [np.where(k, np.isfinite(c), c == r) for k, c, r in zip(kept, cand_raw, ref_raw)]
    ref_flat = [r[k] for r, k in zip(ref_raw, kept)]
    cand_flat = [np.where(good[k], c[k], 0.0) for c, k, good in zip(cand_raw, kept, ok)]
    ref_all, cand_all = np.concatenate(ref_flat), np.concatenate(cand_flat)
    non_finite = int(sum(int((~good).sum()) for good in ok))

    std = float(ref_all.std()) if ref_all.size else 0.0
    peak = float(np.abs(ref_all).max()) if ref_all.size else 0.0
    scale, basis = (std, "std") if std > 0 else ((peak, "max abs") if peak > 0 else (1.0, "unit"))
    ref_rms = float(np.sqrt(np.mean(ref_all**2))) if ref_all.size else 0.0

    def scaled_error(c: np.ndarray, r: np.ndarray) -> np.ndarray:  # float32 noise below the floor is no error
        return np.maximum(np.abs(c - r) - noise_floor, 0.0) / scale

    samples: list[SampleAccuracy] = []
    for sample, r, c, good in zip(names, ref_flat, cand_flat, ok):
        error = _stat(scaled_error(c, r), tol.error_stat)
        has_direction = ref_rms > 0 and r.size > 0 and float(np.sqrt(np.mean(r**2))) >= NEAR_ZERO_RMS_FRACTION * ref_rms
        cosine = _cosine(c, r) if has_direction else None
        bad = int((~good).sum())
        passed = bad == 0 and error <= tol.max_sample_error and (cosine is None or cosine >= tol.min_sample_cosine)
        samples.append(SampleAccuracy(sample=sample, output=name, error=error, cosine=cosine, non_finite_count=bad,
                                      passed=passed))

    # Polygraphy's own statistics and cosine, over all samples together (absolute units).
    absolute = tol.atol is not None or tol.rtol is not None
    simple = SimpleCompareFunc(atol=tol.atol or 0.0 if absolute else math.inf, rtol=tol.rtol or 0.0 if absolute else math.inf,
                               check_error_stat=tol.error_stat)
    as_cand = IterationResult(outputs={name: cand_all}, runner_name="candidate")
    as_ref = IterationResult(outputs={name: ref_all}, runner_name="reference")
    with _quiet_polygraphy():
        stats = simple(as_cand, as_ref)[name]  # Polygraphy's rtol is relative to the second (reference)
        cosine = CosineSimilarityCompareFunc()(as_cand, as_ref)[name].cosine_similarity
    energy = float(ref_all @ ref_all)
    gain = float(cand_all @ ref_all / energy) if energy > 0 else (1.0 if not cand_all.any() else math.inf)
    directions = [s.cosine for s in samples if s.cosine is not None]
    output = OutputAccuracy(
        name=name,
        shape=list(np.shape(refs[0])),
        scale=scale,
        scale_basis=basis,
        error=_stat(scaled_error(cand_all, ref_all), tol.error_stat),
        worst_sample_error=max(s.error for s in samples),
        cosine=float(cosine),
        worst_sample_cosine=min(directions, default=None),
        samples_without_direction=len(samples) - len(directions),
        failed_samples=sum(not s.passed for s in samples),
        gain=gain,
        max_abs_error=float(stats.max_absdiff),
        mean_abs_error=float(stats.mean_absdiff),
        median_abs_error=float(stats.median_absdiff),
        max_rel_error=float(stats.max_reldiff),
        mean_rel_error=float(stats.mean_reldiff),
        non_finite_count=non_finite,
        noise_floor=noise_floor,
        passed=False,
    )
    output.passed = all(c.passed for c in _output_checks(output, samples, tol))
    return output, samples


def _judge_exact(name: str, refs: list[np.ndarray], cands: list[np.ndarray], names: list[str],
                 tol: Tolerance) -> tuple[OutputAccuracy, list[SampleAccuracy]]:
    """An integer/bool output: each sample's error is the fraction of its elements that differ."""
    differ = [np.asarray(c).ravel() != np.asarray(r).ravel() for r, c in zip(refs, cands)]
    changed = np.concatenate(differ)
    agreement = 1.0 - float(changed.mean()) if changed.size else 1.0
    samples = [SampleAccuracy(sample=sample, output=name, error=float(d.mean()) if d.size else 0.0, cosine=None,
                              non_finite_count=0, passed=True) for sample, d in zip(names, differ)]
    output = OutputAccuracy(
        name=name, shape=list(np.shape(refs[0])), scale=1.0, scale_basis="exact", error=1.0 - agreement,
        worst_sample_error=max(s.error for s in samples), cosine=1.0, worst_sample_cosine=None,
        samples_without_direction=len(samples), failed_samples=0, gain=1.0, max_abs_error=0.0, mean_abs_error=0.0,
        median_abs_error=0.0, max_rel_error=0.0, mean_rel_error=0.0, non_finite_count=0, passed=False,
        agreement=agreement,
    )
    output.passed = all(c.passed for c in _output_checks(output, samples, tol))
    return output, samples


def _output_checks(o: OutputAccuracy, samples: list[SampleAccuracy], tol: Tolerance) -> list[Check]:
    """Every numeric check of one output, passed or failed, each with its one-line reason."""
    def check(kind: str, passed: bool, line: str) -> Check:
        return Check(name=f"{o.name}: {kind}", passed=passed, line=f"{o.name}: {line}")

    if o.agreement is not None:
        within = o.agreement >= tol.min_agreement
        differing = [s.sample for s in samples if s.error > 0]
        elements = len(samples) * max(1, math.prod(o.shape))
        note = None if within else _resolution_note(elements, tol.min_agreement)
        return [check("agreement", within, f"{o.agreement:.2%} of the elements equal the reference "
                      f"{'>=' if within else '<'} {tol.min_agreement:.2%}"
                      + (f"; {len(differing)} of {len(samples)} samples differ, first {differing[0]}" if differing else "")
                      + (f" ({note})" if note else ""))]

    abs_err = _abs(o, tol.error_stat)
    checks = [
        check("finite", not o.non_finite_count, f"{o.non_finite_count} NaN/Inf values in the candidate output "
              "where the reference has a finite value or another infinity"),
        check("error", o.error <= tol.max_error,
              f"{tol.error_stat} error {o.error:.3g} of the output's scale {'<=' if o.error <= tol.max_error else '>'} "
              f"{tol.max_error:g} (scale: {o.scale_basis} {o.scale:.4g}; {tol.error_stat} abs error {abs_err:.4g}"
              + (f"; fp32 noise floor {o.noise_floor:.3g}" if o.noise_floor else "") + ")"),
        check("cosine", o.cosine >= tol.min_cosine,  # NaN fails too
              f"cosine {o.cosine:.6f} {'>=' if o.cosine >= tol.min_cosine else '<'} {tol.min_cosine}"),
        check("gain", abs(o.gain - 1) <= tol.max_gain_error,
              f"gain {o.gain:.4f}: the candidate is {o.gain:.3f}x the reference "
              f"(|gain - 1| {'<=' if abs(o.gain - 1) <= tol.max_gain_error else '>'} {tol.max_gain_error:g})"),
    ]
    failed = [s for s in samples if not s.passed]
    line = f"all {len(samples)} samples within error {tol.max_sample_error:g} and cosine {tol.min_sample_cosine}"
    if failed:
        worst = max(failed, key=lambda s: _severity(s, tol))
        why = []
        if worst.non_finite_count:
            why.append(f"{worst.non_finite_count} NaN/Inf")
        if worst.cosine is not None and not worst.cosine >= tol.min_sample_cosine:
            why.append(f"cosine {worst.cosine:.4f} < {tol.min_sample_cosine}")
        if worst.error > tol.max_sample_error:
            why.append(f"error {worst.error:.3g} > {tol.max_sample_error:g}")
        line = f"{len(failed)} of {len(samples)} samples fail the per-sample check; worst {worst.sample}: {', '.join(why)}"
    checks.append(check("per-sample", not failed, line))
    if tol.atol is not None or tol.rtol is not None:
        stat = tol.error_stat
        rel_err = {"max": o.max_rel_error, "mean": o.mean_rel_error}.get(stat, o.mean_rel_error)
        within = abs_err <= (tol.atol or 0.0) or rel_err <= (tol.rtol or 0.0)
        checks.append(check("absolute", within, f"{stat} error {'within' if within else 'beyond'} atol={tol.atol or 0:g}/"
                                                 f"rtol={tol.rtol or 0:g} ({stat} abs {abs_err:.3g}, {stat} rel {rel_err:.3g})"))
    return checks


def _abs(o: OutputAccuracy, stat: str) -> float:
    return {"max": o.max_abs_error, "mean": o.mean_abs_error, "median": o.median_abs_error}[stat]


def _severity(s: SampleAccuracy, tol: Tolerance) -> float:
    """How far a sample is from its limits (1 = at a limit); NaN/Inf first."""
    if s.non_finite_count:
        return math.inf
    by_error = s.error / max(tol.max_sample_error, 1e-12)
    by_cosine = (1 - s.cosine) / max(1 - tol.min_sample_cosine, 1e-12) if s.cosine is not None else 0.0
    return max(by_error, by_cosine)


def _worst(samples: list[SampleAccuracy], tol: Tolerance) -> list[SampleAccuracy]:
    ranked = sorted(samples, key=lambda s: _severity(s, tol), reverse=True)
    listed, per_output = [], {}
    for s in ranked:
        shown = per_output.get(s.output, 0)
        if not s.passed or shown < WORST_SAMPLES_PER_OUTPUT:
            listed.append(s)
            per_output[s.output] = shown + 1
    return listed[:MAX_LISTED_SAMPLES]


def _rows(outputs: list[dict[str, np.ndarray]], name: str) -> list[np.ndarray]:
    """One output per sample as (rows, last_dim) float64."""
    arrays = [np.asarray(out[name], dtype=np.float64) for out in outputs]
    return [a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1) for a in arrays]


def _task_metric(metric: TaskMetric, ref_outs, cand_outs, names: list[str]) -> TaskMetricResult:
    name = metric.output or next(iter(ref_outs[0].keys()))
    note, worst = None, []
    if isinstance(metric, DetectionMetric):
        return _detection_metric(metric, name, ref_outs, cand_outs, names)
    ref_rows, cand_rows = _rows(ref_outs, name), _rows(cand_outs, name)
    ref, cand = np.concatenate(ref_rows), np.concatenate(cand_rows)
    owner = np.repeat(np.arange(len(names)), [len(r) for r in ref_rows])
    if isinstance(metric, TopKMetric):
        ref_top1 = ref.argmax(axis=1)
        ranked = np.argsort(-cand, axis=1)
        values = {f"top{k}": float(np.mean([r in row[:k] for r, row in zip(ref_top1, ranked)])) for k in metric.min_agreement}
        thresholds = {f"top{k}": v for k, v in metric.min_agreement.items()}
        note = _resolution_note(len(ref), min(thresholds.values()))
        changed = sorted({int(i) for i in owner[ranked[:, 0] != ref_top1]})
        worst = [names[i] for i in changed][:MAX_LISTED_SAMPLES]
    elif isinstance(metric, CosineMetric):
        dots = (ref * cand).sum(axis=1)
        norms = np.linalg.norm(ref, axis=1) * np.linalg.norm(cand, axis=1)
        cos = np.where(norms > 0, dots / np.maximum(norms, 1e-30), 1.0)
        values = {"mean_cosine": float(cos.mean()), "worst_cosine": float(cos.min())}
        thresholds = {"mean_cosine": metric.min_mean_cosine, "worst_cosine": metric.min_worst_cosine}
        worst = [names[int(owner[i])] for i in np.argsort(cos)[:3] if cos[i] < metric.min_worst_cosine]
    else:  # pragma: no cover - the recipe schema admits only the kinds above
        raise TypeError(f"unknown task metric {metric!r}")
    passed = all(values[k] >= v for k, v in thresholds.items())
    return TaskMetricResult(kind=metric.kind, output=name, values=values, thresholds=thresholds, passed=passed,
                            note=note, worst_samples=worst)


def _detection_metric(metric: DetectionMetric, name: str, ref_outs, cand_outs, names: list[str]) -> TaskMetricResult:
    from accel_opt import detection

    def detections(array: np.ndarray) -> detection.Detections:
        if metric.decoded:
            rows = np.asarray(array, dtype=np.float64).reshape(-1, 6)
            rows = rows[rows[:, 4] >= metric.score_threshold]
            return detection.Detections(rows[:, :4], rows[:, 4], rows[:, 5].astype(np.int64))
        raw = detection.decode_predictions(np.asarray(array), box_format=metric.box_format, layout=metric.layout,
                                           has_objectness=metric.has_objectness, score_threshold=metric.score_threshold)
        return detection.nms(raw, metric.nms_iou)

    counts = []
    for ref, cand in zip(ref_outs, cand_outs):
        counts.append(detection.match(detections(ref[name]), detections(cand[name]), metric.match_iou))
    pooled = detection.sum_counts(counts)
    values = {"precision": pooled.precision, "recall": pooled.recall}
    thresholds = {"precision": metric.min_precision, "recall": metric.min_recall}
    order = sorted(range(len(counts)), key=lambda i: min(counts[i].precision, counts[i].recall))
    worst = [f"{names[i]} (P {counts[i].precision:.2f}, R {counts[i].recall:.2f})" for i in order[:5]
             if min(counts[i].precision, counts[i].recall) < 1.0]
    note = f"{pooled.reference} reference and {pooled.candidate} candidate boxes over {len(counts)} samples"
    return TaskMetricResult(kind=metric.kind, output=name, values=values, thresholds=thresholds,
                            passed=all(values[k] >= v for k, v in thresholds.items()), note=note, worst_samples=worst)


def _resolution_note(rows: int, min_agreement: float) -> str | None:
    """Say so when one changed prediction alone fails an agreement threshold that means to allow some."""
    if min_agreement >= 1.0 or (rows - 1) / rows >= min_agreement:
        return None
    needed = math.ceil(1 / (1 - min_agreement) - 1e-9)
    return (f"{rows} evaluation rows: one changed prediction ({1 / rows:.1%}) already fails the minimum "
            f"{min_agreement}; give at least {needed} for the gate to tolerate a single near-tie")
