"""The quantized layers of a Q/DQ graph beside the float layers they were quantized from: what bias correction,
AdaRound and the bias fit work on. ONNX Runtime's quantizer keeps node names, so a layer is found in both graphs by its
name. Also the cache of what AdaRound and the bias fit learn, by initializer name, for the builds that reuse it."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from accel_opt.files import made_bytes, mark_made

WEIGHTED_OPS = ("Conv", "Gemm")


def dequantized(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> np.ndarray | None:
    """The float value a DequantizeLinear node makes of its initializer (None: its input is not an initializer)."""
    if any(name not in initializers for name in node.input):
        return None
    values, scale, *zero = (numpy_helper.to_array(initializers[name]).astype(np.float64) for name in node.input)
    zero_point = zero[0] if zero else np.zeros_like(scale)
    return (values - broadcast_along(zero_point, node, values.ndim)) * broadcast_along(scale, node, values.ndim)


def broadcast_along(per_channel: np.ndarray, dequantize: onnx.NodeProto, ndim: int) -> np.ndarray:
    """A DequantizeLinear's scale or zero point shaped to broadcast over its `ndim`-dimensional input: per channel
    along its `axis` (1 by default), or as it is (per tensor)."""
    if per_channel.ndim != 1 or per_channel.size == 1:
        return per_channel
    axis = next((a.i for a in dequantize.attribute if a.name == "axis"), 1)
    shape = [1] * ndim
    shape[axis] = -1
    return per_channel.reshape(shape)


@dataclass
class QuantizedLayer:
    original: onnx.NodeProto  # in the float graph
    node: onnx.NodeProto  # in the Q/DQ graph
    weight_dq: onnx.NodeProto  # the DequantizeLinear of its integer weights (an initializer)
    float_weight: np.ndarray


def quantized_layers(float_model: onnx.ModelProto, quantized: onnx.ModelProto) -> Iterator[QuantizedLayer]:
    """Each Conv/Gemm of `quantized` whose weights are an integer initializer through a DequantizeLinear, with the
    float layer of the same name (graph order); layers left in float or with computed weights are not among them."""
    float_nodes = {n.name: n for n in float_model.graph.node if n.op_type in WEIGHTED_OPS and n.name}
    float_weights = {i.name: i for i in float_model.graph.initializer}
    q_inits = {i.name for i in quantized.graph.initializer}
    producer = {out: n for n in quantized.graph.node for out in n.output}
    for node in quantized.graph.node:
        original = float_nodes.get(node.name)
        if node.op_type not in WEIGHTED_OPS or original is None or len(node.input) < 2 or len(original.input) < 2:
            continue
        weight_dq = producer.get(node.input[1])
        if not (weight_dq and weight_dq.op_type == "DequantizeLinear" and set(weight_dq.input) <= q_inits):
            continue
        weight = float_weights.get(original.input[1])
        if weight is not None:
            yield QuantizedLayer(original, node, weight_dq, numpy_helper.to_array(weight))


def int8_weight_range(reduce_range: bool) -> tuple[int, int]:
    """The integers every preset's symmetric int8 weights span, as ONNX Runtime's quantizer rounds them: 7-bit where
    `reduce_range`."""
    from onnxruntime.quantization.quant_utils import get_qmin_qmax_for_qType

    low, high = get_qmin_qmax_for_qType(onnx.TensorProto.INT8, reduce_range, symmetric=True)
    return int(low), int(high)


def _save_tensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Keep initializer values by name in one .npz (the names apart: an initializer's name need not be a valid key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, names=np.array(list(tensors)), **{f"w{i}": values for i, values in enumerate(tensors.values())})
    mark_made(path)


def _restore_tensors(data: bytes, initializers: dict[str, onnx.TensorProto]) -> tuple[int, int]:
    """Write the values kept in `data` (an .npz's bytes) into the initializers of the same name, shape and type (a
    graph with fewer layers quantized has fewer of them): (how many were written, how many were kept)."""
    with np.load(io.BytesIO(data), allow_pickle=False) as stored:
        kept = dict(zip(stored["names"].tolist(), (stored[f"w{i}"] for i in range(len(stored["names"])))))
    written = 0
    for name, values in kept.items():
        target = initializers.get(name)
        if target is not None and tuple(target.dims) == values.shape and \
                target.data_type == helper.np_dtype_to_tensor_dtype(values.dtype):
            target.CopyFrom(numpy_helper.from_array(values, name))
            written += 1
    return written, len(kept)


def learned_in_place(quantized_path: Path, cache: Path | None,
                     learn: Callable[[onnx.ModelProto], tuple[dict[str, np.ndarray], str]],
                     reused: Callable[[int, int], str]) -> str:
    """Change the Q/DQ graph at `quantized_path` in place with what a remedy learned: the tensors kept at `cache`
    (.npz) where it exists (learned once, on the graph with every layer quantized: a build that keeps some layers in
    float reuses them for the layers still quantized; `reused(written, kept)` says so), else what `learn(graph)`
    writes into the graph, then kept there. Returns the line for the build's notes."""
    quantized = onnx.load(str(quantized_path))
    kept = made_bytes(cache) if cache is not None else None  # only what this user's build learned (files.made_bytes)
    if kept is not None:
        note = reused(*_restore_tensors(kept, {i.name: i for i in quantized.graph.initializer}))
    else:
        written, note = learn(quantized)
        if cache is not None:
            _save_tensors(cache, written)
    onnx.save(quantized, str(quantized_path))
    return note
