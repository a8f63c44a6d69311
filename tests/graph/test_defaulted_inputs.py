"""An input that also has an initializer is an input with a default: fed where the build's data gives it, its default
a constant where not; never both (the quantizer would take the default for a weight, and a feed would change
nothing)."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from accel_opt import runtime
from accel_opt.builder.pipeline import build
from accel_opt.graph.inspect import io_specs
from accel_opt.graph.load import load_model

from ..conftest import make_model, save

WEIGHT = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)


def _scaled(path):
    """y = (x @ W) * scale, `scale` an input whose default is 2."""
    return save(make_model(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Mul", ["h", "scale"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8]),
         helper.make_tensor_value_info("scale", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(WEIGHT, "W"), numpy_helper.from_array(np.array([2.0], np.float32), "scale")]), path)


def _data(folder, with_scale: bool, count: int = 80):
    folder.mkdir()
    rng = np.random.default_rng(1)
    for i in range(count):
        arrays = {"x": rng.uniform(-1, 1, (1, 8)).astype(np.float32)}  # bounded: calibration sees the range
        if with_scale:
            arrays["scale"] = np.array([0.5 + i % 3], np.float32)
        np.savez(folder / f"{i:03d}.npz", **arrays)
    return folder


@pytest.mark.parametrize("fed", [set(), {"x", "scale"}])
def test_the_data_decides_what_a_defaulted_input_becomes(tmp_path, fed):
    loaded = load_model(_scaled(tmp_path / "m.onnx"), tmp_path, fed=fed)
    names = [spec.name for spec in io_specs(onnx.load(str(loaded.path)))[0]]
    assert names == (["x", "scale"] if "scale" in fed else ["x"])
    assert sum("'scale' has a default" in note for note in loaded.notes) == 1


def test_old_ir_lists_weights_as_inputs_and_they_stay_weights(tmp_path):
    model = onnx.load(str(_scaled(tmp_path / "m.onnx")))
    model.graph.input.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, [8, 4]))
    model.ir_version = 3
    loaded = load_model(save(model, tmp_path / "old.onnx"), tmp_path)
    assert [spec.name for spec in io_specs(loaded.proto)[0]] == ["x"]


@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_folder_feeds_a_defaulted_input_only_where_the_data_gave_it(tmp_path, fast_recipe, with_scale, precision):
    data = _data(tmp_path / "data", with_scale)
    result = build(_scaled(tmp_path / "m.onnx"), fast_recipe.with_overrides(precision=precision), data_dir=data,
                   out_dir=tmp_path / "out")
    # an 8x4 matmul keeps too little of int8 to sign off: what is checked is what the feed does
    assert result.signed_off or precision == "int8", result.failures
    deployment = runtime.load(result.artifact_dir, allow_not_signed_off=True)
    x = np.load(data / "000.npz")["x"]  # within the ranges int8 calibrated
    scale = 0.5 if with_scale else 2.0  # fed: a value the data gave (int8's calibrated range is the data's)
    feed = {"x": x, "scale": np.array([scale], np.float32)} if with_scale else {"x": x}
    assert [spec.name for spec in deployment.config.inputs] == list(feed)
    with deployment.runner() as runner:
        answer = runner.infer(feed)["y"]
    expected = x @ WEIGHT * scale
    assert np.abs(answer - expected).max() < (0.01 if precision == "fp32" else 0.15) * np.abs(expected).max()
