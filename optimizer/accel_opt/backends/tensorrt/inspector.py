"""What a built TensorRT engine runs, read from its inspector JSON, checked against the ONNX graph.

`IEngineInspector.get_engine_information(LayerInformationFormat.JSON)` of an engine built with
ProfilingVerbosity.DETAILED gives {"Layers": [{"Name", "LayerType", "Inputs": [...], "Outputs": [...],
...}], ...}; each tensor has "Name", "Dimensions" and, in TensorRT 10, "Format/Datatype", a phrase like
"Row major linear FP32", "Channel major FP16 format where channel % 8 == 0" or "Thirty-two wide
channel vectorized row major Int8 format" (TensorRT's engine explorer reads the data type from the
same words). TensorRT 11 replaced "Bindings" with "I/O Tensors" and NVIDIA's migration notes (11.0)
say the Format/DataType field was split; the layout of the split layer fields is not confirmed here
(no GPU), so a separate "DataType"/"Datatype" field is read first, then "Format/Datatype", then "Format".

A strongly typed network runs each tensor in the type the graph gives it. The check here catches
what would break that promise: a tensor the graph types float16 running as FP32, a reformat that
widens a tensor, a quantized op left in float.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any

# Data type words in TensorRT's format phrases and kgen (Myelin) type names -> numpy-style names.
DTYPE_WORDS = {
    "fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bfloat16": "bfloat16",
    "bf16": "bfloat16", "fp8": "float8", "int8": "int8", "uint8": "uint8", "int4": "int4", "fp4": "float4",
    "int32": "int32", "int64": "int64", "bool": "bool", "double": "float64",
}
# Bits of the types a precision change can widen; integer index types (int32/int64/bool) are not compared.
BITS = {"float64": 64, "float32": 32, "float16": 16, "bfloat16": 16, "float8": 8, "int8": 8, "uint8": 8,
        "int4": 4, "float4": 4}
COMPUTE_LAYER = re.compile(r"conv|matrixmultiply|gemm|fullyconnected", re.IGNORECASE)
WORD = re.compile(r"[A-Za-z0-9]+")


@dataclass(frozen=True)
class LayerPrecision:
    layer: str
    layer_type: str
    problem: str  # one line: which tensor runs in what, and what the graph asks for


def tensor_dtype(tensor: dict[str, Any]) -> str | None:
    """The data type of one inspector tensor entry, or None when its description names none."""
    for key in ("DataType", "Datatype", "Format/Datatype", "Format"):
        text = tensor.get(key)
        if isinstance(text, str):
            for word in WORD.findall(text):
                dtype = DTYPE_WORDS.get(word.lower())
                if dtype:
                    return dtype
    return None


def engine_layers(info: str | dict[str, Any]) -> list[dict[str, Any]]:
    """The "Layers" of an engine-information JSON (a string or parsed); ValueError when they carry no
    tensors (an engine not built with ProfilingVerbosity.DETAILED lists layer names only)."""
    data = json.loads(info) if isinstance(info, str) else info
    layers = data.get("Layers") if isinstance(data, dict) else data
    if not isinstance(layers, list) or not all(isinstance(layer, dict) for layer in layers):
        raise ValueError("engine information lists no layer details (build with ProfilingVerbosity.DETAILED)")
    return layers


def wider_layers(info: str | dict[str, Any], graph_dtypes: dict[str, str], quantized: bool = False,
                 dequantized: frozenset[str] = frozenset()) -> list[LayerPrecision]:
    """Layers that run wider than the graph asks, in engine order.

    `graph_dtypes`: tensor name -> dtype in the ONNX graph (inputs, outputs, value_info, initializers).
    A tensor TensorRT made (a reformat's output) takes the type the graph gives the tensor it copies.
    `quantized`: the graph has Q/DQ nodes; then a compute layer fed a DequantizeLinear output
    (`dequantized`, by tensor name) in float means TensorRT did not fuse the Q/DQ pair, and an engine
    with no int8 tensor at all ran none of the quantization.
    """
    expected = dict(graph_dtypes)
    problems: list[LayerPrecision] = []
    any_int8 = False
    for layer in engine_layers(info):
        name, kind = str(layer.get("Name", "?")), str(layer.get("LayerType", "?"))
        inputs, outputs = layer.get("Inputs") or [], layer.get("Outputs") or []
        if kind == "Reformat" and len(inputs) == 1 and len(outputs) == 1 and inputs[0].get("Name") in expected:
            expected.setdefault(outputs[0].get("Name"), expected[inputs[0]["Name"]])
        found = []
        for tensor in [*inputs, *outputs]:
            ran, want = tensor_dtype(tensor), expected.get(tensor.get("Name"))
            any_int8 |= ran in ("int8", "int4", "float8", "float4")
            if ran in BITS and want in BITS and BITS[ran] > BITS[want]:
                found.append(f"{tensor.get('Name')} runs {ran}, the graph asks {want}")
        if quantized and COMPUTE_LAYER.search(kind):
            found += [f"{t.get('Name')} is dequantized but the layer runs {tensor_dtype(t)} (Q/DQ not fused)"
                      for t in inputs if t.get("Name") in dequantized
                      and tensor_dtype(t) in ("float32", "float16", "bfloat16")]
        if found:
            problems.append(LayerPrecision(name, kind, "; ".join(found)))
    if quantized and not any_int8:
        problems.append(LayerPrecision("(engine)", "-", "no layer runs int8: TensorRT ignored the Q/DQ nodes"))
    return problems


def precision_counts(info: str | dict[str, Any]) -> dict[str, int]:
    """{dtype: layers whose first input runs in it}: a summary for the resource config."""
    counts: dict[str, int] = {}
    for layer in engine_layers(info):
        inputs = layer.get("Inputs") or []
        dtype = (tensor_dtype(inputs[0]) if inputs else None) or "none"
        counts[dtype] = counts.get(dtype, 0) + 1
    return dict(sorted(counts.items()))


def graph_tensor_dtypes(onnx_path) -> tuple[dict[str, str], frozenset[str], bool]:
    """(tensor name -> dtype, DequantizeLinear outputs, has Q/DQ) of an ONNX graph, after shape inference."""
    import onnx
    from onnx import helper

    model = onnx.load(str(onnx_path), load_external_data=False)
    with contextlib.suppress(Exception):  # best effort: the declared types count without it
        model = onnx.shape_inference.infer_shapes(model)
    graph = model.graph

    def name_of(elem_type: int) -> str | None:
        if elem_type == onnx.TensorProto.BFLOAT16:
            return "bfloat16"
        try:
            name = str(helper.tensor_dtype_to_np_dtype(elem_type))
        except (KeyError, TypeError, ValueError):
            return None
        return next((short for short in ("float8", "float4",
                                         "int4") if name.startswith(short) or name == f"u{short}"), name)

    dtypes: dict[str, str] = {}
    for value in [*graph.input, *graph.output, *graph.value_info]:
        dtype = name_of(value.type.tensor_type.elem_type) if value.type.tensor_type.elem_type else None
        if dtype:
            dtypes[value.name] = dtype
    for init in graph.initializer:
        dtype = name_of(init.data_type)
        if dtype:
            dtypes.setdefault(init.name, dtype)
    dequantized = frozenset(out for node in graph.node if node.op_type == "DequantizeLinear" for out in node.output)
    quantized = any(node.op_type == "QuantizeLinear" for node in graph.node)
    return dtypes, dequantized, quantized
