"""Per-layer diagnosis: where a reduced-precision graph departs from its fp32 reference, node by node.

Both graphs run on ONNX Runtime's CPU EP with graph optimizations off (the graphs' own semantics:
a Q/DQ pair computes exactly its rounding) and the compared tensors marked as outputs, one steering
sample at a time. Each tensor's error is reduced to a few sums at once, so memory holds one sample's
tensors; when those would exceed MAX_EXPOSED_BYTES they are spread over several runs.

Tensors are mapped explicitly, by the naming rules of the tools that wrote the candidate, not by
equal names alone: ORT's quantizer reads `T` through `T_DequantizeLinear_Output`, renames a quantized
graph output's producer to `T_QuantizeLinear_Input` and folds Relu/Clip into the producer (which then
outputs the activation's name, holding the value *before* the activation); the float16 converter
reads inputs through Casts. A candidate tensor is traced back through QuantizeLinear /
DequantizeLinear / Cast to the node that computes it, and that node is charged with the error it
*adds*: the error of its output minus the worst error among its inputs. ORT's qdq_loss_debug holds
every activation of every sample in memory and matches by name suffix only; Polygraphy's layer
marking has no cross-graph mapping: hence this module.
"""

from __future__ import annotations

import functools
import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from pydantic import BaseModel

from accel_opt.data import Sample

MAX_EXPOSED_BYTES = 1 << 30  # intermediate tensors held per run; more are spread over several runs
TRANSPARENT_OPS = ("QuantizeLinear", "DequantizeLinear", "Cast")  # precision plumbing, not computation
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)
LOW_FLOAT_TYPES = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
# onnxruntime.quantization.quant_utils' names of a quantized tensor's float value before / after its Q/DQ pair
QUANT_INPUT_SUFFIX, DEQUANT_OUTPUT_SUFFIX = "_QuantizeLinear_Input", "_DequantizeLinear_Output"


class LayerError(BaseModel):
    node: str  # the candidate's node that computes the tensor (the one to keep in higher precision)
    op_type: str
    depth: int  # position in the reference graph's topological order
    tensor: str  # the reference tensor compared
    error: float  # mean |cand - ref| / scale over the steering samples (scale: the reference's std, as the gate)
    input_error: float  # the worst error among the node's inputs
    added_error: float  # error - input_error: what this node contributes
    max_abs_reference: float  # the largest |value| in fp32: above 65504 it overflows float16
    nonfinite: int = 0  # NaN/Inf values the candidate produced
    reduced: bool = True  # the candidate runs the node in reduced precision (keeping it in fp32 can help)


class Diagnosis(BaseModel):
    samples: int
    tensors_compared: int
    tensors_unmatched: int  # reference tensors the candidate does not compute (fused away)
    layers: list[LayerError]  # in depth order

    def ranked(self) -> list[LayerError]:
        """Worst first: non-finite output, then by the error the node adds."""
        return sorted(self.layers, key=lambda e: (e.nonfinite == 0, -e.added_error))

    def profile(self) -> list[tuple[int, float]]:
        """(depth, error) of every compared tensor: the error-by-depth curve."""
        return [(e.depth, e.error) for e in self.layers]


@dataclass
class _Stats:
    abs_diff: float = 0.0
    count: int = 0
    total: float = 0.0
    squares: float = 0.0
    peak: float = 0.0
    nonfinite: int = 0

    def add(self, ref: np.ndarray, cand: np.ndarray) -> None:
        r, c = ref.astype(np.float64).ravel(), cand.astype(np.float64).ravel()
        if r.size != c.size:
            raise ValueError(f"shapes differ: {ref.shape} vs {cand.shape}")
        bad = ~np.isfinite(c)
        self.nonfinite += int(bad.sum())
        c = np.where(bad, 0.0, c)
        r = np.where(np.isfinite(r), r, 0.0)
        self.abs_diff += float(np.abs(c - r).sum())
        self.count += r.size
        self.total += float(r.sum())
        self.squares += float((r * r).sum())
        self.peak = max(self.peak, float(np.abs(r).max(initial=0.0)))

    def error(self) -> float:
        if self.nonfinite:
            return math.inf
        if not self.count:
            return 0.0
        mean = self.total / self.count
        std = math.sqrt(max(self.squares / self.count - mean * mean, 0.0))
        scale = std if std > 1e-12 else (self.peak if self.peak > 0 else 1.0)  # as the gate's scale
        return self.abs_diff / self.count / scale


