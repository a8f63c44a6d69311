"""The bias and weight fits on the build's own Q/DQ graph: the torch form they train through computes what ONNX Runtime
computes, the fitted biases (and int8 weights) bring the int8 output closer to fp32's on inputs the fit never saw,
nothing but those integers changes and the weights stay in their range, a fit that cannot show a gain on held-back
samples keeps nothing, the fit is learned once and reused by builds that keep layers in float, and a graph with an
operator it has no differentiable form of is refused by that operator's name."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from accel_opt.errors import Unsupported
from accel_opt.precision.int8 import quantize
from accel_opt.recipe.stages import CalibrationConfig

from ..conftest import make_model, outputs_as_written, save
from .conftest import CPU, weights_of

torch = pytest.importorskip("torch", reason="the bias fit trains with PyTorch (the `ptq` extra)")

from accel_opt.precision.torch_graph import TorchGraph  # noqa: E402  (needs torch)


def _torch_outputs(path, samples) -> np.ndarray:
    graph = TorchGraph(onnx.load(str(path)))
    with torch.no_grad():
        return graph({"x": torch.from_numpy(np.concatenate([s["x"] for s in samples]))})[0].numpy()


def _many_ops(path):
    """A float graph of the other operators the torch form knows: pools with pads, Concat, swish, HardSigmoid,
    ReduceMean, Reshape, Transpose, Squeeze/Unsqueeze, MatMul, Softmax."""
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.normal(0, 0.3, (16, 5)).astype(np.float32), "m"),
             numpy_helper.from_array(np.array([0, -1, 16], np.int64), "shape"),
             numpy_helper.from_array(np.array([2], np.int64), "axes")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c"], ["s"]), helper.make_node("Mul", ["c", "s"], ["swish"]),
             helper.make_node("MaxPool", ["swish"], ["mp"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("AveragePool", ["c"], ["ap"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("HardSigmoid", ["ap"], ["hs"], alpha=0.3),
             helper.make_node("Concat", ["mp", "hs"], ["cat"], axis=1),
             helper.make_node("ReduceMean", ["cat"], ["rm"], axes=[3], keepdims=0),
             helper.make_node("Transpose", ["rm"], ["t"], perm=[0, 2, 1]),
             helper.make_node("Reshape", ["t", "shape"], ["r"]),
             helper.make_node("Unsqueeze", ["r", "axes"], ["u"]), helper.make_node("Squeeze", ["u", "axes"], ["q"]),
             helper.make_node("MatMul", ["q", "m"], ["mm"]), helper.make_node("Softmax", ["mm"], ["y"], axis=-1)]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return save(model, path)


def test_the_torch_form_computes_what_onnx_runtime_computes_float_and_quantized(block, tmp_path):
    model, calibration, held_out = block
    quantize(model, calibration, CalibrationConfig(samples=32), "onnxruntime", tmp_path / "int8.onnx", None, CPU)
    many = _many_ops(tmp_path / "many.onnx")
    for path in (model, many):
        np.testing.assert_allclose(_torch_outputs(path, held_out), outputs_as_written(path, held_out), rtol=1e-4,
                                   atol=1e-5)
    quantized = tmp_path / "int8.onnx"
    theirs = outputs_as_written(quantized, held_out)
    ours = _torch_outputs(quantized, held_out)
    # The two sum in another order: an activation may land one step apart at a rounding boundary, nothing more.
    assert np.sqrt(np.mean((ours - theirs) ** 2)) < 0.02 * np.sqrt(np.mean(theirs ** 2))


def test_the_bias_fit_brings_the_int8_output_closer_to_fp32_on_inputs_it_never_saw(block, tmp_path):
    model, calibration, held_out = block
    config = CalibrationConfig(samples=32, bias_fit_steps=100)
    plain = quantize(model, calibration, config, "onnxruntime", tmp_path / "plain.onnx", None, CPU)
    fitted = quantize(model, calibration, config.model_copy(update={"bias_fit": True}), "onnxruntime",
                      tmp_path / "fitted.onnx", None, CPU)
    note = next(n for n in fitted.notes if n.startswith("bias fit:"))
    assert "the biases of 4 layers" in note and "8 held back" in note, note  # stem, depthwise, projection, fc
    assert not any(n.startswith("bias fit:") for n in plain.notes)

    reference = outputs_as_written(model, held_out)
    error_plain = np.sqrt(np.mean((outputs_as_written(tmp_path / "plain.onnx", held_out) - reference) ** 2))
    error_fitted = np.sqrt(np.mean((outputs_as_written(tmp_path / "fitted.onnx", held_out) - reference) ** 2))
    assert error_fitted < 0.9 * error_plain, (error_plain, error_fitted)

    before, after = weights_of(tmp_path / "plain.onnx"), weights_of(tmp_path / "fitted.onnx")
    assert before.keys() == after.keys()
    changed = [name for name in before if not np.array_equal(before[name], after[name])]
    assert changed and all(before[name].dtype == np.int32 for name in changed), changed  # int32 biases only


@pytest.mark.parametrize(("fit", "reused", "dtypes"), [
    ({"bias_fit": True, "bias_fit_steps": 25},
     "bias fit: the biases fitted on the whole graph reused for 3 of its 4 layers",
     {np.int32}),
    ({"weight_fit": True, "weight_fit_steps": 300},
     "weight fit: the biases and weights fitted on the whole graph reused for 6 of its 8 tensors",
     {np.int32, np.int8})])
def test_a_build_keeping_layers_in_float_reuses_the_fit_learned_on_the_all_int8_graph(block, tmp_path, fit, reused,
                                                                                       dtypes):
    model, calibration, _ = block
    cache = tmp_path / "cache"
    config = CalibrationConfig(samples=32, **fit)
    quantize(model, calibration, config, "onnxruntime", tmp_path / "all.onnx", cache, CPU)
    partial = quantize(model, calibration, config, "onnxruntime", tmp_path / "partial.onnx", cache, CPU, exclude=["fc"])
    assert reused in partial.notes, partial.notes
    everything, fewer = weights_of(tmp_path / "all.onnx"), weights_of(tmp_path / "partial.onnx")
    shared = [n for n in fewer if n.endswith("_quantized") and fewer[n].dtype.type in dtypes]
    assert len(shared) == 3 * len(dtypes) and all(np.array_equal(everything[n], fewer[n]) for n in shared)  # fc float


def test_an_operator_without_a_differentiable_form_is_refused_by_name(tmp_path):
    model = make_model([helper.make_node("Erf", ["x"], ["y"])],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    with pytest.raises(Unsupported, match="no differentiable form of Erf"):
        TorchGraph(model)


def test_the_weight_fit_moves_int8_weights_within_their_range_and_beats_the_graph_as_it_came(block, tmp_path):
    model, calibration, held_out = block
    config = CalibrationConfig(samples=32, weight_fit_steps=300)
    quantize(model, calibration, config, "onnxruntime", tmp_path / "plain.onnx", None, CPU)
    fitted = quantize(model, calibration, config.model_copy(update={"weight_fit": True}), "onnxruntime",
                      tmp_path / "fitted.onnx", None, CPU)
    note = next(n for n in fitted.notes if n.startswith("weight fit:"))
    assert "the biases of 4 layers and the weights of 4" in note and "8 held back" in note, note

    reference = outputs_as_written(model, held_out)
    error_plain = np.sqrt(np.mean((outputs_as_written(tmp_path / "plain.onnx", held_out) - reference) ** 2))
    error_fitted = np.sqrt(np.mean((outputs_as_written(tmp_path / "fitted.onnx", held_out) - reference) ** 2))
    assert error_fitted < 0.9 * error_plain, (error_plain, error_fitted)

    before, after = weights_of(tmp_path / "plain.onnx"), weights_of(tmp_path / "fitted.onnx")
    assert before.keys() == after.keys()  # the same graph: no scale, zero point or node changes
    changed = {name for name in before if not np.array_equal(before[name], after[name])}
    assert {after[name].dtype for name in changed} == {np.dtype(np.int8), np.dtype(np.int32)}, changed
    low, high = -64, 64  # CPU is avx2: 7-bit symmetric weights
    assert all(after[n].min() >= low and after[n].max() <= high for n in changed if after[n].dtype == np.int8)
    assert onnx.load(str(tmp_path / "plain.onnx")).graph.node == onnx.load(str(tmp_path / "fitted.onnx")).graph.node


def test_a_fit_that_shows_no_gain_on_the_held_back_samples_keeps_the_graph_as_it_came(block, tmp_path):
    model, calibration, _ = block
    config = CalibrationConfig(samples=32)
    quantize(model, calibration, config, "onnxruntime", tmp_path / "plain.onnx", None, CPU)
    spent = config.model_copy(update={"weight_fit": True, "weight_fit_time_budget_s": 1e-9})  # no step is taken
    report = quantize(model, calibration, spent, "onnxruntime", tmp_path / "fitted.onnx", None, CPU)
    note = next(n for n in report.notes if n.startswith("weight fit:"))
    assert note.startswith("weight fit: nothing kept") and "0 steps" in note, note
    before, after = weights_of(tmp_path / "plain.onnx"), weights_of(tmp_path / "fitted.onnx")
    assert all(np.array_equal(before[name], after[name]) for name in before)

