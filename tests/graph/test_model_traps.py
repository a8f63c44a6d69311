"""Valid models with the traps real exports carry build and benchmark: a scalar input, a state batched on
axis 1 (silero VAD's interface), an unused custom-domain opset import (Paddle exports)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from accel_opt.builder.pipeline import build
from accel_opt.errors import UsageError

from ..conftest import make_model, matmul_model, save

needs_openvino = pytest.mark.skipif(importlib.util.find_spec("openvino") is None, reason="openvino is not installed")


def vad_model(batch: str | None = "batch") -> onnx.ModelProto:
    """input [batch, 64], state [2, batch, 16], sr scalar int64 -> output [batch, 1], stateN [2, batch, 16].
    `batch=None` leaves the dims unnamed, as silero_vad.onnx declares them."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array((rng.standard_normal((64, 16)) * 0.2).astype(np.float32), "W1"),
        numpy_helper.from_array((rng.standard_normal((16, 1)) * 0.3).astype(np.float32), "W2"),
        numpy_helper.from_array(np.array([0], np.int64), "axis0"),
        numpy_helper.from_array(np.array(16000.0, np.float32), "rate"),
    ]
    nodes = [
        helper.make_node("MatMul", ["input", "W1"], ["h"]),
        helper.make_node("Unsqueeze", ["h", "axis0"], ["h3"]),
        helper.make_node("Add", ["state", "h3"], ["pre"]),
        helper.make_node("Tanh", ["pre"], ["stateN"]),
        helper.make_node("ReduceSum", ["stateN", "axis0"], ["pooled"], keepdims=0),
        helper.make_node("MatMul", ["pooled", "W2"], ["logit"]),
        helper.make_node("Cast", ["sr"], ["sr_f"], to=TensorProto.FLOAT),
        helper.make_node("Div", ["sr_f", "rate"], ["k"]),
        helper.make_node("Mul", ["logit", "k"], ["scaled"]),
        helper.make_node("Sigmoid", ["scaled"], ["output"]),
    ]
    value = helper.make_tensor_value_info
    return make_model(
        nodes,
        [value("input", TensorProto.FLOAT, [batch, 64]), value("state", TensorProto.FLOAT, [2, batch, 16]),
         value("sr", TensorProto.INT64, [])],
        [value("output", TensorProto.FLOAT, [batch, 1]), value("stateN", TensorProto.FLOAT, [2, batch, 16])],
        weights,
    )


def _vad_data(folder: Path, count: int = 12) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(1)
    for i in range(count):
        np.savez(folder / f"chunk_{i:02d}.npz", input=(rng.standard_normal((1, 64)) * 0.5).astype(np.float32),
                 state=(rng.standard_normal((2, 1, 16)) * 0.1).astype(np.float32), sr=np.array(16000, np.int64))
    return folder


def test_scalar_input_and_batch_on_axis_1_build_and_benchmark(fast_recipe, tmp_path):
    model = save(vad_model(), tmp_path / "vad.onnx")
    result = build(model, fast_recipe, data_dir=_vad_data(tmp_path / "data"), out_dir=tmp_path / "out")
    assert result.signed_off, result.failures
    folder = Path(result.artifact_dir)
    config = json.loads((folder / "resource_config.json").read_text())
    assert {i["name"]: i["batch_axis"] for i in config["inputs"]} == {"input": 0, "state": 1, "sr": None}
    assert {i["name"]: i["shape_used"] for i in config["inputs"]} == {"input": [8, 64], "state": [2, 8, 16], "sr": []}
    assert [h.batch_size for h in result.headline] == [1, 2]  # swept along each input's own batch axis
    evaluation = json.loads((folder / "accuracy.json").read_text())["evaluation"]
    assert evaluation["mode"] == "batched" and evaluation["calls"] == 2  # 12 chunks in batches of 8, outputs cut back


