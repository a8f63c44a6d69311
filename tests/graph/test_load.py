"""Every bad model input gets its own one-line error and exit code, before anything runs it."""

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from accel_opt.errors import InputRejected, Unsupported
from accel_opt.graph.load import load_model

from ..conftest import make_model, matmul_model, save


def _rejects(path, tmp_path, match, error=InputRejected):
    with pytest.raises(error, match=match) as info:
        load_model(path, tmp_path)
    assert "\n" not in str(info.value)
    return info.value


def test_valid_model_loads(tmp_path):
    loaded = load_model(save(matmul_model(), tmp_path / "m.onnx"), tmp_path)
    assert loaded.opset == 17
    assert [o.name for o in loaded.proto.graph.output] == ["y"]


def test_missing_file(tmp_path):
    assert _rejects(tmp_path / "nope.onnx", tmp_path, "not found").exit_code == 3


def test_directory(tmp_path):
    _rejects(tmp_path, tmp_path, "is a directory")


def test_empty_file(tmp_path):
    (tmp_path / "e.onnx").write_bytes(b"")
    _rejects(tmp_path / "e.onnx", tmp_path, "empty")


def test_random_bytes(tmp_path):
    (tmp_path / "r.onnx").write_bytes(np.random.default_rng(0).bytes(4096))
    _rejects(tmp_path / "r.onnx", tmp_path, "not a valid ONNX model")