@dataclass
class TensorMap:
    """Reference tensor -> the candidate tensor holding the same value, and who computes it."""

    pairs: dict[str, str] = field(default_factory=dict)  # ref name -> cand name
    node_of: dict[str, onnx.NodeProto] = field(default_factory=dict)  # ref name -> the cand node computing it
    # that node's inputs (ref names; None: graph input)
    inputs_of: dict[str, list[str | None]] = field(default_factory=dict)
    depth: dict[str, int] = field(default_factory=dict)
    reduced: dict[str, bool] = field(default_factory=dict)
    unmatched: int = 0


def map_tensors(reference: onnx.ModelProto, candidate: onnx.ModelProto) -> TensorMap:
    """Pair every float tensor a reference node computes with the candidate tensor of the same value."""
    ref_types = _float_tensors(reference)
    cand_types = _float_tensors(candidate)
    producers = {o: n for n in candidate.graph.node for o in n.output if o}
    weights = {t.name for t in candidate.graph.initializer}
    graph_inputs = {i.name for i in candidate.graph.input} - weights

    def chain(name: str) -> list[onnx.NodeProto]:
        """The Q/DQ/Cast nodes between `name` and the tensor a computing node (or the graph input) produced."""
        nodes: list[onnx.NodeProto] = []
        while name in producers and producers[name].op_type in TRANSPARENT_OPS and len(nodes) < len(producers):
            nodes.append(producers[name])
            name = producers[name].input[0]
        return nodes

    def origin(name: str) -> str:
        nodes = chain(name)
        return nodes[-1].input[0] if nodes else name

    def reduced(cand: str, node: onnx.NodeProto) -> bool:
        """Quantized (reads a DequantizeLinear output), or its output is (or is rounded to) a 16-bit float."""
        if any(name in producers and producers[name].op_type == "DequantizeLinear" for name in node.input):
            return True
        return cand_types.get(origin(cand)) in LOW_FLOAT_TYPES or any(
            n.op_type == "Cast" and any(a.name == "to" and a.i in LOW_FLOAT_TYPES for a in n.attribute)
            for n in chain(cand))

    mapping = TensorMap()
    cand_to_ref: dict[str, str] = {}
    for depth, node in enumerate(reference.graph.node):
        for name in node.output:
            if name not in ref_types or node.op_type == "Constant":  # weights, not activations
                continue
            cand = (name if name in producers
                    else name + QUANT_INPUT_SUFFIX if name + QUANT_INPUT_SUFFIX in producers else None)
            computing = producers.get(origin(cand)) if cand else None
            if computing is not None and computing.op_type != node.op_type:
                # An activation folded into its producer's Q range: the producer's float output is the value
                # *before* the activation; only the dequantized tensor holds the activation's value.
                cand = name + DEQUANT_OUTPUT_SUFFIX if name + DEQUANT_OUTPUT_SUFFIX in producers else None
            if cand is None or computing is None or cand not in cand_types:
                mapping.unmatched += 1
                continue
            mapping.pairs[name], mapping.node_of[name], mapping.depth[name] = cand, computing, depth
            mapping.reduced[name] = reduced(cand, computing)
            cand_to_ref[origin(cand)] = name
    for ref_name, node in mapping.node_of.items():
        sources: list[str | None] = []
        for name in node.input:
            source = origin(name) if name else ""
            if not source or source in weights or (source in producers and producers[source].op_type == "Constant"):
                continue
            if source in graph_inputs:
                sources.append(None)
            elif source in cand_to_ref and cand_to_ref[source] != ref_name:
                sources.append(cand_to_ref[source])
        mapping.inputs_of[ref_name] = sources
    return mapping


