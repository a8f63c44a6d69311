"""Detection agreement: IoU, decoding of dense heads, NMS, one-to-one matching and pooling."""

from __future__ import annotations

import numpy as np
import pytest

from accel_opt.accuracy.detection import (
    Detections,
    MatchCounts,
    decode_predictions,
    iou_matrix,
    match,
    nms,
    sum_counts,
)


def _dets(boxes, scores=None, classes=None) -> Detections:
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    n = len(boxes)
    scores = np.linspace(0.9, 0.5, n) if scores is None else scores
    classes = np.zeros(n, dtype=np.int64) if classes is None else classes
    return Detections(boxes, np.asarray(scores, dtype=np.float64), np.asarray(classes, dtype=np.int64))


# Three 100 px boxes far apart, classes 0, 1, 2.
REF_BOXES = [[0, 0, 100, 100], [200, 0, 300, 100], [0, 200, 100, 300]]
REF = _dets(REF_BOXES, [0.9, 0.8, 0.7], [0, 1, 2])


# --- IoU ---------------------------------------------------------------------------------------------------------


def test_iou_known_boxes():
    a = np.array([[0, 0, 10, 10]], dtype=np.float64)
    b = np.array([[0, 0, 10, 10], [20, 20, 30, 30], [5, 0, 15, 10], [10, 0, 20, 10]], dtype=np.float64)
    iou = iou_matrix(a, b)
    assert iou.shape == (1, 4)
    # half overlap: intersection 5*10 = 50, union 100 + 100 - 50 = 150; touching edges: intersection 0
    np.testing.assert_allclose(iou[0], [1.0, 0.0, 50 / 150, 0.0])


def test_iou_zero_area_is_zero_not_nan():
    point = np.array([[5, 5, 5, 5]], dtype=np.float64)
    line = np.array([[0, 5, 10, 5]], dtype=np.float64)
    box = np.array([[0, 0, 10, 10]], dtype=np.float64)
    for a, b in [(point, point), (point, box), (line, box), (line, line)]:
        iou = iou_matrix(a, b)
        assert np.isfinite(iou).all()
        assert iou[0, 0] == 0.0


def test_iou_shape_with_empty_and_symmetry():
    boxes = np.array([[0, 0, 10, 10], [3, 4, 12, 9], [8, 8, 20, 30]], dtype=np.float64)
    assert iou_matrix(boxes, np.zeros((0, 4))).shape == (3, 0)
    m = iou_matrix(boxes, boxes)
    np.testing.assert_allclose(m, m.T)
    np.testing.assert_allclose(np.diag(m), 1.0)


# --- decode ------------------------------------------------------------------------------------------------------

# Six anchors, rows = (cx, cy, w, h, class0, class1, class2).
ROWS = np.array(
    [
        [50, 50, 20, 10, 0.90, 0.05, 0.01],  # class 0, kept
        [10, 20, 4, 8, 0.10, 0.60, 0.20],  # class 1, kept
        [30, 30, 10, 10, 0.05, 0.10, 0.20],  # best 0.20 < 0.25: dropped
        [70, 40, 6, 2, 0.01, 0.02, 0.25],  # exactly at the threshold: kept
        [0, 0, 1, 1, 0.00, 0.00, 0.00],  # dropped
        [90, 90, 10, 20, 0.30, 0.31, 0.05],  # class 1 (argmax), kept
    ],
    dtype=np.float64,
)
EXPECTED_BOXES = np.array([[40, 45, 60, 55], [8, 16, 12, 24], [67, 39, 73, 41], [85, 80, 95, 100]], dtype=np.float64)
EXPECTED_SCORES = np.array([0.90, 0.60, 0.25, 0.31])
EXPECTED_CLASSES = np.array([0, 1, 2, 1])


def _assert_expected(dets: Detections) -> None:
    assert len(dets) == 4
    np.testing.assert_allclose(dets.boxes_xyxy, EXPECTED_BOXES)
    np.testing.assert_allclose(dets.scores, EXPECTED_SCORES)
    np.testing.assert_array_equal(dets.classes, EXPECTED_CLASSES)
    assert dets.boxes_xyxy.dtype == np.float64 and dets.scores.dtype == np.float64 and dets.classes.dtype == np.int64


def test_decode_yolov8_columns():
    pred = ROWS.T[None].astype(np.float32)  # [1, 4 + 3, 6]
    assert pred.shape == (1, 7, 6)
    _assert_expected(decode_predictions(pred, layout="columns"))