def test_truncated_model(tmp_path):
    data = matmul_model(in_shape=("batch", 64), out_dim=64).SerializeToString()
    (tmp_path / "t.onnx").write_bytes(data[: len(data) // 2])
    _rejects(tmp_path / "t.onnx", tmp_path, "not a valid ONNX model")


def test_text_file(tmp_path):
    (tmp_path / "t.onnx").write_text("<html>404 Not Found</html>\n")
    _rejects(tmp_path / "t.onnx", tmp_path, "is text")


def test_git_lfs_pointer(tmp_path):
    (tmp_path / "p.onnx").write_text(
        "version https://git-lfs.github.com/spec/v1\noid "
        "sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 12345\n"
    )
    _rejects(tmp_path / "p.onnx", tmp_path, "Git LFS pointer")


def test_graph_failing_the_checker(tmp_path):
    bad = make_model(
        [helper.make_node("Relu", ["undefined_tensor"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    _rejects(save(bad, tmp_path / "c.onnx"), tmp_path, "checker rejected")


def test_type_error_fails_shape_inference(tmp_path):
    bad = make_model(
        [helper.make_node("Add", ["x", "i"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("i", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    _rejects(save(bad, tmp_path / "s.onnx"), tmp_path, "checker rejected|shape inference failed")


def test_unknown_domain_is_unsupported(tmp_path):
    custom = make_model(
        [helper.make_node("Frobnicate", ["x"], ["y"], domain="com.example")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        domains=["com.example"],
    )
    assert _rejects(save(custom, tmp_path / "u.onnx"), tmp_path, "unknown domain 'com.example'",
                    Unsupported).exit_code == 4


def test_a_training_only_op_is_unsupported_not_rejected(tmp_path):
    """ONNX's Gradient (ai.onnx.preview.training) is valid ONNX that no inference runtime runs: exit 4, not 3."""
    training = make_model(
        [helper.make_node("Gradient", ["x"], ["dx"], domain="ai.onnx.preview.training", xs=["x"], y="x")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("dx", TensorProto.FLOAT, [1])],
        domains=["ai.onnx.preview.training"],
    )
    error = _rejects(save(training, tmp_path / "g.onnx"), tmp_path, "'Gradient' .* is training-only", Unsupported)
    assert error.exit_code == 4


def test_embedded_engine_is_refused(tmp_path):
    model = make_model(
        [helper.make_node("EPContext", ["x"], ["y"], domain="com.microsoft", name="ctx")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        domains=["com.microsoft"],
    )
    _rejects(save(model, tmp_path / "e.onnx"), tmp_path, "compiled engine")


@pytest.mark.parametrize("nested", [False, True])
def test_an_engine_inside_a_model_local_function_is_refused(nested, tmp_path):
    """ONNX Runtime inlines model-local functions: an EPContext node in one (or in a subgraph of one) runs as well."""
    engine = helper.make_node("EPContext", ["a"], ["b"], domain="com.microsoft", name="ctx")
    if nested:  # inside an If's branch, inside the function
        branch = helper.make_graph([engine], "then", [], [helper.make_tensor_value_info("b", TensorProto.FLOAT, [1])])
        body = [helper.make_node("Constant", [], ["c"], value=helper.make_tensor("t", TensorProto.BOOL, [], [True])),
                helper.make_node("If", ["c"], ["b"], then_branch=branch, else_branch=branch)]
    else:
        body = [engine]
    function = helper.make_function("local", "wrap", ["a"], ["b"], body,
                                     [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model = make_model(
        [helper.make_node("wrap", ["x"], ["y"], domain="local", name="call")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        domains=["local", "com.microsoft"],
    )
    model.functions.append(function)
    _rejects(save(model, tmp_path / "f.onnx"), tmp_path, "ctx.*in function local::wrap embeds a compiled engine")


def _external_model(folder, location: str, offset: int = 0, length: int | None = None):
    """matmul_model with W stored externally at `location` (written by hand: onnx refuses bad paths)."""
    model = matmul_model()
    weight = model.graph.initializer[0]
    raw = numpy_helper.to_array(weight).tobytes()
    weight.ClearField("float_data")
    weight.ClearField("raw_data")
    weight.data_location = TensorProto.EXTERNAL
    entries = {"location": location, "offset": str(offset), "length": str(len(raw) if length is None else length)}
    for key, value in entries.items():
        weight.external_data.add(key=key, value=value)
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path, raw


def test_external_data_inside_folder_loads(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    path, raw = _external_model(folder, "weights.bin")
    (folder / "weights.bin").write_bytes(raw)
    loaded = load_model(path, tmp_path)
    assert loaded.external_data_files == [(folder / "weights.bin").resolve()]


@pytest.mark.parametrize("location, match", [("../secret.bin", "leaves the model folder"),
                                             ("/etc/passwd", "relative path")])
def test_external_data_outside_folder(tmp_path, location, match):
    folder = tmp_path / "m"
    folder.mkdir()
    (tmp_path / "secret.bin").write_bytes(b"\0" * 64)
    path, _ = _external_model(folder, location)
    _rejects(path, tmp_path, match)


def test_external_data_symlink_out(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (tmp_path / "secret.bin").write_bytes(b"\0" * 64)
    os.symlink(tmp_path / "secret.bin", folder / "w.bin")
    path, _ = _external_model(folder, "w.bin")
    _rejects(path, tmp_path, "link out of the model folder")


def test_external_data_missing(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    path, _ = _external_model(folder, "weights.bin")
    _rejects(path, tmp_path, "missing beside the model")


def test_external_data_offset_past_end(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    path, raw = _external_model(folder, "weights.bin", offset=1 << 40)
    (folder / "weights.bin").write_bytes(raw)
    _rejects(path, tmp_path, "exceeds")


def test_model_saved_by_onnx_with_external_data_loads(tmp_path):
    model = matmul_model(in_shape=("batch", 256), out_dim=256)
    path = tmp_path / "big.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="big.onnx.data", size_threshold=0)
    assert load_model(path, tmp_path).external_data_files


def test_unnamed_and_duplicate_nodes_get_unique_names(tmp_path):
    """ONNX node names are optional; the diagnosis, the fallback and the quantizer's exclusions refer to nodes
    by name, so every node of the build's copy is named once (the user's file is left as it is)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["b"], name="dup"),
             helper.make_node("Abs", ["b"], ["c"], name="dup"), helper.make_node("Relu", ["c"], ["y"], name="Relu_0")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    path = save(model, tmp_path / "unnamed.onnx")
    (tmp_path / "work").mkdir()
    loaded = load_model(path, tmp_path / "work")
    for proto in (loaded.proto, onnx.load(str(loaded.path))):
        names = [n.name for n in proto.graph.node]
        assert names[1:] == ["dup", "Abs_2", "Relu_0"] and names[0] not in ("", "Relu_0") and len(set(names)) == 4
    assert loaded.path != path and [n.name for n in onnx.load(str(path)).graph.node][0] == ""
    assert any("2 unnamed or duplicate-named nodes" in note for note in loaded.notes)
    for i, node in enumerate(model.graph.node):
        node.name = f"n{i}"
    named = load_model(save(model, tmp_path / "named.onnx"), tmp_path / "work")
    assert named.path == tmp_path / "named.onnx"  # nothing to rename: the file is used as given


@pytest.mark.parametrize("kind", ["sequence output", "string input"])
def test_non_numeric_inputs_and_outputs_are_unsupported(tmp_path, kind):
    """A sequence output (sklearn-onnx's ZipMap) or a string input is exit 4 with one line, not a crash later."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    if kind == "sequence output":
        nodes = [helper.make_node("SequenceConstruct", ["x"], ["seq"], name="sc")]
        inputs, outputs = [x], [helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, None)]
        match = "output 'seq' is a sequence, not a tensor.*zipmap"
    else:
        nodes = [helper.make_node("Identity", ["s"], ["o"], name="id")]
        inputs = [helper.make_tensor_value_info("s", TensorProto.STRING, [1])]
        outputs = [helper.make_tensor_value_info("o", TensorProto.STRING, [1])]
        match = "input 's' is a string tensor"
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(Unsupported, match=match):
        load_model(save(model, tmp_path / "m.onnx"), tmp_path)