def diagnose(reference: Path, candidate: Path, samples: list[Sample], threads: int = 2) -> Diagnosis:
    """Compare every mapped intermediate tensor of `candidate` with `reference` on `samples`."""
    ref_proto, cand_proto = _typed(reference), _typed(candidate)
    mapping = map_tensors(ref_proto, cand_proto)
    stats = {name: _Stats() for name in mapping.pairs}
    sizes = _tensor_bytes(ref_proto, samples[0]) if samples else {}
    with tempfile.TemporaryDirectory(prefix="accel-opt-diagnose-") as tmp:
        for index, chunk in enumerate(_chunks(list(mapping.pairs), sizes)):
            cand_names = [mapping.pairs[n] for n in chunk]
            ref_session = _exposed_session(reference, ref_proto, chunk, Path(tmp) / f"ref{index}", threads)
            cand_session = _exposed_session(candidate, cand_proto, cand_names, Path(tmp) / f"cand{index}", threads)
            for sample in samples:
                ref_values = ref_session.run(chunk, _feed(ref_session, sample))
                cand_values = cand_session.run(cand_names, _feed(cand_session, sample))
                for name, r, c in zip(chunk, ref_values, cand_values, strict=True):
                    stats[name].add(r, c)
            del ref_session, cand_session
    errors = {name: s.error() for name, s in stats.items()}
    layers = []
    for name in sorted(mapping.pairs, key=mapping.depth.get):
        node = mapping.node_of[name]
        input_error = max((0.0 if source is None else errors[source] for source in mapping.inputs_of[name]),
                          default=0.0)
        if math.isinf(errors[name]):
            added = 0.0 if math.isinf(input_error) else math.inf  # non-finite already upstream: not this node's doing
        else:
            added = errors[name] - input_error
        layers.append(LayerError(
            node=node.name, op_type=node.op_type, depth=mapping.depth[name], tensor=name, error=errors[name],
            input_error=input_error, added_error=added, max_abs_reference=stats[name].peak,
            nonfinite=stats[name].nonfinite, reduced=mapping.reduced[name],
        ))
    return Diagnosis(samples=len(samples), tensors_compared=len(layers), tensors_unmatched=mapping.unmatched,
                     layers=layers)


def emulate_bfloat16(path: Path, out: Path) -> Path:
    """An fp32 copy of a bfloat16 graph that rounds every bfloat16 tensor to bfloat16 (Cast there and back),
    for the diagnosis: ONNX Runtime's CPU EP runs Cast to and from bfloat16 but no bfloat16 Conv/MatMul.
    The arithmetic runs in fp32, so it shows bfloat16's storage rounding, not its accumulation."""
    bf16 = {name for name, t in _float_tensors(_with_types(path)).items() if t == TensorProto.BFLOAT16}
    model = onnx.load(str(path))
    for tensor in model.graph.initializer:
        if tensor.data_type == TensorProto.BFLOAT16:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name))
    nodes = []
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.name == "to" and attr.i == TensorProto.BFLOAT16:
                attr.i = TensorProto.FLOAT
        nodes.append(node)
        for index, name in enumerate(node.output):
            if name in bf16:
                node.output[index] = f"{name}__unrounded"
                nodes += [helper.make_node("Cast", [f"{name}__unrounded"], [f"{name}__bf16"], to=TensorProto.BFLOAT16,
                                           name=f"{name}__round"),
                          helper.make_node("Cast", [f"{name}__bf16"], [name], to=TensorProto.FLOAT,
                                           name=f"{name}__widen")]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    del model.graph.value_info[:]
    for value in [*model.graph.input, *model.graph.output]:
        if value.type.tensor_type.elem_type == TensorProto.BFLOAT16:
            value.type.tensor_type.elem_type = TensorProto.FLOAT
    onnx.save(model, str(out))
    return out


