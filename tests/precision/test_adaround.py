"""AdaRound on the build's own Q/DQ graph: each layer's integer weights move at most one step from nearest, stay in the
preset's range, and bring the int8 output closer to fp32's on inputs it never saw; nothing but weight integers
changes; the rounding is learned once and reused by builds that keep layers in float."""

from __future__ import annotations

import re

import numpy as np
import pytest

from accel_opt.precision.int8 import quantize
from accel_opt.recipe.stages import CalibrationConfig

from ..conftest import outputs_as_written
from .conftest import CPU, weights_of

pytest.importorskip("torch", reason="AdaRound learns the rounding with PyTorch (the `ptq` extra)")


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

    before, after = weights_of(tmp_path / "nearest.onnx"), weights_of(tmp_path / "adaround.onnx")
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
    everything, fewer = weights_of(tmp_path / "all.onnx"), weights_of(tmp_path / "partial.onnx")
    shared = [n for n in fewer if n.endswith("_quantized") and fewer[n].dtype == np.int8]
    assert len(shared) == 3 and all(np.array_equal(everything[n], fewer[n]) for n in shared)  # fc stays float


def test_a_rounding_learned_beside_float_layers_is_never_reused_by_the_whole_graph(block, tmp_path):
    model, calibration, _ = block
    cache = tmp_path / "cache"
    config = CalibrationConfig(samples=32, weight_rounding="adaround", adaround_iterations=20)
    first = quantize(model, calibration, config, "onnxruntime", tmp_path / "partial.onnx", cache, CPU, exclude=["stem"])
    whole = quantize(model, calibration, config, "onnxruntime", tmp_path / "all.onnx", cache, CPU)
    later = quantize(model, calibration, config, "onnxruntime", tmp_path / "later.onnx", cache, CPU, exclude=["fc"])
    assert any(n.startswith("AdaRound: 3 of 3 layers re-rounded") for n in first.notes), first.notes
    assert any(re.match(r"AdaRound: \d of 4 layers re-rounded", n) for n in whole.notes), whole.notes  # learned anew
    assert any(n.startswith("AdaRound: the rounding learned for") for n in later.notes), later.notes  # the whole's
    everything, fewer = weights_of(tmp_path / "all.onnx"), weights_of(tmp_path / "later.onnx")
    assert all(np.array_equal(everything[n], fewer[n]) for n in fewer if fewer[n].dtype == np.int8)


def test_once_its_time_budget_is_spent_the_layers_left_keep_nearest_rounding(block, tmp_path):
    model, calibration, _ = block
    config = CalibrationConfig(samples=32, adaround_iterations=20)
    quantize(model, calibration, config, "onnxruntime", tmp_path / "nearest.onnx", None, CPU)
    spent = quantize(model, calibration, config.model_copy(update={"weight_rounding": "adaround",
                                                                   "adaround_time_budget_s": 1e-9}),
                     "onnxruntime", tmp_path / "spent.onnx", None, CPU)
    note = next(n for n in spent.notes if n.startswith("AdaRound:"))
    assert "0 of 4 layers re-rounded" in note and "the last 4 layers keep nearest rounding" in note, note
    before, after = weights_of(tmp_path / "nearest.onnx"), weights_of(tmp_path / "spent.onnx")
    assert all(np.array_equal(before[name], after[name]) for name in before)
