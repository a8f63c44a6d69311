"""Accuracy gate: a candidate runner against the fp32 reference runner, with Polygraphy.

Polygraphy's Comparator runs both runners over the same samples; its compare functions compute the
error statistics and cosine similarity. We apply them to all evaluation samples *together* (outputs
concatenated), because a per-sample cosine is meaningless on a sample whose reference output is
nearly all zeros, and a reviewer wants one number per output. Task metrics (top-k agreement,
embedding cosine) are computed here because Polygraphy has none.
"""

from __future__ import annotations

import logging
import math

import numpy as np
from polygraphy.backend.base import BaseRunner
from polygraphy.comparator import Comparator, CosineSimilarityCompareFunc, SimpleCompareFunc
from polygraphy.comparator.struct import IterationResult
from polygraphy.logger import G_LOGGER
from pydantic import BaseModel

from accel_opt.data import Sample
from accel_opt.recipe import CosineMetric, TaskMetric, Tolerance, TopKMetric

log = logging.getLogger(__name__)


class OutputAccuracy(BaseModel):
    name: str
    shape: list[int]  # of one sample
    max_abs_error: float
    mean_abs_error: float
    median_abs_error: float
    max_rel_error: float
    mean_rel_error: float
    cosine: float
    non_finite_count: int  # NaN or Inf in the candidate output
    within_tolerance: bool
    passed: bool


class TaskMetricResult(BaseModel):
    kind: str
    output: str
    values: dict[str, float]
    thresholds: dict[str, float]
    passed: bool
    note: str | None = None  # e.g. too few samples for the threshold to tolerate a single change


class AccuracyReport(BaseModel):
    reference: str
    candidate: str
    tolerance: Tolerance
    sample_count: int
    outputs: list[OutputAccuracy]
    task_metrics: list[TaskMetricResult]
    failures: list[str]  # one line per failed check, empty when passed

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def worst_cosine(self) -> float:
        return min((o.cosine for o in self.outputs), default=1.0)


def compare(
    reference: BaseRunner,
    candidate: BaseRunner,
    samples: list[Sample],
    tolerance: Tolerance,
    task_metrics: list[TaskMetric] = (),
) -> AccuracyReport:
    """Run both runners on `samples` and judge every output of the candidate against the reference."""
    # Polygraphy logs to stdout, which must stay clean for --json: only our own report speaks.
    with G_LOGGER.verbosity(G_LOGGER.INFO if log.isEnabledFor(logging.DEBUG) else G_LOGGER.CRITICAL):
        run_results = Comparator.run([reference, candidate], data_loader=samples)
        return _judge(run_results, tolerance, task_metrics)


def _judge(run_results, tolerance: Tolerance, task_metrics: list[TaskMetric]) -> AccuracyReport:
    (ref_name, ref_iters), (cand_name, cand_iters) = run_results.items()
    ref_all = _concatenate(ref_iters, ref_name)
    cand_all = _concatenate(cand_iters, cand_name)

    simple = SimpleCompareFunc(atol=tolerance.atol, rtol=tolerance.rtol, check_error_stat=tolerance.error_stat)
    cosine = CosineSimilarityCompareFunc(cosine_similarity_threshold=tolerance.min_cosine)
    simple_results = simple(cand_all, ref_all)  # Polygraphy's rtol is relative to the second (reference)
    cosine_results = cosine(cand_all, ref_all)

    outputs: list[OutputAccuracy] = []
    failures: list[str] = []
    for name in ref_all:
        if name not in cand_all:
            failures.append(f"{name}: missing from the candidate's outputs")
            continue
        stats, cos = simple_results[name], cosine_results[name].cosine_similarity
        non_finite = int(np.size(cand_all[name]) - np.isfinite(np.asarray(cand_all[name], dtype=np.float64)).sum())
        within = bool(stats) and non_finite == 0
        passed = within and cos >= tolerance.min_cosine
        outputs.append(
            OutputAccuracy(
                name=name,
                shape=list(np.shape(ref_iters[0][name])),
                max_abs_error=stats.max_absdiff,
                mean_abs_error=stats.mean_absdiff,
                median_abs_error=stats.median_absdiff,
                max_rel_error=stats.max_reldiff,
                mean_rel_error=stats.mean_reldiff,
                cosine=cos,
                non_finite_count=non_finite,
                within_tolerance=within,
                passed=passed,
            )
        )
        if non_finite:
            failures.append(f"{name}: {non_finite} NaN/Inf values in the candidate output")
        elif not bool(stats):
            stat = tolerance.error_stat if tolerance.error_stat != "elemwise" else "max"
            abs_err, rel_err = getattr(stats, f"{stat}_absdiff"), getattr(stats, f"{stat}_reldiff")
            failures.append(
                f"{name}: {tolerance.error_stat} error beyond atol={tolerance.atol:g}/rtol={tolerance.rtol:g} "
                f"({stat} abs {abs_err:.3g}, {stat} rel {rel_err:.3g})"
            )
        if cos < tolerance.min_cosine or np.isnan(cos):
            failures.append(f"{name}: cosine {cos:.6f} < {tolerance.min_cosine}")

    task_results = [_task_metric(metric, ref_iters, cand_iters) for metric in task_metrics]
    failures += [
        f"task metric {r.kind} on {r.output}: " + ", ".join(f"{k}={r.values[k]:.4f} (min {v})" for k, v in r.thresholds.items())
        + (f" ({r.note})" if r.note else "")
        for r in task_results
        if not r.passed
    ]
    return AccuracyReport(
        reference=ref_name,
        candidate=cand_name,
        tolerance=tolerance,
        sample_count=len(ref_iters),
        outputs=outputs,
        task_metrics=task_results,
        failures=failures,
    )


