"""Reduced-precision builds end to end: real transforms, real calibration data, the real gate."""

import json

import numpy as np
import onnx
import pytest

from accel_opt.builder.pipeline import build
from accel_opt.data import split_roles


def _write_data(folder, count=100, calibration_scale=1.0, seed=0):
    """Random images; the ones the pipeline will pick for calibration are scaled by `calibration_scale`. 100: an int8
    build holds 60 out, enough for none failing to show >= 95% within tolerance (59)."""
    rng = np.random.default_rng(seed)
    images = [rng.standard_normal((1, 3, 32, 32)).astype(np.float32) for _ in range(count)]
    from accel_opt.recipe.gate import SplitConfig

    # The split the pipeline makes (recipe seed 0): by index, the images being distinct.
    calibration_ids = set(split_roles([str(i) for i in range(count)], SplitConfig(), True, 64, 300, seed=0).calibration)
    folder.mkdir()
    for i, image in enumerate(images):
        scale = calibration_scale if i in calibration_ids else 1.0
        np.savez(folder / f"{i:02d}.npz", image=(image * scale).astype(np.float32))
    return folder, calibration_ids


def _folder(result, out):
    return out / result.artifact_dir.split("/")[-1]


def test_int8_build_is_qdq_and_signed_off(tiny_cnn_path, fast_recipe, tmp_path, monkeypatch):
    data, calibration_ids = _write_data(tmp_path / "data")
    monkeypatch.chdir(tmp_path)  # a relative --out, as `make demo` gives: quantization runs in another folder
    result = build(tiny_cnn_path, fast_recipe.with_overrides(precision="int8"), data_dir="data", out_dir="out")
    assert result.signed_off, result.failures
    folder = _folder(result, tmp_path / "out")
    model = onnx.load(str(folder / "model.onnx"))
    ops = {n.op_type for n in model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    accuracy = json.loads((folder / "accuracy.json").read_text())
    held_out = 100 - len(calibration_ids) - accuracy["roles"]["steering"]
    assert accuracy["sample_count"] == held_out and accuracy["roles"]["calibration"] == len(calibration_ids)
    signoff = (folder / "signoff.md").read_text()
    assert f"{len(calibration_ids)} calibration samples, disjoint from the {held_out} held-out" in signoff
    bench = json.loads((folder / "benchmark.json").read_text())
    assert [m["label"] for m in bench["models"]] == ["onnxruntime-int8", "onnxruntime-fp32"]
    # The recipe's batch sizes, and the deployed batch (8) where the verdict's benefit is read.
    assert set(bench["speedup_vs_baseline"]["onnxruntime-fp32"]) == {"1", "2", "8"}


def test_broken_calibration_fails_the_gate(tiny_cnn_path, fast_recipe, tmp_path):
    # Calibrating on inputs 1000x too small sets scales that clip every real activation.
    data, _ = _write_data(tmp_path / "data", calibration_scale=1e-3)
    result = build(tiny_cnn_path, fast_recipe.with_overrides(precision="int8"), data_dir=data, out_dir=tmp_path / "out")
    assert not result.signed_off and result.exit_code == 1
    assert any("logits" in f and "cosine" in f for f in result.failures)
    signoff = (_folder(result, tmp_path / "out") / "signoff.md").read_text()
    assert "NOT SIGNED OFF" in signoff and "| logits |" in signoff and "FAIL" in signoff


def test_fp16_build_has_float16_weights_and_fp32_io(tiny_cnn_path, fast_recipe, tmp_path):
    result = build(tiny_cnn_path, fast_recipe.with_overrides(precision="fp16"), out_dir=tmp_path)
    assert result.signed_off, result.failures
    model = onnx.load(str(_folder(result, tmp_path) / "model.onnx"))
    weights = {onnx.helper.tensor_dtype_to_np_dtype(t.data_type) for t in model.graph.initializer if len(t.dims) == 4}
    assert weights == {np.dtype("float16")}
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    benchmark_md = (_folder(result, tmp_path) / "benchmark.md").read_text()
    assert "Speedup of onnxruntime-fp16 over onnxruntime-fp32" in benchmark_md


@pytest.mark.parametrize("method", ["entropy", "percentile"])
def test_calibration_method_reaches_the_report(tiny_cnn_path, fast_recipe, tmp_path, method):
    data, _ = _write_data(tmp_path / "data")
    recipe = fast_recipe.with_overrides(precision="int8", **{"precision_options.calibration.method": method,
                                                              "precision_options.calibration.num_bins": 256})
    result = build(tiny_cnn_path, recipe, data_dir=data, out_dir=tmp_path / "out")
    build_json = json.loads((_folder(result, tmp_path / "out") / "build.json").read_text())
    assert build_json["precision"]["calibration"]["method"] == method


def test_fp16_with_float16_io_takes_float16_inputs(tiny_cnn_path, fast_recipe, tmp_path):
    recipe = fast_recipe.with_overrides(precision="fp16", **{"precision_options.keep_io_types": False})
    result = build(tiny_cnn_path, recipe, out_dir=tmp_path)
    assert result.signed_off, result.failures
    folder = _folder(result, tmp_path)
    config = json.loads((folder / "resource_config.json").read_text())
    assert config["inputs"][0]["dtype"] == "float16" and config["outputs"][0]["dtype"] == "float16"


def test_int8_from_a_folder_of_images_with_recipe_preprocessing(tiny_cnn_path, fast_recipe, tmp_path):
    from PIL import Image

    from accel_opt.zoo import _skimage_photos

    images = tmp_path / "images"
    images.mkdir()
    for i, photo in enumerate(_skimage_photos()[:6]):
        for j, angle in enumerate((0, 90)):
            Image.fromarray(photo).rotate(angle, expand=True).save(images / f"{i:02d}_{j}.jpg")
    recipe = fast_recipe.with_overrides(precision="int8", preprocessing={"resize": 36, "crop": 32})
    result = build(tiny_cnn_path, recipe, data_dir=images, out_dir=tmp_path / "out")
    manifest = json.loads((_folder(result, tmp_path / "out") / "manifest.json").read_text())
    assert manifest["data"]["source"] == "images" and manifest["data"]["count"] == 12
    assert result.stages[-1].status == "passed" and result.worst_cosine > 0.9


def test_int8_build_records_the_integer_kernels_ort_runs(tiny_cnn_path, fast_recipe, tmp_path):
    data, _ = _write_data(tmp_path / "data")
    result = build(tiny_cnn_path, fast_recipe.with_overrides(precision="int8"), data_dir=data, out_dir=tmp_path / "out")
    kernels = json.loads((_folder(result, tmp_path / "out")
                          / "resource_config.json").read_text())["settings"]["integer_kernels_by_op"]
    assert kernels["QLinearConv"] >= 2


def test_quantized_op_left_in_float_by_ort_is_refused(tmp_path):
    """A Q/DQ Conv without a QuantizeLinear after it: ORT cannot fuse it and would run it in float."""
    from accel_opt.backends.onnxruntime.backend import OnnxRuntimeBackend
    from accel_opt.errors import Unsupported
    from accel_opt.recipe.schema import Recipe
    from accel_opt.recipe.types import Precision
    from tests.conftest import lonely_qdq_conv

    model = lonely_qdq_conv(tmp_path / "qdq.onnx")
    with pytest.raises(Unsupported, match="1 quantized compute ops in float.*lonely_conv") as info:
        OnnxRuntimeBackend().compile(model, Precision.int8, Recipe(), tmp_path)
    assert info.value.exit_code == 4