def test_unnamed_batch_axis_is_given_by_the_recipe(fast_recipe, tmp_path):
    model = save(vad_model(batch=None), tmp_path / "vad_unnamed.onnx")
    data = _vad_data(tmp_path / "data", 4)
    recipe = fast_recipe.with_overrides(batch_axes={"state": 1})
    result = build(model, recipe, data_dir=data, out_dir=tmp_path / "out")
    assert result.signed_off and [h.batch_size for h in result.headline] == [1, 2]
    with pytest.raises(UsageError, match="unknown input 'nope'"):
        build(model, fast_recipe.with_overrides(batch_axes={"nope": 0}), data_dir=data, out_dir=tmp_path / "out")


def test_synthetic_scalar_inputs_still_benchmark(fast_recipe, tmp_path):
    """Random samples differ in the scalar `sr`: the gate runs them one by one, the benchmark batches the rest."""
    model = save(vad_model(), tmp_path / "vad.onnx")
    result = build(model, fast_recipe, out_dir=tmp_path / "out")
    assert result.signed_off and [h.batch_size for h in result.headline] == [1, 2]
    evaluation = json.loads((Path(result.artifact_dir) / "accuracy.json").read_text())["evaluation"]
    assert evaluation["mode"] == "per-sample" and "cannot be packed" in evaluation["note"]


def _with_unused_paddle_import(tmp_path: Path, source: onnx.ModelProto) -> Path:
    source.opset_import.append(helper.make_opsetid("Paddle", 1))
    return save(source, tmp_path / "paddle_export.onnx")


def test_unused_custom_domain_import_is_dropped(fast_recipe, tmp_path):
    model = _with_unused_paddle_import(tmp_path, matmul_model())
    result = build(model, fast_recipe, out_dir=tmp_path / "out")
    assert result.signed_off
    folder = Path(result.artifact_dir)
    assert "Paddle" not in {o.domain for o in onnx.load(str(folder / "model.onnx")).opset_import}
    notes = json.loads((folder / "build.json").read_text())["notes"]
    assert any("unused opset imports dropped: Paddle" in n for n in notes)


def test_unused_custom_domain_import_survives_the_bf16_opset_upgrade(tiny_cnn_path, tmp_path):
    """The bf16 transform lifts opset 17 to 22 (ONNX admits bfloat16 on Conv from 22): a Paddle import that
    onnx.helper cannot look up must not break it. The graph transform runs on every CPU; only running bf16 needs one."""
    from accel_opt.precision.fp16 import convert_float
    from accel_opt.recipe.stages import PrecisionConfig
    from accel_opt.recipe.types import Precision

    model = _with_unused_paddle_import(tmp_path, onnx.load(str(tiny_cnn_path)))
    report = convert_float(model, Precision.bf16, PrecisionConfig(), tmp_path / "bf16.onnx")
    converted = onnx.load(str(tmp_path / "bf16.onnx"))
    onnx.checker.check_model(converted)
    assert {o.domain: o.version for o in converted.opset_import}[""] == 22 and report.opset_after == 22
    assert any(v.type.tensor_type.elem_type == TensorProto.BFLOAT16 for v in converted.graph.value_info) or \
        any(i.data_type == TensorProto.BFLOAT16 for i in converted.graph.initializer)


def test_upgrade_opset_keeps_custom_domains_it_cannot_look_up(tmp_path):
    from accel_opt.graph.save import upgrade_opset

    model = matmul_model()
    model.opset_import.append(helper.make_opsetid("com.example.custom", 3))
    path = save(model, tmp_path / "m.onnx")
    upgraded = onnx.load(str(upgrade_opset(path, 18, tmp_path / "up.onnx", "test")))
    assert {(o.domain, o.version) for o in upgraded.opset_import} >= {("", 18), ("com.example.custom", 3)}


