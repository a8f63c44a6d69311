"""Valid old models build too: opsets ONNX Runtime no longer implements are lifted, synthetic indices stay
inside the tables they index, and ONNX's own backend test models build and reproduce their outputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from accel_opt import runtime
from accel_opt.builder.pipeline import build
from accel_opt.errors import Unsupported
from accel_opt.graph.inspect import index_bounds
from accel_opt.graph.lift import LIFT_TO_OPSET, lift_if_unimplemented, missing_kernel
from accel_opt.graph.load import load_model

from ..conftest import make_model, save

value = helper.make_tensor_value_info


def _add6(path: Path, rows: int | str = 2) -> Path:
    """y = x + b at opset 6, whose Add ONNX Runtime 1.32 has no kernel for; x is [rows, 4]."""
    b = numpy_helper.from_array(np.arange(4, dtype=np.float32), "b")
    return save(make_model([helper.make_node("Add", ["x", "b"], ["y"], broadcast=1)],
                           [value("x", TensorProto.FLOAT, [rows, 4])], [value("y", TensorProto.FLOAT, [rows, 4])], [b],
                           opset=6), path)


def test_an_opset_onnx_runtime_dropped_is_lifted_with_a_note(tmp_path):
    path = _add6(tmp_path / "add6.onnx")
    assert missing_kernel(path) == "Add(6)"
    loaded = load_model(path, tmp_path)
    assert loaded.opset == LIFT_TO_OPSET and missing_kernel(loaded.path) is None
    assert any(n.startswith(f"opset 6 -> {LIFT_TO_OPSET}: ONNX Runtime has no kernel for Add(6)") for n in loaded.notes)


def test_a_lifted_model_builds_and_computes_the_original_function(fast_recipe, tmp_path):
    result = build(_add6(tmp_path / "add6.onnx"), fast_recipe, out_dir=tmp_path / "out")
    assert result.signed_off, result.failures
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    with runtime.load(result.artifact_dir).runner() as runner:
        np.testing.assert_allclose(runner.infer({"x": x})["y"], x + np.arange(4, dtype=np.float32), rtol=1e-6)


def test_a_model_onnx_runtime_runs_keeps_its_opset(tmp_path):
    path = save(make_model([helper.make_node("Relu", ["x"], ["y"])], [value("x", TensorProto.FLOAT, [2])],
                           [value("y", TensorProto.FLOAT, [2])], opset=9), tmp_path / "relu9.onnx")
    assert lift_if_unimplemented(path, 9, tmp_path) is None
    assert load_model(path, tmp_path).opset == 9


def test_a_conversion_that_fails_is_exit_4_naming_the_op(tmp_path):
    """onnx's broadcasting adapter for Add 6 -> 7 needs fixed dims: a symbolic one stops the lift."""
    with pytest.raises(Unsupported, match=r"no kernel for Add\(6\) \(model opset 6\).*converter failed") as info:
        load_model(_add6(tmp_path / "add6n.onnx", rows="n"), tmp_path)
    assert info.value.exit_code == 4 and "\n" not in str(info.value)


def _embedding(path: Path, rows: int = 10) -> Path:
    """ids [batch, 6] int64 -> Cast -> Gather(table[rows, 4]); pos [batch, 6] -> Gather(small[3, 4], axis 0)."""
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((rows, 4)).astype(np.float32), "table")
    small = numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "small")
    return save(make_model(
        [helper.make_node("Cast", ["ids"], ["ids32"], to=TensorProto.INT32),
         helper.make_node("Gather", ["table", "ids32"], ["emb"]),
         helper.make_node("Gather", ["small", "pos"], ["pemb"]),
         helper.make_node("Add", ["emb", "pemb"], ["y"])],
        [value("ids", TensorProto.INT64, ["batch", 6]), value("pos", TensorProto.INT64, ["batch", 6])],
        [value("y", TensorProto.FLOAT, ["batch", 6, 4])], [table, small]), path)


def test_index_bounds_follow_the_index_to_its_table(tmp_path):
    import onnx

    model = onnx.load(str(_embedding(tmp_path / "emb.onnx")))
    assert index_bounds(model) == {"ids": 10, "pos": 3}
    axis1 = make_model([helper.make_node("Reshape", ["i", "shape"], ["r"]),
                        helper.make_node("Gather", ["t", "r"], ["y"], axis=-1)],
                       [value("i", TensorProto.INT64, [5]), value("t", TensorProto.FLOAT, [2, 7])],
                       [value("y", TensorProto.FLOAT, [2, 5])],
                       [numpy_helper.from_array(np.array([5], np.int64), "shape")])
    assert index_bounds(onnx.shape_inference.infer_shapes(axis1)) == {"i": 7}  # the table's last axis, through Reshape


def test_synthetic_indices_stay_inside_the_table(fast_recipe, tmp_path):
    """Drawing ids in [0, 100) from a 10-row table failed the reference run (exit 3) before."""
    result = build(_embedding(tmp_path / "emb.onnx"), fast_recipe, out_dir=tmp_path / "out")
    assert result.signed_off, result.failures


# ---- ONNX's own backend test models (shipped in the onnx wheel) ------------------------------------

# Opset 6 (lifted to 13 here: pooling, batch norm, Gemm, per-channel PRelu, Add), two ONNX Runtime runs as they are,
# and an Add fed 5.9e199 in float64 (the gate's sums of squares overflowed there).
BACKEND_MODELS = ["test_AvgPool2d", "test_BatchNorm2d_eval", "test_Linear", "test_PReLU_2d_multiparam", "test_Softsign",
                  "test_Embedding", "test_sign_model", "test_operator_add_broadcast"]


@pytest.mark.parametrize("name", BACKEND_MODELS)
def test_onnx_backend_models_build_and_reproduce_their_outputs(name, tmp_path):
    from benchmarks.onnx_backend_models import backend_models, build_one

    (folder,) = [f for f in backend_models() if f.name == name]
    row = build_one(folder, tmp_path)
    assert row.exit_code == 0 and row.reproduced == "yes", row.reason  # signed off, and its outputs are ONNX's
    artifact = next((tmp_path / "out").glob("model-fp32-*"), None)
    if row.opset < LIFT_TO_OPSET and artifact is not None:
        notes = json.loads((artifact / "build.json").read_text())["notes"]
        lifted = [n for n in notes if n.startswith(f"opset {row.opset} -> {LIFT_TO_OPSET}")]
        assert lifted or missing_kernel(folder / "model.onnx") is None