def _concatenate(iterations: list[IterationResult], runner_name: str) -> IterationResult:
    outputs = {
        name: np.concatenate([np.asarray(it[name]).ravel() for it in iterations]) for name in iterations[0]
    }
    return IterationResult(outputs=outputs, runner_name=runner_name)


def _rows(iterations: list[IterationResult], name: str) -> np.ndarray:
    """Stack one output over samples as (rows, last_dim) in float64."""
    arrays = [np.asarray(it[name], dtype=np.float64) for it in iterations]
    return np.concatenate([a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1) for a in arrays])


def _task_metric(metric: TaskMetric, ref_iters, cand_iters) -> TaskMetricResult:
    name = metric.output or next(iter(ref_iters[0].keys()))
    ref, cand = _rows(ref_iters, name), _rows(cand_iters, name)
    note = None
    if isinstance(metric, TopKMetric):
        ref_top1 = ref.argmax(axis=1)
        ranked = np.argsort(-cand, axis=1)
        values = {f"top{k}": float(np.mean([r in row[:k] for r, row in zip(ref_top1, ranked)])) for k in metric.min_agreement}
        thresholds = {f"top{k}": v for k, v in metric.min_agreement.items()}
        note = _resolution_note(len(ref), min(thresholds.values()))
    elif isinstance(metric, CosineMetric):
        dots = (ref * cand).sum(axis=1)
        norms = np.linalg.norm(ref, axis=1) * np.linalg.norm(cand, axis=1)
        cos = np.where(norms > 0, dots / np.maximum(norms, 1e-30), 1.0)
        values = {"mean_cosine": float(cos.mean()), "worst_cosine": float(cos.min())}
        thresholds = {"mean_cosine": metric.min_mean_cosine, "worst_cosine": metric.min_worst_cosine}
    else:  # pragma: no cover - the recipe schema admits only the kinds above
        raise TypeError(f"unknown task metric {metric!r}")
    passed = all(values[k] >= v for k, v in thresholds.items())
    return TaskMetricResult(kind=metric.kind, output=name, values=values, thresholds=thresholds, passed=passed,
                            note=note)


def _resolution_note(rows: int, min_agreement: float) -> str | None:
    """Say so when one changed prediction alone fails an agreement threshold that means to allow some."""
    if min_agreement >= 1.0 or (rows - 1) / rows >= min_agreement:
        return None
    needed = math.ceil(1 / (1 - min_agreement) - 1e-9)
    return (f"{rows} evaluation rows: one changed prediction ({1 / rows:.1%}) already fails the minimum "
            f"{min_agreement}; give at least {needed} for the gate to tolerate a single near-tie")