def detector_model(size: int = 64, classes: int = 3) -> onnx.ModelProto:
    """A dense-head detector: image [batch, 3, size, size] -> [batch, 4 + classes, 16] (cx, cy, w, h in pixels)."""
    rng = np.random.default_rng(4)
    attrs = 4 + classes
    scale = np.ones((1, attrs, 1), np.float32)
    scale[0, :4, 0] = size
    weights = [
        numpy_helper.from_array((rng.standard_normal((8, 3, 4, 4)) * 0.3).astype(np.float32), "W1"),
        numpy_helper.from_array((rng.standard_normal((attrs, 8, 4, 4)) * 0.3).astype(np.float32), "W2"),
        numpy_helper.from_array(np.array([0, attrs, -1], np.int64), "head_shape"),
        numpy_helper.from_array(scale, "pixels"),
    ]
    nodes = [
        helper.make_node("Conv", ["images", "W1"], ["c1"], kernel_shape=[4, 4], strides=[4, 4]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "W2"], ["c2"], kernel_shape=[4, 4], strides=[4, 4]),
        helper.make_node("Reshape", ["c2", "head_shape"], ["raw"]),
        helper.make_node("Sigmoid", ["raw"], ["unit"]),
        helper.make_node("Mul", ["unit", "pixels"], ["output0"]),
    ]
    value = helper.make_tensor_value_info
    return make_model(nodes, [value("images", TensorProto.FLOAT, ["batch", 3, size, size])],
                      [value("output0", TensorProto.FLOAT, ["batch", attrs, 16])], weights)


def test_detector_recipe_gates_on_matched_boxes(tmp_path):
    from accel_opt.recipe.load import load_recipe

    from ..conftest import FAST_BENCH

    model = save(detector_model(), tmp_path / "det.onnx")
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(5)
    for i in range(6):
        np.savez(data / f"frame{i}.npz", images=rng.standard_normal((1, 3, 64, 64)).astype(np.float32))
    recipe = load_recipe("detector").with_overrides(benchmark=FAST_BENCH)
    result = build(model, recipe, data_dir=data, out_dir=tmp_path / "out")
    assert result.signed_off, result.failures
    (metric,) = json.loads((Path(result.artifact_dir) / "accuracy.json").read_text())["task_metrics"]
    assert metric["kind"] == "detection" and metric["values"] == {"precision": 1.0, "recall": 1.0}
    assert "reference and" in metric["note"] and not metric["note"].startswith("0 reference")


def test_unseen_batch_axis_falls_back_to_the_given_shapes(fast_recipe, tmp_path):
    """s's batch axis (1) is unnamed, so it is left unbatched, and the model fails at batch 8: the build
    deploys at the shapes given and says how to name the axis, instead of crashing."""
    value = helper.make_tensor_value_info
    model = save(make_model(
        [helper.make_node("Unsqueeze", ["x", "axis0"], ["x3"]), helper.make_node("Concat", ["s", "x3"], ["y"], axis=0)],
        [value("x", TensorProto.FLOAT, [None, 4]), value("s", TensorProto.FLOAT, [1, None, 4])],
        [value("y", TensorProto.FLOAT, [2, None, 4])],
        [numpy_helper.from_array(np.array([0], np.int64), "axis0")],
    ), tmp_path / "concat.onnx")
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        np.savez(data / f"{i}.npz", x=np.full((1, 4), i, np.float32), s=np.ones((1, 1, 4), np.float32))
    result = build(model, fast_recipe, data_dir=data, out_dir=tmp_path / "out")
    assert result.signed_off and [h.batch_size for h in result.headline] == [1]
    notes = json.loads((Path(result.artifact_dir) / "build.json").read_text())["notes"]
    assert any("fails at batch 8" in n and "--batch-axes" in n for n in notes)
    named = build(model, fast_recipe.with_overrides(batch_axes={"s": 1}), data_dir=data, out_dir=tmp_path / "out")
    assert named.signed_off and [h.batch_size for h in named.headline] == [1, 2]
