"""Task metrics, computed here because Polygraphy has none: top-k agreement, embedding cosine, nearest-neighbour
agreement of embeddings, detection precision/recall against the reference's boxes."""

from __future__ import annotations

import logging

import numpy as np

from accel_opt.accuracy.evidence import DEFAULT_CONFIDENCE, RateEvidence, Trials, aimed_minimum, trials_needed
from accel_opt.accuracy.models import MAX_LISTED_SAMPLES, TaskMetricResult
from accel_opt.recipe.gate import CosineMetric, DetectionMetric, NeighbourMetric, TaskMetric, Tolerance, TopKMetric

log = logging.getLogger(__name__)



def _rows(outputs: list[dict[str, np.ndarray]], name: str) -> list[np.ndarray]:
    """One output per sample as (rows, last_dim) float64."""
    arrays = [np.asarray(out[name], dtype=np.float64) for out in outputs]
    return [a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1) for a in arrays]


def task_metric(metric: TaskMetric, ref_outs, cand_outs, names: list[str], confidence: float = DEFAULT_CONFIDENCE,
                bounded: bool = False, trials: Trials | None = None) -> TaskMetricResult:
    """`metric` on the per-sample outputs. Its rates (top-k agreement, neighbours kept, boxes matched) carry their
    counts (`evidence`), one trial per sample however many rows it holds (evidence.RateEvidence.of_samples): judged by
    their lower bound at `confidence` where `bounded`, else by the observed rate; a rate's value is the mean of the
    samples' own rates. `trials`: where samples are grouped, each group is one trial."""
    trials = trials or Trials.of(names)
    name = metric.output or next(iter(ref_outs[0].keys()))
    note, worst, changed = None, [], None
    evidence: dict[str, RateEvidence] = {}

    def rate(key: str, what: str, agreed: np.ndarray, owner: np.ndarray, minimum: float, failure: str,
             row_unit: str = "rows") -> float:
        """`agreed`: per row, whether it agrees; `owner`: the sample each row belongs to. Returns the rate's value."""
        per_trial = trials.shares(agreed, owner)
        evidence[key] = RateEvidence.of_samples(what, per_trial, rows=len(agreed), rows_failed=int((~agreed).sum()),
                                                row_unit=row_unit, failure=failure, minimum=minimum,
                                                confidence=confidence, bounded=bounded, unit=trials.unit)
        return float(np.mean(per_trial)) if per_trial else 1.0

    if isinstance(metric, DetectionMetric):
        return _detection_metric(metric, name, ref_outs, cand_outs, names, evidence, confidence, bounded, trials)
    ref_rows, cand_rows = _rows(ref_outs, name), _rows(cand_outs, name)
    ref, cand = np.concatenate(ref_rows), np.concatenate(cand_rows)
    owner = np.repeat(np.arange(len(names)), [len(r) for r in ref_rows])
    if isinstance(metric, TopKMetric):
        ref_top1 = ref.argmax(axis=1)
        # Ties (an int8 output's logits are a few hundred levels) go to the lower class index, as argmax and the
        # labels' top-k do: one rule, so a tie cannot read as agreement here and as a lost label there.
        ranked = np.argsort(-cand, axis=1, kind="stable")
        values, thresholds = {}, {}
        for k, minimum in metric.min_agreement.items():
            agreed = np.array([r in row[:k] for r, row in zip(ref_top1, ranked)], dtype=bool)
            values[f"top{k}"] = rate(f"top{k}", f"top-{k} agreement", agreed, owner, minimum, "changed")
            thresholds[f"top{k}"] = minimum
        # a top-k miss is a top-1 change too
        changed = [names[i] for i in sorted({int(i) for i in owner[ranked[:, 0] != ref_top1]})]
        worst = changed[:MAX_LISTED_SAMPLES]
    elif isinstance(metric, CosineMetric):
        dots = (ref * cand).sum(axis=1)
        norms = np.linalg.norm(ref, axis=1) * np.linalg.norm(cand, axis=1)
        cos = np.where(norms > 0, dots / np.maximum(norms, 1e-30), 1.0)
        values = {"mean_cosine": float(cos.mean()), "worst_cosine": float(cos.min())}
        thresholds = {"mean_cosine": metric.min_mean_cosine, "worst_cosine": metric.min_worst_cosine}
        worst = [names[int(owner[i])] for i in np.argsort(cos)[:3] if cos[i] < metric.min_worst_cosine]
    elif isinstance(metric, NeighbourMetric):
        thresholds = {"neighbour_agreement": metric.min_agreement}
        if len(ref) < 3:  # neighbours agree by construction: no evidence at all (insufficient where bounded)
            note = f"{len(ref)} embeddings: too few to have neighbours to agree on"
            values = {"neighbour_agreement": 1.0}
            evidence["neighbour_agreement"] = RateEvidence(
                what="nearest-neighbour agreement", successes=0, trials=0, failure="changed",
                minimum=metric.min_agreement, confidence=confidence, bounded=bounded)
            same = np.ones(len(ref), dtype=bool)
        else:
            same = nearest_neighbours(ref) == nearest_neighbours(cand)
            values = {"neighbour_agreement": rate("neighbour_agreement", "nearest-neighbour agreement", same, owner,
                                                  metric.min_agreement, "changed", "embeddings")}
        changed = list(dict.fromkeys(names[int(owner[i])] for i in np.flatnonzero(~same)))
        worst = changed[:MAX_LISTED_SAMPLES]
    else:  # pragma: no cover - the recipe schema admits only the kinds above
        raise TypeError(f"unknown task metric {metric!r}")
    return _result(metric.kind, name, values, thresholds, evidence, note, worst, changed)


