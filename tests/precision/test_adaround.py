"""AdaRound on the build's own Q/DQ graph: each layer's integer weights move at most one step from nearest, stay in the
preset's range, and bring the int8 output closer to fp32's on inputs it never saw; nothing but weight integers
changes; the rounding is learned once and reused by builds that keep layers in float."""

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

pytest.importorskip("torch", reason="AdaRound learns the rounding with PyTorch (the `ptq` extra)")

CPU = CpuProfile.of_class("avx2")  # 7-bit weights for ORT's preset: coarser steps, so the rounding matters more
CHANNELS = 16


def _mobile_block(path: Path) -> Path:
    """A MobileNet-like block: conv 3->16 with asymmetric pads, Clip(0, 6) (ReLU6), depthwise 3x3, ReLU6, 1x1
    projection, global pool, Gemm 16->10."""
    rng = np.random.default_rng(0)
    weights = {"w1": rng.normal(0, 0.4, (CHANNELS, 3, 3, 3)), "b1": rng.normal(0, 0.1, CHANNELS),
               "w2": rng.normal(0, 0.5, (CHANNELS, 1, 3, 3)), "b2": rng.normal(0, 0.1, CHANNELS),
               "w3": rng.normal(0, 0.3, (CHANNELS, CHANNELS, 1, 1)), "b3": rng.normal(0, 0.1, CHANNELS),
               "w4": rng.normal(0, 0.5, (10, CHANNELS)), "b4": np.zeros(10), "low": np.array(0.0), "high": np.array(6.0)}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h1"], name="stem", pads=[0, 0, 1, 1], strides=[2, 2]),
             helper.make_node("Clip", ["h1", "low", "high"], ["r1"], name="relu6_1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["h2"], name="depthwise", group=CHANNELS, pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["h2", "low", "high"], ["r2"], name="relu6_2"),
             helper.make_node("Conv", ["r2", "w3", "b3"], ["h3"], name="project"),
             helper.make_node("GlobalAveragePool", ["h3"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "w4", "b4"], ["y"], name="fc", transB=1)]
    inits = [numpy_helper.from_array(np.asarray(a, np.float32), n) for n, a in weights.items()]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])], inits)
    return save(model, path)


def _weights(path: Path) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}


@pytest.fixture(scope="module")
def block(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adaround")
    rng = np.random.default_rng(1)
    samples = [{"x": rng.uniform(-1, 1, (1, 3, 16, 16)).astype(np.float32)} for _ in range(64)]
    return _mobile_block(folder / "block.onnx"), samples[:32], samples[32:]


def test_adaround_brings_the_int8_output_closer_to_fp32_on_inputs_it_never_saw(block, tmp_path):
    model, calibration, held_out = block
    config = CalibrationConfig(samples=32, adaround_iterations=100)
    nearest = quantize(model, calibration, config, "onnxruntime", tmp_path / "nearest.onnx", None, CPU)
    rounded = quantize(model, calibration, config.model_copy(update={"weight_rounding": "adaround"}), "onnxruntime",
                       tmp_path / "adaround.onnx", None, CPU)
    assert "AdaRound" in rounded.transform and "AdaRound" not in nearest.transform
    note = next(n for n in rounded.notes if n.startswith("AdaRound:"))
    assert "of 4 layers re-rounded" in note, note  # stem, depthwise, projection, fc

    reference = outputs_as_written(model, held_out)
    error_nearest = np.sqrt(np.mean((outputs_as_written(tmp_path / "nearest.onnx", held_out) - reference) ** 2))
    error_adaround = np.sqrt(np.mean((outputs_as_written(tmp_path / "adaround.onnx", held_out) - reference) ** 2))
    assert error_adaround < 0.85 * error_nearest, (error_nearest, error_adaround)  # 0.72x measured

    before, after = _weights(tmp_path / "nearest.onnx"), _weights(tmp_path / "adaround.onnx")
    assert before.keys() == after.keys()
    changed = [name for name in before if not np.array_equal(before[name], after[name])]
    assert changed and all(before[name].dtype == np.int8 for name in changed), changed  # weight integers only
    for name in changed:
        assert np.abs(before[name].astype(int) - after[name].astype(int)).max() == 1  # up or down, never further
        assert after[name].min() >= -64 and after[name].max() <= 64  # 7-bit symmetric, as the preset quantized them


def test_a_build_keeping_layers_in_float_reuses_the_rounding_learned_on_the_all_int8_graph(block, tmp_path):
    model, calibration, _ = block
    cache = tmp_path / "cache"
    config = CalibrationConfig(samples=32, weight_rounding="adaround", adaround_iterations=50)
    quantize(model, calibration, config, "onnxruntime", tmp_path / "all.onnx", cache, CPU)
    corrected = quantize(model, calibration, config.model_copy(update={"bias_correction": True}), "onnxruntime",
                         tmp_path / "corrected.onnx", cache, CPU)
    partial = quantize(model, calibration, config, "onnxruntime", tmp_path / "partial.onnx", cache, CPU,
                       exclude=["fc"])
    for report in (corrected, partial):  # bias correction runs after the rounding: the same rounding serves it
        assert any(n.startswith("AdaRound: the rounding learned for") for n in report.notes), report.notes
    everything, fewer = _weights(tmp_path / "all.onnx"), _weights(tmp_path / "partial.onnx")
    shared = [n for n in fewer if n.endswith("_quantized") and fewer[n].dtype == np.int8]
    assert len(shared) == 3 and all(np.array_equal(everything[n], fewer[n]) for n in shared)  # fc stays float


def test_once_its_time_budget_is_spent_the_layers_left_keep_nearest_rounding(block, tmp_path):
    model, calibration, _ = block
    config = CalibrationConfig(samples=32, adaround_iterations=20)
    quantize(model, calibration, config, "onnxruntime", tmp_path / "nearest.onnx", None, CPU)
    spent = quantize(model, calibration, config.model_copy(update={"weight_rounding": "adaround",
                                                                   "adaround_time_budget_s": 1e-9}),
                     "onnxruntime", tmp_path / "spent.onnx", None, CPU)
    note = next(n for n in spent.notes if n.startswith("AdaRound:"))
    assert "0 of 4 layers re-rounded" in note and "the last 4 layers keep nearest rounding" in note, note
    before, after = _weights(tmp_path / "nearest.onnx"), _weights(tmp_path / "spent.onnx")
    assert all(np.array_equal(before[name], after[name]) for name in before)
