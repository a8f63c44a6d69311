"""The verdict on per-sample outputs: each output judged at its own scale, over all samples together and within
each sample, every check with its one-line reason (recipe.Tolerance is the one definition of "within tolerance")."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np
from polygraphy.comparator import CosineSimilarityCompareFunc, SimpleCompareFunc
from polygraphy.comparator.struct import IterationResult
from polygraphy.logger import G_LOGGER

from accel_opt.accuracy.evidence import DEFAULT_CONFIDENCE, RateEvidence, Trials
from accel_opt.accuracy.metrics import task_metric
from accel_opt.accuracy.models import (
    MAX_LISTED_SAMPLES,
    NEAR_ZERO_RMS_FRACTION,
    WORST_SAMPLES_PER_OUTPUT,
    AccuracyReport,
    Check,
    Evaluation,
    OutputAccuracy,
    SampleAccuracy,
)
from accel_opt.errors import InputRejected
from accel_opt.recipe.gate import TaskMetric, Tolerance

log = logging.getLogger(__name__)


def quiet_polygraphy():
    """Polygraphy logs to stdout, which must stay clean for --json: only our own report speaks."""
    return G_LOGGER.verbosity(G_LOGGER.INFO if log.isEnabledFor(logging.DEBUG) else G_LOGGER.CRITICAL)



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
    confidence: float = DEFAULT_CONFIDENCE,
    bounded: bool = False,
    groups: list[str] | None = None,
) -> AccuracyReport:
    """The verdict on per-sample outputs of the reference and the candidate (same order as `names`).
    A reference with NaN in an output is refused (InputRejected): nothing can be judged against it.
    `noise_floor`: per output, an absolute error below which a difference is float32 noise (fp32_noise_floor).
    `bounded`: every rate (samples within tolerance, task metrics' agreements) must clear its minimum by its one-sided
    lower bound at `confidence` (a reduced-precision sign-off on held-out samples); otherwise by the observed rate.
    `groups`: each sample's group (samples sharing a source): every rate then counts groups as its trials."""
    _refuse_undefined_reference(ref_outs, names, reference_name)
    trials = Trials.of(names, groups)
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
        output, samples = _judge_output(name, [r[name] for r in ref_outs], [c[name] for c in cand_outs],
                                        names, tolerance,
                                        (noise_floor or {}).get(name, 0.0), confidence, bounded, trials)
        outputs.append(output)
        per_sample += samples
        checks += _output_checks(output, samples, tolerance, confidence, bounded, trials)

    task_results = [task_metric(metric, ref_outs, cand_outs, names, confidence, bounded, trials)
                    for metric in task_metrics]
    for r in task_results:
        extra = (f" ({r.note})" if r.note else "") + (f"; worst: {', '.join(r.worst_samples[:3])}"
                                                      if r.worst_samples else "")
        for key, minimum in r.thresholds.items():
            evidence = r.evidence.get(key)
            if evidence is not None:
                passed = evidence.status == "pass"
                hint = evidence.shortfall_hint()
                line = f"task metric {r.kind} on {r.output}: {evidence.line()}" + (f"; {hint}" if hint else "")
            else:
                passed = r.values[key] >= minimum
                line = f"task metric {r.kind} on {r.output}: {key}={r.values[key]:.4f} (min {minimum})"
            checks.append(Check(name=f"task {r.kind} on {r.output}: {key}", passed=passed, evidence=evidence,
                                line=line + ("" if passed or (evidence is not None
                                                              and evidence.status == "insufficient")
                                             else extra)))
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
        confidence=confidence,
        bounded=bounded,
        trial_unit=trials.unit,
        trial_count=trials.count,
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


def _unit(*arrays: np.ndarray) -> float:
    """The largest magnitude among finite `arrays`: products are taken on values divided by it, since squares of
    values past ~1e154 overflow even float64 (ONNX's own test models feed 5.9e199)."""
    peak = max((float(np.abs(a).max()) for a in arrays if a.size), default=0.0)
    return peak if 0.0 < peak < math.inf else 1.0


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    unit = _unit(a, b)
    a, b = a / unit, b / unit
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b / norms) if norms > 0 else 0.0