def _result(kind: str, output: str, values: dict[str, float], thresholds: dict[str, float],
            evidence: dict[str, RateEvidence], note: str | None, worst: list[str],
            changed: list[str] | None = None) -> TaskMetricResult:
    passed = all(evidence[k].status == "pass" if k in evidence else values[k] >= v for k, v in thresholds.items())
    return TaskMetricResult(kind=kind, output=output, values=values, thresholds=thresholds, evidence=evidence,
                            passed=passed, note=note, worst_samples=worst, changed=changed)


def _detection_metric(metric: DetectionMetric, name: str, ref_outs, cand_outs, names: list[str],
                      evidence: dict[str, RateEvidence], confidence: float, bounded: bool,
                      trials: Trials) -> TaskMetricResult:
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
    thresholds = {"precision": metric.min_precision, "recall": metric.min_recall}
    order = sorted(range(len(counts)), key=lambda i: min(counts[i].precision, counts[i].recall))
    worst = [f"{names[i]} (P {counts[i].precision:.2f}, R {counts[i].recall:.2f})" for i in order[:5]
             if min(counts[i].precision, counts[i].recall) < 1.0]
    # Each image is one trial, its own precision and recall (1 where it has no box to get wrong) its rate: the boxes
    # of one image share its input and are not independent.
    for key, what, minimum, boxes, failure in (("precision", "detection precision", metric.min_precision, "candidate",
                                                "unmatched"), ("recall", "detection recall", metric.min_recall,
                                                               "reference", "missed")):
        per_sample = np.array([c.precision if key == "precision" else c.recall for c in counts])
        total = getattr(pooled, boxes)
        evidence[key] = RateEvidence.of_samples(what, trials.shares(per_sample, np.arange(len(counts))), rows=total,
                                                rows_failed=total - pooled.matched, row_unit=f"{boxes} boxes",
                                                failure=failure, minimum=minimum, confidence=confidence,
                                                bounded=bounded, unit=trials.unit)
    values = {key: float(np.mean([getattr(c, key) for c in counts])) if counts else 1.0 for key in thresholds}
    note = (f"{pooled.reference} reference and {pooled.candidate} candidate boxes over {len(counts)} samples "
            f"(pooled: precision {pooled.precision:.3f}, recall {pooled.recall:.3f})")
    return _result(metric.kind, name, values, thresholds, evidence, note, worst)


def nearest_neighbours(rows: np.ndarray) -> np.ndarray:
    """For each row, the index of the most cosine-similar other row (the retrieval answer for that query)."""
    unit = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-30)
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    return similarity.argmax(axis=1)


def samples_to_certify(tolerance: Tolerance, metrics: list[TaskMetric], confidence: float) -> int:
    """The fewest held-out samples whose verdict, with none failing, certifies every rate of the gate."""
    minimums = [v for m in metrics if isinstance(m, TopKMetric) for v in m.min_agreement.values()]
    minimums += [m.min_agreement for m in metrics if isinstance(m, NeighbourMetric)]
    minimums += [v for m in metrics if isinstance(m, DetectionMetric) for v in (m.min_precision, m.min_recall)]
    minimums.append(1 - tolerance.max_failing_fraction if tolerance.max_failing_fraction > 0
                    else tolerance.strict_min_bound)
    return max(trials_needed(v, confidence) or 0 for v in minimums)


def aimed_gate(tolerance: Tolerance, metrics: list[TaskMetric], verdict_samples: int,
               confidence: float) -> tuple[Tolerance, list[TaskMetric], list[str]]:
    """The gate as a choice made on other samples (a search's probes, auto's shortlist) must see it for the held-out
    verdict on `verdict_samples` to certify the result: each rate's minimum (task metrics, the share of samples
    within tolerance) raised to the observed rate that still clears the recipe's minimum by its bound
    (evidence.aimed_minimum). Returns (tolerance, metrics, one line per rate that no result on that many held-out
    samples can certify). Every rate counts samples, however many rows (boxes, tokens) each holds."""
    aimed, hopeless = [], []

    def aim(value: float, what: str) -> float:
        target = aimed_minimum(value, verdict_samples, confidence)
        if target is None:
            hopeless.append(f"{what} >= {value:.1%} needs {trials_needed(value, confidence)} held-out samples at "
                            f"{confidence:.0%} confidence, {verdict_samples} given")
        return value if target is None else max(target, value)

    for metric in metrics:
        if isinstance(metric, TopKMetric):
            metric = metric.model_copy(update={"min_agreement": {k: aim(v, f"top-{k} agreement")
                                                                 for k, v in metric.min_agreement.items()}})
        elif isinstance(metric, NeighbourMetric):
            metric = metric.model_copy(update={"min_agreement": aim(metric.min_agreement,
                                                                    "nearest-neighbour agreement")})
        elif isinstance(metric, DetectionMetric):
            metric = metric.model_copy(update={"min_precision": aim(metric.min_precision, "detection precision"),
                                               "min_recall": aim(metric.min_recall, "detection recall")})
        aimed.append(metric)
    if tolerance.max_failing_fraction > 0:
        within = aim(1 - tolerance.max_failing_fraction, "samples within tolerance")
        tolerance = tolerance.model_copy(update={"max_failing_fraction": 1 - within})
    elif aimed_minimum(tolerance.strict_min_bound, verdict_samples, confidence) is None:
        hopeless.append(f"samples within tolerance: none failing shows >= {tolerance.strict_min_bound:.1%} only on "
                        f"{trials_needed(tolerance.strict_min_bound, confidence)} held-out samples at "
                        f"{confidence:.0%} confidence, {verdict_samples} given")
    return tolerance, aimed, hopeless
