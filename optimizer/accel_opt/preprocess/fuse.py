"""Fused preprocessing: the normalize and layout steps moved into the model, as ONNX ops.

The fused model takes the host's uint8 [batch, H, W, 3] crops under the image input's name, then
Cast -> Mul (1 / (255 std)) -> Sub (mean / std) -> Transpose to NCHW (when the model is NCHW) feed the
original graph. The host keeps only decoding, resizing and cropping; 4x fewer bytes cross to the
backend, and the backend does the arithmetic. Written with onnx.helper because no maintained
library rewrites an ONNX graph's input this way (OpenVINO's PrePostProcessor does it inside
OpenVINO only, and the same file must serve every backend).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from accel_opt.errors import UsageError
from accel_opt.graph.save import save_model
from accel_opt.recipe.deployed import Preprocessing


def fused_shape(shape: list[int], layout: str) -> list[int]:
    """The uint8 HWC shape the fused input takes, from the model's own image shape."""
    return [shape[0], shape[2], shape[3], shape[1]] if layout == "NCHW" else list(shape)


def fuse_normalize(model_path: Path, input_name: str, pre: Preprocessing, out_path: Path) -> Path:
    """Write `model_path` with `input_name` taking uint8 HWC crops and normalizing them in the graph."""
    model = onnx.load(str(model_path))
    graph = model.graph
    original = next((v for v in graph.input if v.name == input_name), None)
    if original is None or len(original.type.tensor_type.shape.dim) != 4:
        raise UsageError(f"preprocessing.fused needs a rank-4 image input {input_name!r}")
    elem = original.type.tensor_type.elem_type
    if elem not in (TensorProto.FLOAT, TensorProto.FLOAT16):
        raise UsageError(f"preprocessing.fused: input {input_name!r} is not a float image")
    inner = f"{input_name}__normalized"
    for node in graph.node:
        node.input[:] = [inner if name == input_name else name for name in node.input]
    dims = list(original.type.tensor_type.shape.dim)
    hwc = [dims[0], dims[2], dims[3], dims[1]] if pre.layout == "NCHW" else dims
    new_input = helper.make_tensor_value_info(input_name, TensorProto.UINT8, None)
    new_dims = new_input.type.tensor_type.shape.dim
    for dim in hwc:
        new_dims.add().CopyFrom(dim)
    std, mean = np.asarray(pre.std, np.float32), np.asarray(pre.mean, np.float32)
    scale = numpy_helper.from_array((1.0 / (255.0 * std)).astype(np.float32), f"{inner}_scale")
    offset = numpy_helper.from_array((mean / std).astype(np.float32), f"{inner}_offset")
    nodes = [helper.make_node("Cast", [input_name], [f"{inner}_f"], to=TensorProto.FLOAT, name=f"{inner}_cast"),
             helper.make_node("Mul", [f"{inner}_f", scale.name], [f"{inner}_scaled"], name=f"{inner}_mul"),
             helper.make_node("Sub", [f"{inner}_scaled", offset.name], [f"{inner}_hwc"], name=f"{inner}_sub")]
    last = f"{inner}_hwc"
    if pre.layout == "NCHW":
        nodes.append(helper.make_node("Transpose", [last], [f"{inner}_chw"], perm=[0, 3, 1, 2],
                                      name=f"{inner}_transpose"))
        last = f"{inner}_chw"
    if elem == TensorProto.FLOAT16:
        nodes.append(helper.make_node("Cast", [last], [f"{inner}_f16"], to=TensorProto.FLOAT16, name=f"{inner}_cast16"))
        last = nodes[-1].output[0]
    nodes.append(helper.make_node("Identity", [last], [inner], name=f"{inner}_out"))
    graph.initializer.extend([scale, offset])
    kept = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + kept)
    inputs = [new_input if v.name == input_name else v for v in graph.input]
    del graph.input[:]
    graph.input.extend(inputs)
    save_model(model, out_path)
    onnx.checker.check_model(str(out_path))
    return out_path