def test_decode_rows_layout_matches_columns():
    columns = decode_predictions(ROWS.T[None], layout="columns")
    for pred in (ROWS, ROWS[None]):
        rows = decode_predictions(pred, layout="rows")
        _assert_expected(rows)
        np.testing.assert_array_equal(rows.boxes_xyxy, columns.boxes_xyxy)


def test_decode_auto_layout():
    padded = np.concatenate([ROWS, np.zeros((20, 7))])  # 26 anchors > 7 attrs, as in YOLOv8's [1, 84, 8400]
    _assert_expected(decode_predictions(padded.T[None]))  # columns detected
    _assert_expected(decode_predictions(padded))  # rows detected


def test_decode_threshold_and_xyxy_format():
    assert len(decode_predictions(ROWS, layout="rows", score_threshold=0.95)) == 0
    assert len(decode_predictions(ROWS, layout="rows", score_threshold=0.0)) == 6
    xyxy_rows = ROWS.copy()
    xyxy_rows[[0, 1, 3, 5], :4] = EXPECTED_BOXES
    dets = decode_predictions(xyxy_rows, layout="rows", box_format="xyxy")
    np.testing.assert_allclose(dets.boxes_xyxy, EXPECTED_BOXES)


def test_decode_objectness_multiplies():
    objectness = np.array([[0.5], [1.0], [1.0], [1.0], [1.0], [0.5]])
    pred = np.concatenate([ROWS[:, :4], objectness, ROWS[:, 4:]], axis=1)  # [6, 4 + 1 + 3]
    dets = decode_predictions(pred, layout="rows", has_objectness=True)
    # 0.9 * 0.5 = 0.45 kept; 0.31 * 0.5 = 0.155 now dropped
    np.testing.assert_allclose(dets.scores, [0.45, 0.60, 0.25])
    np.testing.assert_array_equal(dets.classes, [0, 1, 2])
    np.testing.assert_allclose(dets.boxes_xyxy, EXPECTED_BOXES[:3])


def test_decode_rejects_bad_shapes():
    with pytest.raises(ValueError, match="batch"):
        decode_predictions(np.zeros((2, 7, 6)))
    with pytest.raises(ValueError):
        decode_predictions(np.zeros((6, 4)), layout="rows")  # no class score
    with pytest.raises(ValueError):
        decode_predictions(np.zeros((6, 5)), layout="rows", has_objectness=True)
    with pytest.raises(ValueError):
        decode_predictions(ROWS, box_format="xywh")


# --- NMS ---------------------------------------------------------------------------------------------------------


def test_nms_class_aware():
    dets = _dets(
        [
            [0, 0, 100, 100],  # 0: class 0, best
            [5, 5, 105, 105],  # 1: class 0, IoU ~0.82 with 0 -> suppressed
            [5, 5, 105, 105],  # 2: class 1, same overlap but another class -> kept
            [300, 300, 400, 400],  # 3: class 0, distant -> kept
        ],
        scores=[0.9, 0.8, 0.7, 0.6],
        classes=[0, 0, 1, 0],
    )
    kept = nms(dets, iou_threshold=0.45)
    np.testing.assert_allclose(kept.scores, [0.9, 0.7, 0.6])
    np.testing.assert_array_equal(kept.classes, [0, 1, 0])
    np.testing.assert_allclose(kept.boxes_xyxy[2], [300, 300, 400, 400])


def test_nms_orders_by_score_ties_stable_and_caps():
    boxes = [[i * 200, 0, i * 200 + 100, 100] for i in range(5)]  # disjoint
    dets = _dets(boxes, scores=[0.5, 0.9, 0.5, 0.7, 0.5], classes=[0, 1, 2, 3, 4])
    kept = nms(dets)
    np.testing.assert_array_equal(kept.classes, [1, 3, 0, 2, 4])  # equal scores keep index order
    assert len(nms(dets, max_detections=2)) == 2
    many = _dets(
        [[i * 200, 0, i * 200 + 100, 100] for i in range(64)], scores=np.tile([0.5, 0.6], 32), classes=range(64)
    )
    np.testing.assert_array_equal(nms(many).classes, np.r_[1:64:2, 0:64:2])  # stable beyond small-array sorts
    # a tie between overlapping same-class boxes: the lower index wins
    twins = _dets([[0, 0, 10, 10], [0, 0, 10, 10]], scores=[0.5, 0.5], classes=[0, 0])
    assert len(nms(twins)) == 1
    assert len(nms(Detections.empty())) == 0


def test_nms_threshold_is_respected():
    dets = _dets([[0, 0, 10, 10], [5, 0, 15, 10]], scores=[0.9, 0.8])  # IoU 1/3
    assert len(nms(dets, iou_threshold=0.3)) == 1
    assert len(nms(dets, iou_threshold=0.4)) == 2


