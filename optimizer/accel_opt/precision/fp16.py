"""fp16 / bf16 as a graph transform: float tensors retyped, a block list kept in fp32.

fp16 uses ONNX Runtime's converter (onnxruntime.transformers.float16), the maintained one. bf16
has no maintained ONNX converter, so it is derived here from the fp16 result by retyping float16
to bfloat16 (see `_retype_bf16`). ONNX admits bfloat16 on Conv/MaxPool/GlobalAveragePool only
from opset 22, so bf16 upgrades the opset first when the graph needs it.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, external_data_helper, numpy_helper

from accel_opt.errors import Unsupported, first_line
from accel_opt.graph.inspect import opset_of
from accel_opt.graph.save import save_model, upgrade_opset
from accel_opt.precision.report import KeptNode, PrecisionReport
from accel_opt.recipe.stages import PrecisionConfig
from accel_opt.recipe.types import Precision

log = logging.getLogger(__name__)

# Why each overflow- or precision-prone op type of the recipe's block list stays in fp32.
_BLOCK_REASONS = {
    "LayerNormalization": "normalization: the variance of large activations overflows fp16 (max 65504)",
    "InstanceNormalization": "normalization: the variance of large activations overflows fp16 (max 65504)",
    "GroupNormalization": "normalization: the variance of large activations overflows fp16 (max 65504)",
    "Softmax": "exponential: exp() overflows fp16 above ~11",
    "LogSoftmax": "exponential: exp() overflows fp16 above ~11",
    "Exp": "exponential: exp() overflows fp16 above ~11",
    "Pow": "power: squares of activations overflow fp16",
    "ReduceSumSquare": "overflow-prone reduction: sum of squares",
    "ReduceL2": "overflow-prone reduction: sum of squares",
    "ReduceLogSumExp": "overflow-prone reduction: sum of exponentials",
    "ReduceMean": "long reduction: fp16 accumulation loses precision",
    "ReduceSum": "overflow-prone reduction: long sums",
    "CumSum": "overflow-prone reduction: running sums",
    "Resize": "coordinate arithmetic needs fp32 (fp16 misplaces pixels on large images)",
    "Range": "index arithmetic: fp16 holds integers exactly only up to 2048",
}


def convert_float(model_path: Path, precision: Precision, options: PrecisionConfig, out_path: Path) -> PrecisionReport:
    """Write the fp16 or bf16 version of `model_path` to `out_path`, validated; report what stayed fp32."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    if precision not in (Precision.fp16, Precision.bf16):
        raise ValueError(f"convert_float handles fp16/bf16, not {precision.value}")
    start = time.perf_counter()
    model_path, out_path = Path(model_path), Path(out_path)
    skeleton = onnx.load(str(model_path), load_external_data=False)
    opset_before = opset_of(skeleton)
    notes: list[str] = []
    # Our block list adds overflow-prone ops; the converter's default list (ops with no float16
    # kernels: TopK, NonMaxSuppression, ML ops...) must stay, since passing a list replaces it.
    block_ops = set(options.block_ops) | set(DEFAULT_OP_BLOCK_LIST)
    reasons = {op: f"op type in block list: {_BLOCK_REASONS.get(op, 'recipe block_ops')}" for op in options.block_ops}
    for op in set(DEFAULT_OP_BLOCK_LIST) - set(options.block_ops):
        reasons[op] = "op type in ONNX Runtime's converter default block list (no or unreliable float16 kernels)"

    with tempfile.TemporaryDirectory(prefix="accel-opt-float-") as tmp_name:
        tmp = Path(tmp_name)
        source = model_path
        if precision is Precision.bf16:
            no_bf16 = _ops_without_bf16(skeleton) - block_ops
            for op in sorted(no_bf16):
                reasons[op] = "ONNX defines no bfloat16 version of this op"
            block_ops |= no_bf16
            target = _bf16_opset(skeleton, block_ops, set(options.block_nodes))
            if target > opset_before:
                source = upgrade_opset(model_path, target, tmp / "upgraded.onnx", "bf16")
                notes.append(f"opset {opset_before} -> {target}: ONNX admits bfloat16 on Conv/pooling only from opset "
                             "22")
        model = _load_with_shapes(source, tmp)
        original = {t.name: t for t in model.graph.initializer} if precision is Precision.bf16 else {}
        original_floats = {name: numpy_helper.to_array(t) for name,
                           t in original.items() if t.data_type == TensorProto.FLOAT}
        echoed = _detach_echoed_outputs(model)
        converted = convert_float_to_float16(
            model,
            keep_io_types=options.keep_io_types,
            disable_shape_infer=True,  # done above, by path (works past 2 GB)
            op_block_list=sorted(block_ops),
            node_block_list=list(options.block_nodes),
        )
        _reattach_echoed_outputs(converted, echoed)
        if precision is Precision.bf16:
            _retype_bf16(converted, original_floats)
        _topological_sort(converted.graph)
        save_model(converted, out_path)
        validate(out_path, run_session=precision is Precision.fp16, tmp=tmp)
        kept = _kept_nodes(out_path, tmp, reasons, set(options.block_nodes))

    low = "float16" if precision is Precision.fp16 else "bfloat16"
    return PrecisionReport(
        precision=precision,
        transform=f"float tensors retyped to {low} (ONNX Runtime float16 converter"
        + (", then float16 -> bfloat16 retyping)" if precision is Precision.bf16 else ")")
        + (", graph inputs/outputs kept float32" if options.keep_io_types else ""),
        opset_before=opset_before,
        opset_after=opset_of(onnx.load(str(out_path), load_external_data=False)),
        keep_io_types=options.keep_io_types,
        kept_in_higher_precision=kept,
        seconds=time.perf_counter() - start,
        notes=notes,
    )


