"""Task metrics, computed here because Polygraphy has none: top-k agreement, embedding cosine, nearest-neighbour
agreement of embeddings, detection precision/recall against the reference's boxes."""

from __future__ import annotations

import logging
import math

import numpy as np

from accel_opt.accuracy.models import MAX_LISTED_SAMPLES, TaskMetricResult
from accel_opt.recipe import CosineMetric, DetectionMetric, NeighbourMetric, TaskMetric, TopKMetric

log = logging.getLogger(__name__)



def _rows(outputs: list[dict[str, np.ndarray]], name: str) -> list[np.ndarray]:
    """One output per sample as (rows, last_dim) float64."""
    arrays = [np.asarray(out[name], dtype=np.float64) for out in outputs]
    return [a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1) for a in arrays]


def task_metric(metric: TaskMetric, ref_outs, cand_outs, names: list[str]) -> TaskMetricResult:
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
        note = resolution_note(len(ref), min(thresholds.values()))
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
        note = (f"{len(ref)} embeddings: too few to have neighbours to agree on" if len(ref) < 3 else
                resolution_note(len(ref), metric.min_agreement))
        worst = [names[int(owner[i])] for i in np.flatnonzero(~same)][:MAX_LISTED_SAMPLES]
    else:  # pragma: no cover - the recipe schema admits only the kinds above
        raise TypeError(f"unknown task metric {metric!r}")
    passed = all(values[k] >= v for k, v in thresholds.items())
    return TaskMetricResult(kind=metric.kind, output=name, values=values, thresholds=thresholds, passed=passed,
                            note=note, worst_samples=worst)


def _detection_metric(metric: DetectionMetric, name: str, ref_outs, cand_outs, names: list[str]) -> TaskMetricResult:
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
    note = f"{pooled.reference} reference and {pooled.candidate} candidate boxes over {len(counts)} samples"
    return TaskMetricResult(kind=metric.kind, output=name, values=values, thresholds=thresholds,
                            passed=all(values[k] >= v for k, v in thresholds.items()), note=note, worst_samples=worst)


def nearest_neighbours(rows: np.ndarray) -> np.ndarray:
    """For each row, the index of the most cosine-similar other row (the retrieval answer for that query)."""
    unit = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-30)
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    return similarity.argmax(axis=1)


def resolution_note(rows: int, min_agreement: float) -> str | None:
    """Say so when one changed prediction alone fails an agreement threshold that means to allow some."""
    if min_agreement >= 1.0 or (rows - 1) / rows >= min_agreement:
        return None
    needed = math.ceil(1 / (1 - min_agreement) - 1e-9)
    return (f"{rows} evaluation rows: one changed prediction ({1 / rows:.1%}) already fails the minimum "
            f"{min_agreement}; give at least {needed} for the gate to tolerate a single near-tie")
