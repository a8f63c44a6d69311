"""Labeled accuracy: the paired bound on the drop from fp32 holds its confidence, and refuses a real drop; labels are
read from an ImageFolder layout or a file,label CSV, and bad labels are one-line input errors."""

from __future__ import annotations

import numpy as np
import pytest

from accel_opt.accuracy.labeled import drop_upper_bound, labeled_accuracy, samples_to_certify_drop
from accel_opt.data.labels import class_folders, csv_labels, folder_labels, read_classes
from accel_opt.errors import InputRejected

# (chance a sample goes right -> wrong, wrong -> right): no flips, symmetric flips, a real drop, a real gain, rare
# flips.
TRUE_RATES = [(0.0, 0.0), (0.03, 0.03), (0.05, 0.01), (0.01, 0.04), (0.002, 0.0)]


@pytest.mark.parametrize("samples", [40, 300])
@pytest.mark.parametrize("p_lost,p_gained", TRUE_RATES)
def test_the_bound_covers_the_true_drop_at_least_at_its_confidence(p_lost, p_gained, samples):
    rng = np.random.default_rng(7)
    draws, confidence = 2000, 0.95
    outcomes = rng.multinomial(samples, [p_lost, p_gained, 1 - p_lost - p_gained], size=draws)
    covered = sum(drop_upper_bound(int(lost), int(gained), samples, confidence) >= p_lost - p_gained
                  for lost, gained, _ in outcomes)
    assert covered / draws >= confidence, covered / draws


def _outputs(correct: np.ndarray, labels: list[int], classes: int = 10) -> list[dict[str, np.ndarray]]:
    """Scores whose top-1 is the label where `correct`, another class elsewhere."""
    rows = []
    for ok, label in zip(correct, labels):
        scores = np.zeros((1, classes), np.float32)
        scores[0, label if ok else (label + 1) % classes] = 1.0
        rows.append({"logits": scores})
    return rows


def _paired(samples: int, p_lost: float, p_gained: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    labels = list(rng.integers(0, 10, samples))
    ref_ok = rng.random(samples) < 0.8
    u = rng.random(samples)
    cand_ok = np.where(ref_ok, u >= p_lost / 0.8, u < p_gained / 0.2)
    return _outputs(ref_ok, labels), _outputs(cand_ok, labels), labels


def test_the_gate_refuses_a_real_drop_and_passes_none_when_the_sample_is_large():
    ref, cand, labels = _paired(5000, p_lost=0.03, p_gained=0.0)
    dropped = labeled_accuracy(ref, cand, labels, "logits", max_drop=0.01)
    assert dropped.status == "fail" and dropped.drop > 0.02 and "beyond the limit 1.00% (absolute)" in dropped.line()
    same = labeled_accuracy(*_paired(5000, p_lost=0.02, p_gained=0.02), "logits", max_drop=0.01)
    assert same.status == "pass" and same.lost > 50 and same.gained > 50  # flips both ways, no drop
    relative = labeled_accuracy(ref, cand, labels, "logits", min_relative=0.99)
    assert relative.status == "fail" and relative.limit == pytest.approx(0.01 * relative.reference_accuracy)


def test_too_few_samples_to_certify_the_limit_is_insufficient_with_the_number_needed():
    ref, cand, labels = _paired(100, p_lost=0.0, p_gained=0.0)
    few = labeled_accuracy(ref, cand, labels, "logits", max_drop=0.01)
    assert few.status == "insufficient" and few.samples_needed == samples_to_certify_drop(0.01) == 437
    assert "437 held-out samples needed" in few.line()
    observed = labeled_accuracy(ref, cand, labels, "logits", max_drop=0.01, bounded=False)  # fp32 builds, steering
    assert observed.status == "pass" and "observed drop within the limit" in observed.line()
    assert labeled_accuracy(ref, cand, labels, "logits").limit is None  # no limit: reported, not gated
    top5 = labeled_accuracy(ref, cand, labels, "logits", k=5)
    assert top5.reference_correct >= labeled_accuracy(ref, cand, labels, "logits").reference_correct


def test_labels_from_an_image_folder_layout(tmp_path):
    for name in ("cat", "ant", "bee"):
        (tmp_path / name).mkdir()
    assert class_folders(tmp_path) == ["ant", "bee", "cat"]  # sorted, as torchvision numbers them
    assert folder_labels(["ant/1.png", "cat/2.png", "bee/3.png"], ["ant", "bee", "cat"]) == [0, 2, 1]
    with pytest.raises(InputRejected, match="class folder 'cat' holds no sample"):
        folder_labels(["ant/1.png", "bee/3.png"], ["ant", "bee", "cat"])


@pytest.mark.parametrize("rows,classes,expected", [
    ("file,label\na.npz,0\nb.npz,bee\n", ["ant", "bee"], None),
    ("file,label\na.npz,0\nb.npz,7\n", ["ant", "bee"], "label 7 is out of range (0..1)"),
    ("file,label\na.npz,0\nb.npz,wasp\n", ["ant", "bee"], "label 'wasp' is not a class index or a name in --classes"),
    ("file,label\na.npz,0\nb.npz,1\nc.npz,1\n", None, "'c.npz' is not a sample of --data"),
    ("file,label\na.npz,0\n", None, "'b.npz' has no label"),
    ("file,label\na.npz,0\nb.npz,0\n", ["ant", "bee"], "class 'bee' has no sample"),
    ("file,label\na.npz,0\na.npz,1\n", None, "'a.npz' is labeled twice"),
    ("name,class\na.npz,0\n", None, "needs the columns file,label"),
])
def test_labels_from_a_csv(rows, classes, expected, tmp_path):
    path = tmp_path / "labels.csv"
    path.write_text(rows)
    if expected is None:
        assert csv_labels(path, ["a.npz", "b.npz"], classes) == [0, 1]
        return
    with pytest.raises(InputRejected, match=expected.replace("(", r"\(").replace(")", r"\)")):
        csv_labels(path, ["a.npz", "b.npz"], classes)


def test_a_class_list(tmp_path):
    (tmp_path / "classes.txt").write_text("ant\nbee\n\n")
    assert read_classes(tmp_path / "classes.txt") == ["ant", "bee"]
    (tmp_path / "twice.txt").write_text("ant\nant\n")
    with pytest.raises(InputRejected, match="listed twice"):
        read_classes(tmp_path / "twice.txt")


def test_a_tie_in_the_candidates_scores_reads_the_same_in_agreement_and_on_the_labels():
    """int8 logits take a few hundred levels, so ties happen: both take the lower class index (argmax's rule), and a
    label lost to a tie is a changed prediction, never agreement with fp32 and a lost label at once."""
    from accel_opt.accuracy.metrics import task_metric
    from accel_opt.recipe.gate import TopKMetric

    logits = np.round(np.random.default_rng(0).normal(size=(1, 1000)), 1)  # ImageNet's 1000 classes, 0.1 steps
    logits[0, 500] = 5.0
    ref = [{"logits": logits.copy()} for _ in range(64)]
    cand = [{"logits": logits.copy()} for _ in range(64)]
    cand[5]["logits"][0, 5] = 5.0  # ties with fp32's (and the label's) class 500: numpy's default sort ranks 500 first
    names = [f"s{i}" for i in range(64)]
    agreement = task_metric(TopKMetric(kind="topk", min_agreement={1: 0.5}), ref, cand, names)
    labeled = labeled_accuracy(ref, cand, [500] * 64, "logits")
    assert agreement.evidence["top1"].failures == labeled.lost + labeled.gained == 1
    assert agreement.worst_samples == ["s5"]