def _judge_output(name: str, refs: list[np.ndarray], cands: list[np.ndarray], names: list[str],
                  tol: Tolerance, noise_floor: float = 0.0, confidence: float = DEFAULT_CONFIDENCE,
                  bounded: bool = False, trials: Trials | None = None) -> tuple[OutputAccuracy, list[SampleAccuracy]]:
    if np.asarray(refs[0]).dtype.kind in "biu":
        return _judge_exact(name, refs, cands, names, tol, confidence, bounded, trials)
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
    if ref_all.size == 0:  # no finite value at all (a zero-sized output): judged element by element, no statistics
        return _judge_exact(name, refs, cands, names, tol, confidence, bounded, trials)
    non_finite = int(sum(int((~good).sum()) for good in ok))

    unit = _unit(ref_all, cand_all)  # sums of squares on values divided by it: no overflow at any magnitude
    std = float((ref_all / unit).std()) * unit if ref_all.size else 0.0
    peak = float(np.abs(ref_all).max()) if ref_all.size else 0.0
    scale, basis = (std, "std") if std > 0 else ((peak, "max abs") if peak > 0 else (1.0, "unit"))

    def rms(values: np.ndarray) -> float:
        return float(np.sqrt(np.mean((values / unit) ** 2))) * unit if values.size else 0.0

    ref_rms = rms(ref_all)

    def scaled_error(c: np.ndarray, r: np.ndarray) -> np.ndarray:  # float32 noise below the floor is no error
        return np.maximum(np.abs(c - r) - noise_floor, 0.0) / scale

    samples: list[SampleAccuracy] = []
    for sample, r, c, good in zip(names, ref_flat, cand_flat, ok):
        error = _stat(scaled_error(c, r), tol.error_stat)
        has_direction = ref_rms > 0 and r.size > 0 and rms(r) >= NEAR_ZERO_RMS_FRACTION * ref_rms
        cosine = _cosine(c, r) if has_direction else None
        bad = int((~good).sum())
        passed = bad == 0 and error <= tol.max_sample_error and (cosine is None or cosine >= tol.min_sample_cosine)
        samples.append(SampleAccuracy(sample=sample, output=name, error=error, cosine=cosine, non_finite_count=bad,
                                      passed=passed))

    # Polygraphy's own statistics and cosine, over all samples together (absolute units).
    absolute = tol.atol is not None or tol.rtol is not None
    simple = SimpleCompareFunc(atol=tol.atol or 0.0 if absolute else math.inf,
                               rtol=tol.rtol or 0.0 if absolute else math.inf,
                               check_error_stat=tol.error_stat)
    as_cand = IterationResult(outputs={name: cand_all}, runner_name="candidate")
    as_ref = IterationResult(outputs={name: ref_all}, runner_name="reference")
    scaled = {"candidate": IterationResult(outputs={name: cand_all / unit}, runner_name="candidate"),
              "reference": IterationResult(outputs={name: ref_all / unit}, runner_name="reference")}
    with quiet_polygraphy():
        stats = simple(as_cand, as_ref)[name]  # Polygraphy's rtol is relative to the second (reference)
        cosine = CosineSimilarityCompareFunc()(scaled["candidate"], scaled["reference"])[name].cosine_similarity
    energy = float((ref_all / unit) @ (ref_all / unit))
    gain = float((cand_all / unit) @ (ref_all / unit)
                 / energy) if energy > 0 else (1.0 if not cand_all.any() else math.inf)
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
    output.passed = all(c.passed for c in _output_checks(output, samples, tol, confidence, bounded, trials))
    return output, samples


def _judge_exact(name: str, refs: list[np.ndarray], cands: list[np.ndarray], names: list[str], tol: Tolerance,
                 confidence: float = DEFAULT_CONFIDENCE, bounded: bool = False,
                 trials: Trials | None = None) -> tuple[OutputAccuracy, list[SampleAccuracy]]:
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
    output.passed = all(c.passed for c in _output_checks(output, samples, tol, confidence, bounded, trials))
    return output, samples


