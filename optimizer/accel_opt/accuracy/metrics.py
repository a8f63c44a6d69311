"""Task metrics, computed here because Polygraphy has none: top-k agreement, embedding cosine, nearest-neighbour
agreement of embeddings, detection precision/recall against the reference's boxes."""

from __future__ import annotations

import logging

import numpy as np

from accel_opt.accuracy.evidence import DEFAULT_CONFIDENCE, RateEvidence, aimed_minimum, trials_needed
from accel_opt.accuracy.models import MAX_LISTED_SAMPLES, TaskMetricResult
from accel_opt.recipe.gate import CosineMetric, DetectionMetric, NeighbourMetric, TaskMetric, Tolerance, TopKMetric

log = logging.getLogger(__name__)



def _rows(outputs: list[dict[str, np.ndarray]], name: str) -> list[np.ndarray]:
    """One output per sample as (rows, last_dim) float64."""
    arrays = [np.asarray(out[name], dtype=np.float64) for out in outputs]
    return [a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1) for a in arrays]


def task_metric(metric: TaskMetric, ref_outs, cand_outs, names: list[str], confidence: float = DEFAULT_CONFIDENCE,
                bounded: bool = False) -> TaskMetricResult:
    """`metric` on the per-sample outputs. Its rates (top-k agreement, neighbours kept, boxes matched) carry their
    counts (`evidence`): judged by their lower bound at `confidence` where `bounded`, else by the observed rate."""
    name = metric.output or next(iter(ref_outs[0].keys()))
    note, worst = None, []
    evidence: dict[str, RateEvidence] = {}

    def rate(key: str, what: str, successes: int, trials: int, minimum: float, unit: str, failure: str) -> None:
        evidence[key] = RateEvidence(what=what, successes=successes, trials=trials, unit=unit, failure=failure,
                                     minimum=minimum, confidence=confidence, bounded=bounded)

    if isinstance(metric, DetectionMetric):
        return _detection_metric(metric, name, ref_outs, cand_outs, names, rate, evidence)
    ref_rows, cand_rows = _rows(ref_outs, name), _rows(cand_outs, name)
    ref, cand = np.concatenate(ref_rows), np.concatenate(cand_rows)
    owner = np.repeat(np.arange(len(names)), [len(r) for r in ref_rows])
    if isinstance(metric, TopKMetric):
        ref_top1 = ref.argmax(axis=1)
        ranked = np.argsort(-cand, axis=1)
        values, thresholds = {}, {}
        for k, minimum in metric.min_agreement.items():
            kept = int(sum(r in row[:k] for r, row in zip(ref_top1, ranked)))
            values[f"top{k}"], thresholds[f"top{k}"] = kept / len(ref), minimum
            rate(f"top{k}", f"top-{k} agreement", kept, len(ref), minimum, "rows", "changed")
        changed = sorted({int(i) for i in owner[ranked[:, 0] != ref_top1]})
        worst = [names[i] for i in changed][:MAX_LISTED_SAMPLES]
    elif isinstance(metric, CosineMetric):
        dots = (ref * cand).sum(axis=1)
        norms = np.linalg.norm(ref, axis=1) * np.linalg.norm(cand, axis=1)
        cos = np.where(norms > 0, dots / np.maximum(norms, 1e-30), 1.0)
        values = {"mean_cosine": float(cos.mean()), "worst_cosine": float(cos.min())}
        thresholds = {"mean_cosine": metric.min_mean_cosine, "worst_cosine": metric.min_worst_cosine}
        worst = [names[int(owner[i])] for i in np.argsort(cos)[:3] if cos[i] < metric.min_worst_cosine]
    elif isinstance(metric, NeighbourMetric):
        ref_nn, cand_nn = nearest_neighbours(ref), nearest_neighbours(cand)
        same = ref_nn == cand_nn
        values = {"neighbour_agreement": float(same.mean()) if len(ref) >= 3 else 1.0}
        thresholds = {"neighbour_agreement": metric.min_agreement}
        if len(ref) < 3:
            note = f"{len(ref)} embeddings: too few to have neighbours to agree on"
        else:
            rate("neighbour_agreement", "nearest-neighbour agreement", int(same.sum()), len(ref), metric.min_agreement, "rows",
                 "changed")
        worst = [names[int(owner[i])] for i in np.flatnonzero(~same)][:MAX_LISTED_SAMPLES]
    else:  # pragma: no cover - the recipe schema admits only the kinds above
        raise TypeError(f"unknown task metric {metric!r}")
    return _result(metric.kind, name, values, thresholds, evidence, note, worst)


def _result(kind: str, output: str, values: dict[str, float], thresholds: dict[str, float],
            evidence: dict[str, RateEvidence], note: str | None, worst: list[str]) -> TaskMetricResult:
    passed = all(evidence[k].status == "pass" if k in evidence else values[k] >= v for k, v in thresholds.items())
    return TaskMetricResult(kind=kind, output=output, values=values, thresholds=thresholds, evidence=evidence,
                            passed=passed, note=note, worst_samples=worst)