def _float_tensors(model: onnx.ModelProto) -> dict[str, int]:
    values = [*model.graph.input, *model.graph.value_info, *model.graph.output]
    return {v.name: v.type.tensor_type.elem_type for v in values
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type in FLOAT_TYPES}


def _typed(path: Path) -> onnx.ModelProto:
    """`_with_types`, once per file version: the fallback diagnoses every round against the same reference."""
    stat = Path(path).stat()
    return _typed_cached(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _typed_cached(path: str, mtime_ns: int, size: int) -> onnx.ModelProto:
    return _with_types(Path(path))


def _with_types(path: Path) -> onnx.ModelProto:
    """The graph (no weights) with every tensor's type inferred."""
    with tempfile.TemporaryDirectory(prefix="accel-opt-types-") as tmp:
        inferred = Path(tmp) / "inferred.onnx"
        onnx.shape_inference.infer_shapes_path(str(path), str(inferred))
        return onnx.load(str(inferred), load_external_data=False)


def _tensor_bytes(model: onnx.ModelProto, sample: Sample) -> dict[str, int]:
    """fp32 bytes of each tensor at the sample's batch, where shape inference knows its shape."""
    batch = max((a.shape[0] for a in sample.values() if a.ndim), default=1)
    out = {}
    for value in [*model.graph.value_info, *model.graph.output]:
        size = 1
        for dim in value.type.tensor_type.shape.dim:
            size *= dim.dim_value if dim.HasField("dim_value") else batch
        out[value.name] = size * 4
    return out


def _chunks(names: list[str], sizes: dict[str, int]) -> Iterator[list[str]]:
    chunk, held = [], 0
    for name in names:
        size = sizes.get(name, 1 << 20)
        if chunk and held + size > MAX_EXPOSED_BYTES:
            yield chunk
            chunk, held = [], 0
        chunk.append(name)
        held += size
    if chunk:
        yield chunk


def _exposed_session(path: Path, typed: onnx.ModelProto, names: list[str], folder: Path, threads: int):
    """A session of `path` whose outputs are `names`, saved in `folder` (its external data linked there)."""
    import onnxruntime as ort

    folder.mkdir(parents=True)
    model = onnx.load(str(path), load_external_data=False)
    types = _float_tensors(typed)
    del model.graph.output[:]
    model.graph.output.extend(helper.make_tensor_value_info(n, types[n], None) for n in names)
    _link_external_data(model, path.parent, folder)
    onnx.save(model, str(folder / "exposed.onnx"))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = threads
    options.log_severity_level = 4
    return ort.InferenceSession(str(folder / "exposed.onnx"), options, providers=["CPUExecutionProvider"])


def _link_external_data(model: onnx.ModelProto, source: Path, folder: Path) -> None:
    """Link the model's external data files into `folder`, where its marked copy is saved (ONNX Runtime
    refuses external data locations outside the model's folder)."""
    from onnx import external_data_helper

    for tensor in external_data_helper._get_all_tensors(model):
        if external_data_helper.uses_external_data(tensor):
            location = external_data_helper.ExternalDataInfo(tensor).location
            link = folder / location
            if not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to((source / location).resolve())


_FLOAT_INPUTS = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


def _feed(session, sample: Sample) -> Sample:
    """The sample's arrays the session takes, float ones cast to its declared type (a float16-io build)."""
    declared = {i.name: _FLOAT_INPUTS.get(i.type) for i in session.get_inputs()}
    return {name: (array.astype(declared[name]) if declared[name] and array.dtype.kind == "f" else array)
            for name, array in sample.items() if name in declared}
