"""A build judged on real labels: scikit-learn's digits (1797 labeled 8x8 images shipped in the package) as an
ImageFolder of .npz samples and as a CSV, a softmax classifier trained on half of them at a fixed seed, built at fp32
and int8 with the labels: fp32 and candidate accuracy reported on the held-out samples and the drop gated by its paired
bound."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from accel_opt.cli import main

from ..conftest import FAST_BENCH, make_model, save


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(model, ImageFolder of the held-out half, CSV labels of the same files in one flat folder)."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = (images / 16.0).astype(np.float32)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))
    train, test = order[: len(x) // 2], order[len(x) // 2:]
    weights, bias = np.zeros((64, 10)), np.zeros(10)  # softmax regression, full-batch gradient descent
    onehot = np.eye(10)[labels[train]]
    for _ in range(300):
        logits = x[train] @ weights + bias
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        weights -= 0.5 * x[train].T @ (p - onehot) / len(train)
        bias -= 0.5 * (p - onehot).mean(0)
    root = tmp_path_factory.mktemp("digits")
    model = save(make_model([helper.make_node("MatMul", ["x", "W"], ["h"]),
                             helper.make_node("Add", ["h", "b"], ["logits"])],
                            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
                            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
                            [numpy_helper.from_array(weights.astype(np.float32), "W"),
                             numpy_helper.from_array(bias.astype(np.float32), "b")]), root / "digits.onnx")
    folders, flat = root / "folders", root / "flat"
    flat.mkdir()
    rows = ["file,label"]
    for i in test:
        (folders / f"{labels[i]}").mkdir(parents=True, exist_ok=True)
        np.savez(folders / f"{labels[i]}" / f"d{i:04d}.npz", x=x[i:i + 1])
        np.savez(flat / f"d{i:04d}.npz", x=x[i:i + 1])
        rows.append(f"d{i:04d}.npz,{labels[i]}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    recipe = root / "fast.yaml"
    # Every held-out sample judged (the default caps the verdict at 300): the bound needs hundreds.
    recipe.write_text(json.dumps({"name": "fast", "benchmark": FAST_BENCH, "accuracy": {"max_samples": 2000}}))
    return model, folders, root


def _build(model, data, *args):
    return CliRunner().invoke(main, ["build", str(model), "--data", str(data), *map(str, args), "--json"])


def test_an_image_folder_of_digits_reports_and_gates_accuracy_on_its_labels(digits, tmp_path):
    model, folders, root = digits
    done = _build(model, folders, "--labels", "folders", "--precision", "int8", "--max-accuracy-drop", "0.02",
                  "--recipe", root / "fast.yaml", "--out", tmp_path)
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout)
    accuracy = json.loads((Path(result["artifact_dir"]) / "accuracy.json").read_text())
    labeled = {c["name"]: c for c in accuracy["checks"] if c["name"].startswith("labels:")}
    top1 = labeled["labels: top-1 accuracy"]["labeled"]
    assert top1["samples"] >= 437 and top1["limit"] == 0.02 and top1["status"] == "pass"
    assert top1["reference_correct"] / top1["samples"] > 0.85  # the classifier works: its labels are read right
    assert labeled["labels: top-5 accuracy"]["labeled"]["limit"] is None  # top-5 reported, not gated
    assert [r["k"] for r in result["labeled"]] == [1, 5] and result["labeled"][0]["drop"] == pytest.approx(
        top1["reference_accuracy"] - top1["candidate_accuracy"])  # --json carries the figures
    signoff = (Path(result["artifact_dir"]) / "signoff.md").read_text()
    assert "## Accuracy on the labels" in signoff and "top-1 accuracy on the labels: fp32" in signoff


def test_a_csv_of_labels_gives_the_same_counts_and_a_tight_limit_needs_more_samples(digits, tmp_path):
    model, folders, root = digits
    by_folder = _build(model, folders, "--labels", "folders", "--recipe", root / "fast.yaml", "--out", tmp_path / "a")
    by_csv = _build(model, root / "flat", "--labels", root / "labels.csv", "--recipe", root / "fast.yaml",
                    "--out", tmp_path / "b")
    assert by_folder.exit_code == by_csv.exit_code == 0, (by_folder.output, by_csv.output)

    def top1(done):
        folder = Path(json.loads(done.stdout)["artifact_dir"])
        checks = json.loads((folder / "accuracy.json").read_text())["checks"]
        return next(c["labeled"] for c in checks if c["name"] == "labels: top-1 accuracy")

    # The same labels either way (the split deals the two orders differently: the held-out sets differ slightly).
    for result in (top1(by_folder), top1(by_csv)):
        assert result["samples"] > 800 and result["reference_correct"] / result["samples"] > 0.9, result
    tight = _build(model, folders, "--labels", "folders", "--precision", "int8", "--max-accuracy-drop", "0.001",
                   "--recipe", root / "fast.yaml", "--out", tmp_path / "c")
    assert tight.exit_code == 6, tight.output  # 0.1 point needs 4,425 held-out samples
    assert json.loads(tight.stdout)["samples_needed"] >= 4000


def test_bad_label_options_are_usage_errors(digits, tmp_path):
    model, folders, root = digits
    for args, message in ((["--max-accuracy-drop", "0.01"], "need --labels"),
                          (["--labels", "nope.csv"], "not 'folders' and not a CSV file"),
                          (["--labels", "folders", "--max-accuracy-drop", "0.01", "--min-relative-accuracy", "0.99"],
                           "give one")):
        done = _build(model, folders, *args, "--out", tmp_path)
        assert done.exit_code == 2 and message in done.stderr, done.output


def _recipe(root: Path, name: str, **labels) -> Path:
    """The fast recipe with an agreement tolerance no int8 build meets (errors of 1e-7 of the logits' spread), and
    `labels` as accuracy.labels."""
    path = root / f"{name}.yaml"
    path.write_text(json.dumps({"name": name, "benchmark": FAST_BENCH, "accuracy": {
        "max_samples": 2000, "tolerances": {"int8": {"max_error": 1e-7, "max_sample_error": 1e-7}}, "labels": labels}}))
    return path


def test_a_recipe_can_gate_on_the_labels_alone_and_its_folder_re_checks_on_them(digits, tmp_path):
    model, folders, root = digits
    both = _build(model, folders, "--labels", "folders", "--precision", "int8", "--recipe",
                  _recipe(tmp_path, "both", max_drop=0.02), "--out", tmp_path / "both")
    assert both.exit_code == 1, both.output  # agreement with fp32 gates too: int8 is not within 1e-7
    labels_only = _build(model, folders, "--labels", "folders", "--precision", "int8", "--recipe",
                         _recipe(tmp_path, "labels", max_drop=0.02, gate="labels"), "--out", tmp_path / "labels")
    assert labels_only.exit_code == 0, labels_only.output
    folder = Path(json.loads(labels_only.stdout)["artifact_dir"])
    checks = json.loads((folder / "accuracy.json").read_text())["checks"]
    ungated = [c for c in checks if not c["gated"]]
    assert ungated and all(c["labeled"] is None for c in ungated) and any(not c["passed"] for c in ungated)
    assert all(c["passed"] for c in checks if c["gated"]) and any(c["labeled"] for c in checks if c["gated"])
    assert "reported, not gated" in (folder / "signoff.md").read_text()
    assert "(not gated)" in (folder / "signoff.html").read_text()
    probe = json.loads((folder / "probe.json").read_text())
    assert probe["labels"] and probe["labels_config"]["gate"] == "labels"

    # On another CPU class the folder is re-checked on its probe samples: on their labels, not on agreement.
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["cpu_class"] = "avx2" if manifest["cpu_class"] != "avx2" else "amx"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    recheck = CliRunner(env={"XDG_CACHE_HOME": str(tmp_path / "cache")}).invoke(
        main, ["verify", str(folder), "--accuracy"])
    assert recheck.exit_code == 0 and "FAILED" not in recheck.output, recheck.output
    assert "re-checked" in recheck.output and "top-1 accuracy on the labels" in recheck.output, recheck.output


@pytest.mark.parametrize(("labels", "args", "message"), [
    ({"gate": "labels"}, ["--labels", "folders"], "needs a limit on the drop"),
    ({"gate": "labels", "max_drop": 0.02}, [], "give --labels")])
def test_gating_on_labels_alone_needs_labels_and_a_limit(digits, tmp_path, labels, args, message):
    model, folders, _ = digits
    done = _build(model, folders, *args, "--recipe", _recipe(tmp_path, "r", **labels), "--out", tmp_path / "out")
    assert done.exit_code == 2 and message in done.stderr, done.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("manifest.json"))


def test_auto_judges_a_labels_only_candidate_by_its_own_verdict(digits, tmp_path):
    """Issue 73: under `gate: labels`, `--precision int8` signs off while auto dropped the same candidate on an
    agreement check the recipe does not gate. Auto's record of the candidate now holds its gated checks only, so reading
    its held-out verdict again (at auto's family-wise level) passes, and given the runoff's points it wins. The points
    are injected: which build is faster on this host decides nothing here."""
    from accel_opt.builder.auto import _fill
    from accel_opt.builder.choice import choose
    from accel_opt.builder.pipeline import build
    from accel_opt.recipe.load import load_recipe
    from accel_opt.report.selection import Candidate, RunoffPoint

    model, folders, _ = digits
    recipe = load_recipe(_recipe(tmp_path, "labels", max_drop=0.02, gate="labels", source="folders"))
    result = build(model, recipe.with_overrides(precision="int8"), data_dir=folders, out_dir=tmp_path / "out")
    assert result.signed_off, result.failures
    int8 = Candidate(backend="onnxruntime", precision="int8", why_tried="test")
    _fill(int8, result, target=8)
    assert int8.checks_passed and int8.labeled and int8.rates == []  # agreement: reported, not gated, not read
    assert int8.held_out_at(0.975) == "pass"  # two reduced candidates planned: read at 97.5%
    fp32 = Candidate(backend="onnxruntime", precision="fp32", why_tried="test", signed_off=True)
    other = Candidate(backend="openvino", precision="int8", why_tried="test")  # planned, not built
    for candidate, p50 in ((fp32, 4.0), (int8, 2.0)):
        candidate.points = [RunoffPoint(batch_size=8, p50_ms=p50, p99_ms=p50, throughput_per_s=8 / p50 * 1e3)]
    assert choose([fp32, int8, other], "throughput", None, 8, 0.95) is int8, int8.verdict
