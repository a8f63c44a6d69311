"""Bias correction on the build's own Q/DQ graph: each quantized Conv/Gemm's bias absorbs the mean shift its rounded
weights add, so the int8 output's mean moves back to fp32's; nothing but bias values changes; the float biases of
TensorRT's preset are corrected too; the cache keys it apart."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from accel_opt.machine.cpu import CpuProfile
from accel_opt.precision.int8 import quantize
from accel_opt.recipe.stages import CalibrationConfig

from ..conftest import make_model, outputs_as_written, save

CPU = CpuProfile.of_class("avx2")  # 7-bit weights for ORT's preset (the class picks the range: any would do here)
LEVELS = {"ort_cpu": 63, "tensorrt": 127}  # each preset's largest weight step: 7-bit for ORT on the AVX2 profile
CHANNELS = 16


def _depthwise_net(path: Path, levels: int) -> Path:
    """conv 3->16, depthwise 3x3 whose weights sit 0.4 of a step off the weights' grid (rounding shifts every output the
    same way: what bias correction is for), ReLU, global pool, Gemm 16->10."""
    rng = np.random.default_rng(0)
    stem = rng.normal(0, 0.3, (CHANNELS, 3, 3, 3)).astype(np.float32)
    steps = rng.integers(levels // 6, levels - 3, (CHANNELS, 1, 3, 3)).astype(np.float32)
    steps[:, :, 0, 0] = levels  # each channel's largest weight: its scale is exactly 1/levels of it
    depthwise = ((steps + 0.4 * (steps < levels)) / levels * 0.5).astype(np.float32)
    fc = rng.normal(0, 0.5, (10, CHANNELS)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h1"], name="stem", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["h1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["h2"], name="depthwise", group=CHANNELS, pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["h2"], ["r2"], name="relu2"),
             helper.make_node("GlobalAveragePool", ["r2"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "w3", "b3"], ["y"], name="fc", transB=1)]
    inits = [numpy_helper.from_array(a, n) for n, a in (("w1", stem), ("b1", np.zeros(CHANNELS, np.float32)),
                                                        ("w2", depthwise), ("b2", np.zeros(CHANNELS, np.float32)),
                                                        ("w3", fc), ("b3", np.zeros(10, np.float32)))]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])], inits)
    return save(model, path)


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bias")
    rng = np.random.default_rng(1)
    samples = [{"x": rng.uniform(0, 1, (1, 3, 16, 16)).astype(np.float32)} for _ in range(48)]
    models = {target: _depthwise_net(folder / f"{target}.onnx", levels) for target, levels in LEVELS.items()}
    return models, samples[:32], samples[32:]


@pytest.mark.parametrize("target", ["ort_cpu", "tensorrt"])
def test_corrected_biases_bring_the_int8_outputs_mean_back_to_fp32s(net, target, tmp_path):
    models, calibration, held_out = net
    model = models[target]
    config = CalibrationConfig(samples=32, target=target)
    plain = quantize(model, calibration, config, "onnxruntime", tmp_path / "plain.onnx", None, CPU)
    corrected = quantize(model, calibration, config.model_copy(update={"bias_correction": True}), "onnxruntime",
                         tmp_path / "corrected.onnx", None, CPU)
    assert "biases corrected" in corrected.transform and "biases corrected" not in plain.transform
    note = next(n for n in corrected.notes if n.startswith("bias correction:"))
    assert note.startswith("bias correction: 3 layers' biases")  # stem, depthwise, fc
    reference = outputs_as_written(model, held_out)
    shift_before = np.abs((outputs_as_written(tmp_path / "plain.onnx", held_out) - reference).mean(0)).mean()
    shift_after = np.abs((outputs_as_written(tmp_path / "corrected.onnx", held_out) - reference).mean(0)).mean()
    assert shift_after < 0.5 * shift_before, (shift_before, shift_after)

    before, after = onnx.load(str(tmp_path / "plain.onnx")), onnx.load(str(tmp_path / "corrected.onnx"))
    assert [(n.op_type, list(n.input)) for n in before.graph.node] == [(n.op_type,
                                                                        list(n.input)) for n in after.graph.node]
    changed = {i.name for i, j in zip(before.graph.initializer, after.graph.initializer)
               if not np.array_equal(numpy_helper.to_array(i), numpy_helper.to_array(j))}
    assert changed and all("b" in name for name in changed), changed  # bias values only


def test_bias_correction_is_its_own_cache_entry(net, tmp_path):
    models, calibration, _ = net
    model = models["ort_cpu"]
    cache = tmp_path / "cache"
    config = CalibrationConfig(samples=32)
    quantize(model, calibration, config, "onnxruntime", tmp_path / "a.onnx", cache, CPU)
    corrected = quantize(model, calibration, config.model_copy(update={"bias_correction": True}), "onnxruntime",
                         tmp_path / "b.onnx", cache, CPU)
    assert not corrected.calibration.cache_hit
    again = quantize(model, calibration, config.model_copy(update={"bias_correction": True}), "onnxruntime",
                     tmp_path / "c.onnx", cache, CPU)
    assert again.calibration.cache_hit