# --- match -------------------------------------------------------------------------------------------------------


def test_match_identical():
    counts = match(REF, REF)
    assert counts == MatchCounts(matched=3, reference=3, candidate=3)
    assert counts.precision == counts.recall == 1.0


def test_match_small_shift_matches_large_shift_does_not():
    small = _dets(np.asarray(REF_BOXES) + [3, -2, 3, -2], REF.scores, REF.classes)
    assert match(REF, small).matched == 3
    assert iou_matrix(REF.boxes_xyxy[:1], small.boxes_xyxy[:1])[0, 0] > 0.5
    large = _dets(np.asarray(REF_BOXES) + [51, 0, 51, 0], REF.scores, REF.classes)  # IoU 49/151
    counts = match(REF, large)
    assert counts.matched == 0 and counts.precision == 0.0 and counts.recall == 0.0


def test_match_class_change_does_not_match():
    relabelled = _dets(REF_BOXES, REF.scores, [0, 2, 2])
    counts = match(REF, relabelled)
    assert counts.matched == 2


def test_match_missing_detection_lowers_recall_only():
    missing = REF.take(np.array([0, 2]))
    counts = match(REF, missing)
    assert counts.recall == pytest.approx(2 / 3)
    assert counts.precision == 1.0


def test_match_extra_detection_lowers_precision_only():
    extra = _dets(REF_BOXES + [[500, 500, 600, 600]], [0.9, 0.8, 0.7, 0.95], [0, 1, 2, 0])
    counts = match(REF, extra)
    assert counts.recall == 1.0
    assert counts.precision == pytest.approx(3 / 4)


def test_match_is_one_to_one():
    ref = _dets([[0, 0, 100, 100]], [0.9], [0])
    two = _dets([[0, 0, 100, 100], [2, 2, 102, 102]], [0.9, 0.8], [0, 0])
    counts = match(ref, two)
    assert counts == MatchCounts(matched=1, reference=1, candidate=2)
    assert counts.precision == 0.5 and counts.recall == 1.0


def test_match_prefers_highest_iou_for_highest_score():
    # Two reference boxes of one class (IoU 0.43 with each other). The top-scoring candidate overlaps both
    # (IoU 0.54 with the first, 0.82 with the second); the other candidate overlaps only the first.
    ref = _dets([[0, 0, 100, 100], [40, 0, 140, 100]], [0.9, 0.8], [0, 0])
    cand = _dets([[0, 0, 100, 100], [30, 0, 130, 100]], [0.5, 0.9], [0, 0])
    assert match(ref, cand).matched == 2  # taking the first eligible box instead of the best IoU would give 1


def test_match_empty_cases():
    empty = Detections.empty()
    both = match(empty, empty)
    assert both.precision == 1.0 and both.recall == 1.0
    no_candidate = match(REF, empty)
    assert no_candidate.precision == 1.0 and no_candidate.recall == 0.0
    no_reference = match(empty, REF)
    assert no_reference.recall == 1.0 and no_reference.precision == 0.0


def test_sum_counts_pools():
    pooled = sum_counts([MatchCounts(3, 3, 4), MatchCounts(0, 1, 0), MatchCounts(2, 2, 2)])
    assert pooled == MatchCounts(matched=5, reference=6, candidate=6)
    assert pooled.precision == pytest.approx(5 / 6) and pooled.recall == pytest.approx(5 / 6)
    assert sum_counts([]) == MatchCounts(0, 0, 0)
    assert sum_counts(iter([MatchCounts(1, 1, 1)])) == MatchCounts(1, 1, 1)


def test_end_to_end_decode_nms_match():
    # Reference head: two anchors on one object (class 0) and one on another (class 1).
    ref_rows = np.array([[50, 50, 100, 100, 0.9, 0.0], [52, 51, 100, 100, 0.8, 0.0], [300, 300, 80, 80, 0.0, 0.7]])
    cand_rows = ref_rows + [[1, 0, 0, 0, -0.05, 0.0], [0, 1, 0, 0, -0.05, 0.0], [0, 0, 2, 2, 0.0, -0.05]]
    pad = np.zeros((10, 6))
    ref = nms(decode_predictions(np.concatenate([ref_rows, pad]).T[None]))
    cand = nms(decode_predictions(np.concatenate([cand_rows, pad]).T[None]))
    assert len(ref) == len(cand) == 2
    counts = match(ref, cand)
    assert counts.precision == counts.recall == 1.0