def validate(path: Path, run_session: bool, tmp: Path) -> None:
    """onnx.checker by path, strict shape inference, and (when ORT CPU can run it) a session load."""
    try:
        onnx.checker.check_model(str(path))
        onnx.shape_inference.infer_shapes_path(str(path), str(tmp / "validated.onnx"), check_type=True,
                                               strict_mode=True)
    except Exception as exc:  # ValidationError, InferenceError, or C++ errors as RuntimeError
        raise Unsupported(f"the transformed model is not valid ONNX ({path.name}): {first_line(exc)}") from None
    finally:
        (tmp / "validated.onnx").unlink(missing_ok=True)
    if run_session:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        try:
            ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - ORT's own error types: the input was valid, the conversion is not
            raise Unsupported(f"the float16 converter wrote a model ONNX Runtime refuses ({path.name}; the subgraphs "
                              f"of If/Loop/Scan nodes are a known case): {first_line(exc)}") from None


def _detach_echoed_outputs(model: onnx.ModelProto) -> list[tuple[int, str]]:
    """Take out the graph outputs that are graph inputs (an input echoed back): the converter wires a Cast
    for each that no topological order can place. Returns their positions and names."""
    inputs = {i.name for i in model.graph.input}
    echoed = [(index, o.name) for index, o in enumerate(model.graph.output) if o.name in inputs]
    for index, _ in reversed(echoed):
        del model.graph.output[index]
    return echoed


def _reattach_echoed_outputs(model: onnx.ModelProto, echoed: list[tuple[int, str]]) -> None:
    """Put them back where they were, typed as the (converted) graph input they echo."""
    inputs = {i.name: i for i in model.graph.input}
    for index, name in echoed:
        value = onnx.ValueInfoProto()
        value.CopyFrom(inputs[name])
        model.graph.output.insert(index, value)


def _load_with_shapes(source: Path, tmp: Path) -> onnx.ModelProto:
    inferred = tmp / "inferred.onnx"
    onnx.shape_inference.infer_shapes_path(str(source), str(inferred))
    model = onnx.load(str(inferred), load_external_data=False)
    external_data_helper.load_external_data_for_model(model, str(source.parent))
    # Type declarations of initializers (torch's exporter writes value_info for them; old models list
    # them as inputs) get retyped to float16 by the converter even when the initializer itself stays
    # float32 for a blocked node: an invalid model. The initializer carries its own type: drop them.
    weights = {t.name for t in model.graph.initializer}
    kept_info = [v for v in model.graph.value_info if v.name not in weights]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept_info)
    if model.ir_version >= 4:  # initializers need not be graph inputs since IR 4
        kept_inputs = [v for v in model.graph.input if v.name not in weights]
        del model.graph.input[:]
        model.graph.input.extend(kept_inputs)
    return model


def _allows_bf16(op_type: str, opset: int) -> bool | None:
    try:
        schema = onnx.defs.get_schema(op_type, opset)
    except onnx.defs.SchemaError:
        return None
    types = [set(c.allowed_type_strs) for c in schema.type_constraints]
    if not any("tensor(float)" in t for t in types):
        return None  # not a float op: nothing to retype
    return any("tensor(bfloat16)" in t for t in types)