def _detection_metric(metric: DetectionMetric, name: str, ref_outs, cand_outs, names: list[str], rate,
                      evidence: dict[str, RateEvidence]) -> TaskMetricResult:
    from accel_opt.accuracy.detection import Detections, decode_predictions, match, nms, sum_counts

    def detections(array: np.ndarray) -> Detections:
        if metric.decoded:
            rows = np.asarray(array, dtype=np.float64).reshape(-1, 6)
            rows = rows[rows[:, 4] >= metric.score_threshold]
            return Detections(rows[:, :4], rows[:, 4], rows[:, 5].astype(np.int64))
        raw = decode_predictions(np.asarray(array), box_format=metric.box_format, layout=metric.layout,
                                           has_objectness=metric.has_objectness, score_threshold=metric.score_threshold)
        return nms(raw, metric.nms_iou)

    counts = []
    for ref, cand in zip(ref_outs, cand_outs):
        counts.append(match(detections(ref[name]), detections(cand[name]), metric.match_iou))
    pooled = sum_counts(counts)
    values = {"precision": pooled.precision, "recall": pooled.recall}
    thresholds = {"precision": metric.min_precision, "recall": metric.min_recall}
    order = sorted(range(len(counts)), key=lambda i: min(counts[i].precision, counts[i].recall))
    worst = [f"{names[i]} (P {counts[i].precision:.2f}, R {counts[i].recall:.2f})" for i in order[:5]
             if min(counts[i].precision, counts[i].recall) < 1.0]
    # Boxes are the trials: the metric is defined over them (boxes of one image are not independent, so the bound
    # is somewhat optimistic for images crowded with boxes; the note gives the image count beside it).
    rate("precision", "detection precision", pooled.matched, pooled.candidate, metric.min_precision, "candidate boxes",
         "unmatched")
    rate("recall", "detection recall", pooled.matched, pooled.reference, metric.min_recall, "reference boxes", "missed")
    note = f"{pooled.reference} reference and {pooled.candidate} candidate boxes over {len(counts)} samples"
    return _result(metric.kind, name, values, thresholds, evidence, note, worst)


def nearest_neighbours(rows: np.ndarray) -> np.ndarray:
    """For each row, the index of the most cosine-similar other row (the retrieval answer for that query)."""
    unit = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-30)
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    return similarity.argmax(axis=1)


def aimed_gate(tolerance: Tolerance, metrics: list[TaskMetric], verdict_samples: int, confidence: float,
               rows_per_sample: int = 1) -> tuple[Tolerance, list[TaskMetric], list[str]]:
    """The gate as a choice made on other samples (a search's probes, auto's shortlist) must see it for the held-out
    verdict on `verdict_samples` to certify the result: each rate's minimum (task metrics, the share of samples
    within tolerance) raised to the observed rate that still clears the recipe's minimum by its bound
    (evidence.aimed_minimum). Returns (tolerance, metrics, one line per rate that no result on that many held-out
    samples can certify). Rows are `rows_per_sample` per sample; a detector's boxes are not known before it runs, so its
    rates are aimed as if each sample held one box (the stricter reading) and never declared out of reach."""
    aimed, hopeless = [], []

    def aim(value: float, what: str, trials: int | None) -> float:
        target = aimed_minimum(value, trials or verdict_samples, confidence)
        if target is None and trials is not None:
            hopeless.append(f"{what} >= {value:.1%} needs {trials_needed(value, confidence)} held-out "
                            f"{'samples' if rows_per_sample == 1 else 'rows'} at {confidence:.0%} confidence, {trials} given")
        return value if target is None else max(target, value)

    rows = verdict_samples * rows_per_sample
    for metric in metrics:
        if isinstance(metric, TopKMetric):
            metric = metric.model_copy(update={"min_agreement": {k: aim(v, f"top-{k} agreement", rows)
                                                                 for k, v in metric.min_agreement.items()}})
        elif isinstance(metric, NeighbourMetric):
            metric = metric.model_copy(update={"min_agreement": aim(metric.min_agreement, "nearest-neighbour agreement",
                                                                    rows)})
        elif isinstance(metric, DetectionMetric):
            metric = metric.model_copy(update={"min_precision": aim(metric.min_precision, "detection precision", None),
                                               "min_recall": aim(metric.min_recall, "detection recall", None)})
        aimed.append(metric)
    if tolerance.max_failing_fraction > 0:
        within = aim(1 - tolerance.max_failing_fraction, "samples within tolerance", verdict_samples)
        tolerance = tolerance.model_copy(update={"max_failing_fraction": 1 - within})
    return tolerance, aimed, hopeless
