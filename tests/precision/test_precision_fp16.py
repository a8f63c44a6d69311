"""fp16 / bf16 graph transforms on small real models, checked with real ONNX Runtime sessions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import accel_opt.graph.save
from accel_opt import zoo
from accel_opt.backends.onnxruntime.backend import CPU_PROVIDER, create_session
from accel_opt.graph.inspect import opset_of
from accel_opt.precision.fp16 import convert_float
from accel_opt.recipe.stages import PrecisionConfig
from accel_opt.recipe.types import Precision

from ..conftest import save


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def small_resnet(tmp_path_factory) -> Path:
    model = zoo.resnet(layout=(1, 1), width=8, num_classes=10, image_size=32)
    return zoo.save(model, tmp_path_factory.mktemp("fp16") / "resnet.onnx")


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((4, 3, 32, 32)).astype(np.float32)


def _run(path: Path, feed: dict[str, np.ndarray]) -> np.ndarray:
    return create_session(path, [CPU_PROVIDER], threads=1).run(None, feed)[0]


def _init_types(path: Path) -> dict[str, int]:
    return {t.name: t.data_type for t in onnx.load(str(path)).graph.initializer}


def test_fp16_retypes_weights_keeps_block_list_fp32_and_stays_close(small_resnet, images, tmp_path):
    options = PrecisionConfig(block_ops=[*PrecisionConfig().block_ops, "GlobalAveragePool"])
    out = tmp_path / "fp16.onnx"
    report = convert_float(small_resnet, Precision.fp16, options, out)

    model = onnx.load(str(out))
    conv_weights = [n.input[1] for n in model.graph.node if n.op_type == "Conv"]
    assert {_init_types(out)[w] for w in conv_weights} == {TensorProto.FLOAT16}
    # Graph I/O stays float32 (keep_io_types), the blocked pooling reads a float32 Cast.
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert model.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    gap = next(n for n in model.graph.node if n.op_type == "GlobalAveragePool")
    producer = next(n for n in model.graph.node if gap.input[0] in n.output)
    assert producer.op_type == "Cast" and producer.attribute[0].i == TensorProto.FLOAT
    kept = {k.op_type: k for k in report.kept_in_higher_precision}
    assert "GlobalAveragePool" in kept and "block list" in kept["GlobalAveragePool"].reason
    assert "Conv" not in kept
    assert (report.opset_before, report.opset_after) == (17, 17)

    reference, candidate = _run(small_resnet, {"image": images}), _run(out, {"image": images})
    assert candidate.dtype == np.float32
    np.testing.assert_allclose(candidate, reference, rtol=2e-2, atol=2e-2)
    assert _cosine(candidate, reference) > 0.9999


def test_fp16_node_block_list_keeps_that_nodes_weights_fp32(small_resnet, tmp_path):
    first_conv = next(n for n in onnx.load(str(small_resnet)).graph.node if n.op_type == "Conv")
    out = tmp_path / "fp16.onnx"
    report = convert_float(small_resnet, Precision.fp16, PrecisionConfig(block_nodes=[first_conv.name]), out)
    assert _init_types(out)[first_conv.input[1]] == TensorProto.FLOAT
    kept = {k.node: k.reason for k in report.kept_in_higher_precision}
    assert kept[first_conv.name] == "node in block list (recipe block_nodes)"


def test_fp16_without_keep_io_types_takes_float16_inputs(small_resnet, images, tmp_path):
    out = tmp_path / "fp16_io.onnx"
    report = convert_float(small_resnet, Precision.fp16, PrecisionConfig(keep_io_types=False), out)
    assert not report.keep_io_types
    assert onnx.load(str(out)).graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    result = _run(out, {"image": images.astype(np.float16)})
    assert result.dtype == np.float16
    assert _cosine(result, _run(small_resnet, {"image": images})) > 0.999


def test_fp16_large_model_is_saved_with_external_data(small_resnet, images, tmp_path, monkeypatch):
    # Input with external data (loaded by path); output past the threshold written the same way.
    source_dir = tmp_path / "src"
    source_dir.mkdir()
    onnx.save_model(onnx.load(str(small_resnet)), str(source_dir / "m.onnx"), save_as_external_data=True,
                    location="m.onnx.data", size_threshold=0)
    monkeypatch.setattr(accel_opt.graph.save, "EXTERNAL_DATA_ABOVE_BYTES", 0)
    out = tmp_path / "out" / "fp16.onnx"
    convert_float(source_dir / "m.onnx", Precision.fp16, PrecisionConfig(), out)
    assert (out.parent / "fp16.onnx.data").stat().st_size > 0
    assert _cosine(_run(out, {"image": images}), _run(small_resnet, {"image": images})) > 0.9999


def test_bf16_upgrades_opset_for_conv_and_matches_fp32(small_resnet, images, tmp_path):
    out = tmp_path / "bf16.onnx"
    report = convert_float(small_resnet, Precision.bf16, PrecisionConfig(), out)
    onnx.checker.check_model(str(out), full_check=True)
    model = onnx.load(str(out))
    assert report.opset_before == 17 and report.opset_after >= 22
    assert opset_of(model) >= 22
    assert {t.data_type for t in model.graph.initializer} == {TensorProto.BFLOAT16}
    assert any("opset 17 -> 22" in note for note in report.notes)
    # ORT's CPU EP has no bf16 kernels; ONNX's reference evaluator runs the graph as written.
    result = ReferenceEvaluator(model).run(None, {"image": images})[0]
    assert _cosine(np.asarray(result, np.float32), _run(small_resnet, {"image": images})) > 0.999


def test_bf16_keeps_opset_when_ops_allow_it_and_blocks_softmax(tmp_path):
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
         helper.make_node("Softmax", ["h"], ["y"], name="sm")],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [weight],
    )
    source = tmp_path / "mlp.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(source))
    out = tmp_path / "mlp_bf16.onnx"
    report = convert_float(source, Precision.bf16, PrecisionConfig(), out)
    assert report.opset_after == 17  # MatMul admits bfloat16 since opset 13: no upgrade
    assert _init_types(out)["W"] == TensorProto.BFLOAT16
    kept = {k.op_type: k.reason for k in report.kept_in_higher_precision}
    assert "exp()" in kept["Softmax"]
    x = rng.standard_normal((3, 16)).astype(np.float32)
    result = np.asarray(ReferenceEvaluator(str(out)).run(None, {"x": x})[0], np.float32)
    np.testing.assert_allclose(result, _run(source, {"x": x}), atol=2e-2)


@pytest.mark.parametrize("precision", [Precision.fp16, Precision.bf16])
def test_initializer_type_declarations_do_not_break_blocked_ops(precision, tmp_path):
    # torch's exporter declares initializers in value_info; the converter retyped that declaration to
    # float16 while the LayerNorm weight stayed float32 for the blocked op: an invalid model (MiniLM).
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "W"),
        numpy_helper.from_array(np.ones(8, np.float32), "ln.weight"),
        numpy_helper.from_array(np.zeros(8, np.float32), "ln.bias"),
    ]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
         helper.make_node("LayerNormalization", ["h", "ln.weight", "ln.bias"], ["y"], name="ln")],
        "block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        inits,
        value_info=[helper.make_tensor_value_info("ln.weight", TensorProto.FLOAT, [8])],
    )
    source = tmp_path / "ln.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(source))
    out = tmp_path / f"ln_{precision.value}.onnx"
    report = convert_float(source, precision, PrecisionConfig(), out)
    assert _init_types(out)["ln.weight"] == TensorProto.FLOAT
    assert [k.op_type for k in report.kept_in_higher_precision] == ["LayerNormalization"]
    x = rng.standard_normal((2, 8)).astype(np.float32)
    result = np.asarray(ReferenceEvaluator(str(out)).run(None, {"x": x})[0], np.float32)
    np.testing.assert_allclose(result, _run(source, {"x": x}), atol=5e-2)


def test_an_input_echoed_as_an_output_converts(tmp_path):
    """A graph output that is a graph input (echoed back) made the converter emit a Cast no order can place."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    r = helper.make_tensor_value_info("r", TensorProto.FLOAT, ["batch", 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"], name="relu")], "echo", [x], [r, x])
    path = save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "echo.onnx")
    convert_float(path, Precision.fp16, PrecisionConfig(), tmp_path / "echo16.onnx")
    converted = onnx.load(str(tmp_path / "echo16.onnx"))
    assert [o.name for o in converted.graph.output] == ["r", "x"]
    assert all(o.type.tensor_type.elem_type == TensorProto.FLOAT for o in converted.graph.output)  # keep_io_types