def _ops_without_bf16(model: onnx.ModelProto) -> set[str]:
    latest = onnx.defs.onnx_opset_version()
    return {n.op_type for n in model.graph.node if n.domain in ("",
                                                                "ai.onnx") and _allows_bf16(n.op_type, latest) is False}


def _bf16_opset(model: onnx.ModelProto, block_ops: set[str], block_nodes: set[str]) -> int:
    """The lowest opset at which every converted op admits bfloat16."""
    current, latest = opset_of(model), onnx.defs.onnx_opset_version()
    needed = current
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type in block_ops or node.name in block_nodes:
            continue
        for version in range(current, latest + 1):
            if _allows_bf16(node.op_type, version) is not False:
                needed = max(needed, version)
                break
    return needed


def _retype_bf16(model: onnx.ModelProto, original_floats: dict[str, np.ndarray]) -> None:
    """float16 -> bfloat16 everywhere the fp16 converter put float16.

    Hand-written because no maintained ONNX bf16 converter exists (ModelOpt's autocast is GPU-side
    tooling we do not depend on). Initializers are re-rounded from their original fp32 values, not
    from fp16, since bf16 keeps fp32's range (the fp16 pass clamps at 65504).
    """
    import ml_dtypes

    def to_bf16(tensor: TensorProto, source: np.ndarray | None) -> None:
        values = source if source is not None else numpy_helper.to_array(tensor).astype(np.float32)
        bf16 = np.ascontiguousarray(values.astype(ml_dtypes.bfloat16))
        tensor.ClearField("int32_data")
        tensor.ClearField("float_data")
        tensor.data_type = TensorProto.BFLOAT16
        tensor.raw_data = bf16.tobytes()

    def retype_type(type_proto: onnx.TypeProto) -> None:
        if type_proto.HasField("tensor_type") and type_proto.tensor_type.elem_type == TensorProto.FLOAT16:
            type_proto.tensor_type.elem_type = TensorProto.BFLOAT16
        elif type_proto.HasField("sequence_type"):
            retype_type(type_proto.sequence_type.elem_type)

    def walk(graph: onnx.GraphProto) -> None:
        for tensor in graph.initializer:
            if tensor.data_type == TensorProto.FLOAT16:
                to_bf16(tensor, original_floats.get(tensor.name))
        for value in [*graph.input, *graph.output, *graph.value_info]:
            retype_type(value.type)
        for node in graph.node:
            for attr in node.attribute:
                if (attr.type == onnx.AttributeProto.INT and attr.name in ("to", "dtype")
                        and attr.i == TensorProto.FLOAT16):
                    attr.i = TensorProto.BFLOAT16
                elif attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT16:
                    to_bf16(attr.t, None)
                elif attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for sub in attr.graphs:
                        walk(sub)

    walk(model.graph)


def _topological_sort(graph: onnx.GraphProto) -> None:
    """The converter appends its Cast nodes at the end; ONNX requires producers before consumers."""
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        ready = [n for n in pending if all(i in available for i in n.input)]
        if not ready:  # inputs from an outer scope (subgraphs) or a cycle: keep the rest as is
            ordered.extend(pending)
            break
        ready_ids = {id(n) for n in ready}
        pending = [n for n in pending if id(n) not in ready_ids]
        for node in ready:
            available.update(node.output)
        ordered.extend(ready)
    copies = [onnx.NodeProto() for _ in ordered]
    for copy, node in zip(copies, ordered, strict=True):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(copies)


def _kept_nodes(path: Path, tmp: Path, reasons: dict[str, str], block_nodes: set[str]) -> list[KeptNode]:
    """Nodes that still compute in float32 in the written model, each with why."""
    inferred = tmp / "kept.onnx"
    onnx.shape_inference.infer_shapes_path(str(path), str(inferred))
    model = onnx.load(str(inferred), load_external_data=False)
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.output]}
    kept = []
    for node in model.graph.node:
        if node.op_type == "Cast" or not any(types.get(o) == TensorProto.FLOAT for o in node.output):
            continue
        if node.name in block_nodes:
            reason = "node in block list (recipe block_nodes)"
        else:
            reason = reasons.get(node.op_type, "output type fixed to float32 by the op")
        kept.append(KeptNode(node=node.name, op_type=node.op_type, reason=reason))
    return kept