def _output_checks(o: OutputAccuracy, samples: list[SampleAccuracy], tol: Tolerance,
                   confidence: float = DEFAULT_CONFIDENCE, bounded: bool = False,
                   trials: Trials | None = None) -> list[Check]:
    """Every numeric check of one output, passed or failed, each with its one-line reason. The per-sample check is a
    rate: the share of samples within tolerance, at least 1 - `tol.max_failing_fraction` (by its bound if `bounded`);
    with groups (`trials`), each group's share of its samples within tolerance is one trial."""
    def check(kind: str, passed: bool, line: str) -> Check:
        return Check(name=f"{o.name}: {kind}", passed=passed, line=f"{o.name}: {line}")

    trials = trials or Trials.of([s.sample for s in samples])
    each = np.arange(len(samples))

    if o.agreement is not None:  # ids compared exactly: each sample's share of equal elements, a trial per sample
        differing = [s.sample for s in samples if s.error > 0]
        elements = len(samples) * max(1, math.prod(o.shape))
        agreement = RateEvidence.of_samples(f"{o.name} elements equal to the reference",
                                            trials.shares(np.array([1 - s.error for s in samples]), each),
                                            rows=elements, rows_failed=round((1 - o.agreement) * elements),
                                            row_unit="elements", failure="changed", minimum=tol.min_agreement,
                                            confidence=confidence, bounded=bounded, unit=trials.unit)
        within = agreement.status == "pass"
        note = (f"{elements} elements: one changed element ({1 / elements:.1%}) already fails the minimum"
                if o.agreement < 1 and (elements - 1) / elements < tol.min_agreement else None)
        line = (agreement.line() if bounded else f"{o.agreement:.2%} of the elements equal the reference "
                f"{'>=' if within else '<'} {tol.min_agreement:.2%}")
        return [Check(name=f"{o.name}: agreement", passed=within, evidence=agreement, line=f"{o.name}: {line}"
                      + (f"; {len(differing)} of {len(samples)} samples differ, first {differing[0]}"
                         if differing else "")
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
    strict = tol.max_failing_fraction == 0
    within = RateEvidence.of_samples("samples within tolerance", trials.shares(np.array([s.passed for s in samples]),
                                                                               each),
                                     rows=len(samples), rows_failed=len(failed), row_unit="samples", unit=trials.unit,
                                     minimum=1.0 - tol.max_failing_fraction, confidence=confidence, bounded=bounded,
                                     floor=tol.strict_min_bound if strict else None)
    limits = f"error {tol.max_sample_error:g} and cosine {tol.min_sample_cosine}"
    if within.status == "insufficient":
        line = f"{within.line()} (within {limits})"
    elif strict:  # one failing sample fails; the bound says what the count shows
        line = f"all {len(samples)} samples within {limits}" + (
            f" (at most {1 - within.lower:.1%} of samples fail it, at {confidence:.0%} confidence)" if samples else "")
    else:
        line = f"{within.line()} (within {limits})"
    if failed:
        worst = max(failed, key=lambda s: _severity(s, tol))
        why = []
        if worst.non_finite_count:
            why.append(f"{worst.non_finite_count} NaN/Inf")
        if worst.cosine is not None and not worst.cosine >= tol.min_sample_cosine:
            why.append(f"cosine {worst.cosine:.4f} < {tol.min_sample_cosine}")
        if worst.error > tol.max_sample_error:
            why.append(f"error {worst.error:.3g} > {tol.max_sample_error:g}")
        counted = f"{len(failed)} of {len(samples)} samples fail the per-sample check" if strict else within.line()
        line = f"{counted}; worst {worst.sample}: {', '.join(why)}"
    checks.append(Check(name=f"{o.name}: per-sample", passed=within.status == "pass", line=f"{o.name}: {line}",
                        evidence=within))
    if tol.atol is not None or tol.rtol is not None:
        stat = tol.error_stat
        rel_err = {"max": o.max_rel_error, "mean": o.mean_rel_error}.get(stat, o.mean_rel_error)
        within = abs_err <= (tol.atol or 0.0) or rel_err <= (tol.rtol or 0.0)
        checks.append(check("absolute", within,
                            f"{stat} error {'within' if within else 'beyond'} atol={tol.atol or 0:g}/"
                                                 f"rtol={tol.rtol or 0:g} ({stat} abs {abs_err:.3g}, {stat} rel "
                                                 f"{rel_err:.3g})"))
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


