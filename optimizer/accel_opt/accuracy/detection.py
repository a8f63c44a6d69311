"""Object-detection agreement between a candidate model and the reference model, in pure numpy.

An accuracy gate has no ground truth, so the reference model's detections are the "truth": both models'
raw dense head outputs are decoded (`decode_predictions`), suppressed (`nms`), and the candidate's
detections are matched one-to-one to the reference's (`match`), giving precision and recall that can be
pooled over samples (`sum_counts`).

NMS and IoU are written by hand because no dependency of the project provides them on the host:
onnxruntime, onnx and polygraphy have no host-side NMS (only the ONNX NonMaxSuppression operator, which
would need a graph and a session per call), and torchvision/cv2 are not dependencies.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

BOX_FORMATS = ("cxcywh", "xyxy")
LAYOUTS = ("auto", "rows", "columns")


@dataclass(frozen=True)
class Detections:
    """Detections of one sample: boxes in pixels (x1, y1, x2, y2), scores in [0, 1], integer classes."""

    boxes_xyxy: np.ndarray  # float64 [N, 4]
    scores: np.ndarray  # float64 [N]
    classes: np.ndarray  # int64 [N]

    def __post_init__(self) -> None:
        # Coerce so callers may pass lists or other dtypes, and so an empty input has shape [0, 4].
        boxes = np.asarray(self.boxes_xyxy, dtype=np.float64).reshape(-1, 4)
        scores = np.asarray(self.scores, dtype=np.float64).reshape(-1)
        classes = np.asarray(self.classes).reshape(-1).astype(np.int64)
        if not len(boxes) == len(scores) == len(classes):
            raise ValueError(
                f"Detections need as many boxes as scores and classes, got {len(boxes)}, {len(scores)}, {len(classes)}"
            )
        object.__setattr__(self, "boxes_xyxy", boxes)
        object.__setattr__(self, "scores", scores)
        object.__setattr__(self, "classes", classes)

    def __len__(self) -> int:
        return len(self.scores)

    @classmethod
    def empty(cls) -> Detections:
        return cls(np.zeros((0, 4)), np.zeros(0), np.zeros(0, dtype=np.int64))

    def take(self, indices: np.ndarray) -> Detections:
        """The detections at `indices`, in that order."""
        return Detections(self.boxes_xyxy[indices], self.scores[indices], self.classes[indices])


def output_misfit(shape: list, decoded: bool, layout: str = "auto", has_objectness: bool = False) -> str | None:
    """Why a model output of this `shape` (batch dim first; names for dynamic dims) cannot be a detection head read
    as the metric says, or None when it can (or its dynamic dims leave it open). Checked when the recipe is resolved,
    so a detector recipe on a classifier is a usage error, not a failure inside the gate."""
    dims = list(shape)[1:] if len(shape) == 3 else list(shape)
    if len(dims) != 2:
        return f"has shape {list(shape)}: a detection head is [batch, rows, attrs] or [batch, attrs, rows]"
    if len(shape) == 2:  # [batch, x]: one sample is [1, x]
        dims[0] = 1
    known = [d if isinstance(d, int) and d > 0 else None for d in dims]
    if decoded:
        if known[1] is not None and known[1] != 6:
            return f"has shape {list(shape)}: decoded detections are rows of 6 (x1, y1, x2, y2, score, class)"
        return None
    if layout == "rows" or (layout == "auto" and None not in known and known[0] >= known[1]):
        attrs = known[1]
    elif layout == "columns" or None not in known:
        attrs = known[0]
    else:
        return None
    box_attrs = 5 if has_objectness else 4
    if attrs is not None and attrs <= box_attrs:
        return (f"has shape {list(shape)}: {attrs} attribute(s) per box, and a detection head needs {box_attrs} box"
                f"{'/objectness' if has_objectness else ''} values and at least one class score")
    return None


def decode_predictions(
    pred: np.ndarray,
    *,
    box_format: str = "cxcywh",
    layout: str = "auto",
    has_objectness: bool = False,
    score_threshold: float = 0.25,
) -> Detections:
    """One sample's raw dense head output -> detections before NMS.

    pred: [rows, attrs] or [attrs, rows], a leading batch dim of 1 allowed (squeezed; a leading dim > 1 is a
    ValueError).
    attrs = 4 box values (+1 objectness if has_objectness) + C class scores.
    layout: "rows" = [rows, attrs]; "columns" = [attrs, rows] (YOLOv8's [1, 84, 8400]);
    "auto" = columns when shape[-2] < shape[-1].
    box_format: "cxcywh" | "xyxy". score = max class score (times objectness when has_objectness); class = argmax.
    Keep rows with score >= score_threshold.
    """
    if box_format not in BOX_FORMATS:
        raise ValueError(f"box_format must be one of {BOX_FORMATS}, got {box_format!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    arr = np.asarray(pred, dtype=np.float64)
    if arr.ndim == 3:
        if arr.shape[0] != 1:
            raise ValueError(f"decode_predictions takes one sample; got a leading batch dim of {arr.shape[0]}")
        arr = arr[0]
    if arr.ndim != 2:
        raise ValueError(f"prediction must be [rows, attrs] or [attrs, rows] (batch dim 1 allowed), got {arr.shape}")
    if layout == "columns" or (layout == "auto" and arr.shape[-2] < arr.shape[-1]):
        arr = arr.T
    box_attrs = 5 if has_objectness else 4
    if arr.shape[1] <= box_attrs:
        raise ValueError(
            f"each row needs {box_attrs} box{'/objectness' if has_objectness else ''} values and at least one class"
            f" score, got {arr.shape[1]} attributes (layout={layout!r}, shape {tuple(np.shape(pred))})"
        )

    class_scores = arr[:, box_attrs:]
    classes = np.argmax(class_scores, axis=1)
    scores = class_scores[np.arange(len(arr)), classes]
    if has_objectness:
        scores = scores * arr[:, 4]
    keep = scores >= score_threshold  # NaN scores compare False and are dropped
    box = arr[keep, :4]
    if box_format == "cxcywh":
        half_w, half_h = box[:, 2] / 2, box[:, 3] / 2
        box = np.stack([box[:, 0] - half_w, box[:, 1] - half_h, box[:, 0] + half_w, box[:, 1] + half_h], axis=1)
    return Detections(box, scores[keep], classes[keep])


def _areas(boxes_xyxy: np.ndarray) -> np.ndarray:
    widths = np.clip(boxes_xyxy[:, 2] - boxes_xyxy[:, 0], 0.0, None)
    heights = np.clip(boxes_xyxy[:, 3] - boxes_xyxy[:, 1], 0.0, None)
    return widths * heights


def iou_matrix(a_xyxy: np.ndarray, b_xyxy: np.ndarray) -> np.ndarray:
    """Pairwise intersection over union, [len(a), len(b)].

    Zero-area (or inverted) boxes give IoU 0, never NaN, and so do non-finite boxes: they match nothing.
    """
    a = np.asarray(a_xyxy, dtype=np.float64).reshape(-1, 4)
    b = np.asarray(b_xyxy, dtype=np.float64).reshape(-1, 4)
    x1 = np.maximum(a[:, None, 0], b[None, :, 0])
    y1 = np.maximum(a[:, None, 1], b[None, :, 1])
    x2 = np.minimum(a[:, None, 2], b[None, :, 2])
    y2 = np.minimum(a[:, None, 3], b[None, :, 3])
    with np.errstate(invalid="ignore", divide="ignore"):
        intersection = np.clip(x2 - x1, 0.0, None) * np.clip(y2 - y1, 0.0, None)
        union = _areas(a)[:, None] + _areas(b)[None, :] - intersection
        iou = np.divide(intersection, union, out=np.zeros_like(intersection), where=union > 0)
    iou[~np.isfinite(iou)] = 0.0
    return iou


def nms(dets: Detections, iou_threshold: float = 0.45, max_detections: int = 300) -> Detections:
    """Class-aware greedy non-maximum suppression, highest score first; ties broken by index (stable).

    A box is suppressed by a kept box of the same class whose IoU with it exceeds iou_threshold. The result
    is in descending score order and holds at most max_detections detections; NaN-score detections are dropped.
    """
    order = np.argsort(-dets.scores, kind="stable")
    order = order[~np.isnan(dets.scores[order])]  # a NaN score has no rank
    boxes, classes = dets.boxes_xyxy[order], dets.classes[order]
    suppressed = np.zeros(len(order), dtype=bool)
    kept: list[int] = []
    for i in range(len(order)):
        if len(kept) >= max_detections:
            break
        if suppressed[i]:
            continue
        kept.append(i)
        rest = np.arange(i + 1, len(order))
        rest = rest[~suppressed[rest] & (classes[rest] == classes[i])]
        if len(rest):
            overlaps = iou_matrix(boxes[i : i + 1], boxes[rest])[0]
            suppressed[rest[overlaps > iou_threshold]] = True
    return dets.take(order[np.asarray(kept, dtype=np.int64)])


@dataclass(frozen=True)
class MatchCounts:
    """Counts from matching a candidate's detections to the reference's, poolable over samples."""

    matched: int  # candidate detections matched one-to-one to a reference detection (same class, IoU >= threshold)
    reference: int  # reference detections
    candidate: int  # candidate detections

    @property
    def precision(self) -> float:
        """matched / candidate; 1.0 with no candidate detections (nothing wrong was claimed)."""
        return self.matched / self.candidate if self.candidate else 1.0

    @property
    def recall(self) -> float:
        """matched / reference; 1.0 with no reference detections (nothing was there to miss)."""
        return self.matched / self.reference if self.reference else 1.0


def match(reference: Detections, candidate: Detections, iou_threshold: float = 0.5) -> MatchCounts:
    """Greedy one-to-one matching, candidate detections in descending score order, each to the unmatched
    reference detection of the same class with the highest IoU >= iou_threshold (COCO-style)."""
    counts = MatchCounts(matched=0, reference=len(reference), candidate=len(candidate))
    if not len(reference) or not len(candidate):
        return counts
    iou = iou_matrix(candidate.boxes_xyxy, reference.boxes_xyxy)
    same_class = candidate.classes[:, None] == reference.classes[None, :]
    eligible = same_class & (iou >= iou_threshold)
    taken = np.zeros(len(reference), dtype=bool)
    matched = 0
    # NaN scores sort last under argsort of the negated scores; they still may match what is left.
    for c in np.argsort(-candidate.scores, kind="stable"):
        options = eligible[c] & ~taken
        if not options.any():
            continue
        r = int(np.argmax(np.where(options, iou[c], -1.0)))
        taken[r] = True
        matched += 1
    return MatchCounts(matched=matched, reference=counts.reference, candidate=counts.candidate)


def sum_counts(counts: Iterable[MatchCounts]) -> MatchCounts:
    """Field-wise sum, so a gate can pool precision and recall over samples instead of averaging ratios."""
    matched = reference = candidate = 0
    for c in counts:
        matched += c.matched
        reference += c.reference
        candidate += c.candidate
    return MatchCounts(matched=matched, reference=reference, candidate=candidate)
