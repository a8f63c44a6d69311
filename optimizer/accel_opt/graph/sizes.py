"""The memory a model declares before it runs: its weights, the tensors its constant-shape nodes allocate
(ConstantOfShape, Expand, Tile), and every value's shape at the build's input shapes (ONNX shape inference).

A 156-byte model can ask ConstantOfShape for 80000 x 80000 float32 (25.6 GB): run as is, the runtime fails to allocate
(or the OOM killer ends the process) and that reads as a broken model. Estimated first, it is refused with its size
(exit 5) before anything runs it. A lower bound of what a run takes: the largest single tensor, and the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

# Shape inference copies the model: skipped for models whose protobuf (weights embedded) is larger than this.
INFERENCE_MAX_PROTO_BYTES = 256 << 20


@dataclass(frozen=True)
class Declared:
    bytes: int
    what: str  # "tensor 'y' of node 'big' (ConstantOfShape): [80000, 80000] float32"


def _itemsize(elem_type: int) -> int:
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize
    except (KeyError, TypeError, ValueError):
        return 4


def _type_name(elem_type: int) -> str:
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name
    except (KeyError, TypeError, ValueError):
        return "elements"


def weights(proto: onnx.ModelProto) -> Declared:
    """Every initializer's size together (external data included, from its dims)."""
    total = sum(math.prod(t.dims) * _itemsize(t.data_type) for t in proto.graph.initializer)
    return Declared(total, f"{len(proto.graph.initializer)} weight tensors")


def largest_tensor(proto: onnx.ModelProto, shapes: dict[str, list[int]]) -> Declared | None:
    """The largest tensor the model declares at these input `shapes` (None: no shape known)."""
    found = [*_constant_shape_nodes(proto), *_inferred(proto, shapes)]
    found += [Declared(math.prod(t.dims) * _itemsize(t.data_type), f"weight {t.name!r}: {list(t.dims)} "
              f"{_type_name(t.data_type)}") for t in proto.graph.initializer]
    return max(found, key=lambda d: d.bytes, default=None)


def _constants(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Small integer tensors known before running: initializers and Constant nodes (the shapes nodes are given)."""
    found = {t.name: t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.INT64
             and math.prod(t.dims) <= 16}
    for node in proto.graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attr in node.attribute:
                if attr.name == "value" and attr.t.data_type == onnx.TensorProto.INT64:
                    found[node.output[0]] = attr.t
    values = {}
    for name, tensor in found.items():
        try:
            values[name] = numpy_helper.to_array(tensor).astype(np.int64).reshape(-1)
        except (ValueError, TypeError):  # external data not loaded
            continue
    return values


def _constant_shape_nodes(proto: onnx.ModelProto) -> list[Declared]:
    """What ConstantOfShape, Expand and Tile allocate when their shape input is a constant (Expand: at least that
    shape; Tile: the repeats times the input, counted as the repeats alone when the input's size is unknown)."""
    constants, found = _constants(proto), []
    for node in proto.graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("ConstantOfShape", "Expand", "Tile"):
            continue
        shape_input = (node.input[0] if node.op_type == "ConstantOfShape"
                       else node.input[1] if len(node.input) > 1 else "")
        dims = constants.get(shape_input)
        if dims is None or (dims < 0).any():
            continue
        itemsize, type_name = 4, "float32"
        for attr in node.attribute:
            if node.op_type == "ConstantOfShape" and attr.name == "value":
                itemsize, type_name = _itemsize(attr.t.data_type), _type_name(attr.t.data_type)
        size = math.prod(int(d) for d in dims) * itemsize
        found.append(Declared(size, f"tensor {node.output[0]!r} of node {node.name!r} ({node.op_type}): "
                                    f"{[int(d) for d in dims]} {type_name}"))
    return found


def _inferred(proto: onnx.ModelProto, shapes: dict[str, list[int]]) -> list[Declared]:
    """Every value's size that ONNX shape inference gives at the input `shapes`."""
    if proto.ByteSize() > INFERENCE_MAX_PROTO_BYTES:
        return []
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    for value in model.graph.input:
        if value.name in shapes:
            dims = value.type.tensor_type.shape.dim
            for dim, size in zip(dims, shapes[value.name]):
                dim.Clear()
                dim.dim_value = int(size)
    found: list[Declared] = []
    # ONNX's data propagation (shapes computed from Shape, Gather, Concat...) first; where it leaves a value's shape
    # unknown, ONNX Runtime's symbolic shape inference too, which also folds constants of other types (a float tensor
    # cast to int64 before ConstantOfShape: 229 bytes asking for 25.6 GB, which ONNX's alone misses). A model ONNX's
    # inference resolves whole (most) pays for one pass.
    for infer in (lambda m: onnx.shape_inference.infer_shapes(m, data_prop=True), _symbolic):
        try:
            inferred = infer(model)
        except Exception:  # noqa: BLE001 - inference is an estimate: a model it cannot follow is judged by the rest
            continue
        if inferred is None:  # ONNX Runtime's gives up on some models (None)
            continue
        resolved = set()
        for value in [*inferred.graph.value_info, *inferred.graph.output]:
            tensor = value.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
            if not tensor.HasField("shape") or None in dims:
                continue
            resolved.add(value.name)
            found.append(Declared(math.prod(dims) * _itemsize(tensor.elem_type),
                                  f"tensor {value.name!r}: {dims} {_type_name(tensor.elem_type)}"))
        if all(name in resolved for node in model.graph.node for name in node.output if name):
            break
    return found


def _symbolic(model: onnx.ModelProto) -> onnx.ModelProto:
    import logging

    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    logging.getLogger("onnxruntime.tools.symbolic_shape_infer").setLevel(logging.ERROR)  # its warnings are not ours
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return SymbolicShapeInference.infer_shapes(copy, auto_merge=True)
