import numpy as np
import pytest
from onnx import numpy_helper

from accel_opt.accuracy import compare
from accel_opt.backends.onnxruntime import reference_runner
from accel_opt.data import DataSummary
from accel_opt.recipe import CosineMetric, Tolerance, TopKMetric
from accel_opt.report import signoff_markdown

from .conftest import matmul_model, save

TOL = Tolerance(atol=1e-4, rtol=1e-3, min_cosine=0.9999)


def _samples(n=6, dim=4):
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((2, dim)).astype(np.float32)} for _ in range(n)]


def _perturbed(tmp_path, scale: float, name="p.onnx"):
    model = matmul_model()
    w = numpy_helper.to_array(model.graph.initializer[0]) * scale
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(w.astype(np.float32), "W"))
    return save(model, tmp_path / name)


def test_identical_models_pass(tmp_path):
    path = save(matmul_model(), tmp_path / "m.onnx")
    report = compare(reference_runner(path, 1), reference_runner(path, 1), _samples(), TOL)
    assert report.passed and report.sample_count == 6
    assert report.outputs[0].max_abs_error == 0 and report.outputs[0].cosine == pytest.approx(1.0)


def test_perturbed_model_fails_with_numbers(tmp_path):
    ref = save(matmul_model(), tmp_path / "m.onnx")
    report = compare(reference_runner(ref, 1), reference_runner(_perturbed(tmp_path, 1.01), 1), _samples(), TOL)
    assert not report.passed
    assert report.outputs[0].max_abs_error > 1e-3
    assert "y: elemwise error beyond" in report.failures[0]


def test_mean_error_stat_is_looser_than_elemwise(tmp_path):
    ref = save(matmul_model(), tmp_path / "m.onnx")
    cand = _perturbed(tmp_path, 1.01)
    loose = Tolerance(atol=0.05, rtol=0.05, min_cosine=0.99, error_stat="mean")
    assert compare(reference_runner(ref, 1), reference_runner(cand, 1), _samples(), loose).passed


def test_nan_output_fails_the_gate(tmp_path):
    ref = save(matmul_model(), tmp_path / "m.onnx")
    cand = _perturbed(tmp_path, np.nan)
    report = compare(reference_runner(ref, 1), reference_runner(cand, 1), _samples(), Tolerance(atol=1e9, rtol=1e9, min_cosine=-1))
    assert not report.passed
    assert report.outputs[0].non_finite_count > 0
    assert any("NaN/Inf" in f for f in report.failures)


def test_task_metrics(tmp_path):
    ref = save(matmul_model(out_dim=8), tmp_path / "m.onnx")
    model = matmul_model(out_dim=8, seed=5)  # a different classifier: top-1 mostly disagrees
    cand = save(model, tmp_path / "c.onnx")
    samples = [{"x": s["x"]} for s in _samples(20)]
    same = compare(reference_runner(ref, 1), reference_runner(ref, 1), samples, TOL, [TopKMetric(min_agreement={1: 1.0}), CosineMetric()])
    assert same.passed and same.task_metrics[0].values["top1"] == 1.0
    other = compare(reference_runner(ref, 1), reference_runner(cand, 1), samples, Tolerance(atol=1e9, rtol=1e9, min_cosine=-1),
                    [TopKMetric(min_agreement={1: 0.99, 8: 1.0})])
    assert not other.passed
    assert other.task_metrics[0].values["top8"] == 1.0 and other.task_metrics[0].values["top1"] < 0.9
    assert any("task metric topk" in f for f in other.failures)


def test_topk_gate_says_when_samples_are_too_few_to_allow_one_change(tmp_path):
    ref = save(matmul_model(out_dim=8), tmp_path / "m.onnx")
    metric = [TopKMetric(min_agreement={1: 0.97})]
    few = compare(reference_runner(ref, 1), reference_runner(ref, 1), [{"x": s["x"]} for s in _samples(8)], TOL, metric)  # 2 rows each
    assert few.passed  # the note explains a threshold; it is not a failure by itself
    assert "16 evaluation rows" in few.task_metrics[0].note and "at least 34" in few.task_metrics[0].note
    data = DataSummary(source="npz", path="d", count=8, sha256="0", seed=0)
    assert f"- topk: {few.task_metrics[0].note}" in signoff_markdown("m", True, few, None, data, 0, [])
    enough = compare(reference_runner(ref, 1), reference_runner(ref, 1), [{"x": s["x"]} for s in _samples(17)], TOL, metric)
    assert enough.task_metrics[0].note is None
