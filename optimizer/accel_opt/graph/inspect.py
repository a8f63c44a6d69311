"""Read a graph's interface (inputs, outputs, dtypes, dynamic dims) and resolve concrete shapes."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import helper
from pydantic import BaseModel

from accel_opt.errors import UsageError

Dim = int | str | None  # int: fixed; str: symbolic name; None: unknown


class TensorSpec(BaseModel):
    name: str
    dtype: str  # numpy dtype name, e.g. "float32"
    shape: list[Dim]

    @property
    def dynamic_axes(self) -> list[int]:
        return [i for i, d in enumerate(self.shape) if not isinstance(d, int) or d < 0]


class ResolvedShapes(BaseModel):
    shapes: dict[str, list[int]]
    notes: list[str]  # e.g. "input x: dim 0 (batch) was dynamic and defaulted to 1"
    batch_axes: dict[str, int | None]  # per input; None: not batched (a scalar, a fixed table)
    # some input is batched and every batched input's batch dim is dynamic: batch sizes can be swept
    batch_dynamic: bool

    @property
    def batch_size(self) -> int:
        """The batch of these shapes (1 when no input is batched)."""
        return next((self.shapes[n][a] for n, a in self.batch_axes.items() if a is not None), 1)


def _spec(value: onnx.ValueInfoProto) -> TensorSpec:
    ttype = value.type.tensor_type
    dims: list[Dim] = []
    for d in ttype.shape.dim:
        if d.HasField("dim_value") and d.dim_value >= 0:  # 0 is a fixed, empty dim (not an unknown one)
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(ttype.elem_type)).name if ttype.elem_type else "float32"
    if ttype.elem_type == onnx.TensorProto.BFLOAT16:
        dtype = "bfloat16"
    return TensorSpec(name=value.name, dtype=dtype, shape=dims)


def io_specs(model: onnx.ModelProto) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Graph inputs (minus initializers, which old IR versions list as inputs) and outputs."""
    initializers = {init.name for init in model.graph.initializer}
    inputs = [_spec(v) for v in model.graph.input if v.name not in initializers]
    outputs = [_spec(v) for v in model.graph.output]
    return inputs, outputs


def batch_axes(inputs: list[TensorSpec], given: dict[str, int | None] | None = None) -> dict[str, int | None]:
    """The batch axis of each input: `given` (recipe `batch_axes`, --batch-axes) first; else a dynamic
    leading dim; else the axis carrying the symbolic name of another input's dynamic leading dim
    (silero VAD: input [batch, n], state [2, batch, 128]); else None: not batched (scalars, fixed dims)."""
    given = given or {}
    names = {spec.name for spec in inputs}
    unknown = sorted(set(given) - names)
    if unknown:
        raise UsageError(f"--batch-axes names unknown input {unknown[0]!r}; model inputs: {', '.join(sorted(names))}")
    leading = {spec.shape[0] for spec in inputs if spec.shape and isinstance(spec.shape[0], str)}
    axes: dict[str, int | None] = {}
    for spec in inputs:
        if spec.name in given:
            axis = given[spec.name]
            if axis is not None and not 0 <= axis < len(spec.shape):
                raise UsageError(f"--batch-axes {spec.name}:{axis}: the input has rank {len(spec.shape)}")
            axes[spec.name] = axis
        elif not spec.shape:
            axes[spec.name] = None
        elif not isinstance(spec.shape[0], int):
            axes[spec.name] = 0
        else:
            axes[spec.name] = next((i for i, d in enumerate(spec.shape) if isinstance(d, str) and d in leading), None)
    return axes


def resolve_shapes(
    inputs: list[TensorSpec],
    given: dict[str, list[int]],
    data_shapes: dict[str, list[int]] | None = None,
    given_batch_axes: dict[str, int | None] | None = None,
) -> ResolvedShapes:
    """Fix every dynamic dimension: --shapes/recipe first, then the data's shapes, then batch=1.

    Only a batch axis (see `batch_axes`) may default; any other dynamic dimension without a shape
    is a usage error naming the input and the axis.
    """
    names = {spec.name for spec in inputs}
    unknown = sorted(set(given) - names)
    if unknown:
        raise UsageError(f"--shapes names unknown input {unknown[0]!r}; model inputs: {', '.join(sorted(names))}")
    axes = batch_axes(inputs, given_batch_axes)
    shapes: dict[str, list[int]] = {}
    notes: list[str] = []
    for name, axis in list(axes.items()):  # an empty data axis is a length, not a batch: no rows to batch
        empty = axis is not None and name in (data_shapes or {}) and data_shapes[name][axis] == 0
        if empty and name not in (given_batch_axes or {}):
            axes[name] = None
            notes.append(f"input {name}: dim {axis} is 0 in the data, so it is not batched")
    missing: list[TensorSpec] = []  # inputs with a dynamic dim nothing fixes: named together, in one error
    for spec in inputs:
        if spec.name in given:
            dims = given[spec.name]
            if len(dims) != len(spec.shape):
                raise UsageError(
                    f"--shapes {spec.name}: rank {len(dims)} given, the model's input has rank {len(spec.shape)} "
                    f"({_fmt(spec.shape)})"
                )
            for axis, (want, have) in enumerate(zip(dims, spec.shape)):
                if isinstance(have, int) and have != want:
                    raise UsageError(f"--shapes {spec.name}: dim {axis} is fixed at {have} in the model, got {want}")
            shapes[spec.name] = list(dims)
            continue
        if data_shapes and spec.name in data_shapes:
            shapes[spec.name] = list(data_shapes[spec.name])
            continue
        dims = []
        for axis, dim in enumerate(spec.shape):
            if isinstance(dim, int):
                dims.append(dim)
            elif axis == axes[spec.name]:
                dims.append(1)
                notes.append(f"input {spec.name}: dim {axis} ({dim or 'unnamed'}) is dynamic; batch defaulted to 1")
            else:
                missing.append(spec)
                break
        shapes[spec.name] = dims
    if missing:
        raise UsageError(_shapes_needed(missing, axes, given))
    batched = [spec for spec in inputs if axes[spec.name] is not None]
    batch_dynamic = bool(batched) and all(axes[spec.name] in spec.dynamic_axes for spec in batched)
    sizes = {shapes[spec.name][axes[spec.name]] for spec in batched}
    if len(sizes) > 1:
        listed = ", ".join(f"{s.name} dim {axes[s.name]} = {shapes[s.name][axes[s.name]]}" for s in batched)
        raise UsageError(f"the batched inputs disagree on the batch size ({listed}); fix --shapes or --batch-axes")
    return ResolvedShapes(shapes=shapes, notes=notes, batch_axes=axes, batch_dynamic=batch_dynamic)


def _shapes_needed(missing: list[TensorSpec], axes: dict[str, int | None], given: dict[str, list[int]]) -> str:
    """Every input whose dynamic dims nothing fixes, and a --shapes value that would: batch 1, a dim named like
    another's the same value, a sequence 128, an image side 224 (an example: the model's own limits decide)."""
    def example(name: str | None) -> int:
        lowered = (name or "").lower()
        return 224 if any(word in lowered for word in ("height", "width", "size")) else 128

    described, complete = [], dict(given)
    for spec in missing:
        free = [f"dim {axis} ({dim or 'unnamed'})" for axis, dim in enumerate(spec.shape)
                if not isinstance(dim, int) and axis != axes[spec.name]]
        described.append(f"{spec.name} {_fmt(spec.shape)}: {', '.join(free)}")
        complete[spec.name] = [dim if isinstance(dim, int) else 1 if axis == axes[spec.name] else example(dim)
                               for axis, dim in enumerate(spec.shape)]
    flag = ",".join(f"{name}:{'x'.join(map(str, dims))}" for name, dims in complete.items())
    return (f"{len(missing)} input(s) have dynamic dims that --shapes, the data or the batch do not fix: "
            f"{'; '.join(described)}. Give them all at once, for example --shapes {flag}")


def with_batch(shapes: dict[str, list[int]], batch: int, axes: dict[str, int | None]) -> dict[str, list[int]]:
    """`shapes` with each batched input's batch axis set to `batch`."""
    out = {name: list(dims) for name, dims in shapes.items()}
    for name, axis in axes.items():
        if axis is not None and name in out:
            out[name][axis] = batch
    return out


def opset_of(model: onnx.ModelProto) -> int:
    """The default-domain opset a model imports (0 if none)."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    return dict(Counter(n.op_type for n in model.graph.node).most_common())


def _fmt(shape: list[Dim]) -> str:
    return "[" + ", ".join(str(d) if d is not None else "?" for d in shape) + "]"


# Ops that pass an integer input's values on unchanged (an index may be cast or reshaped before its Gather).
_VALUE_PRESERVING = {"Cast", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Expand"}


def index_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """For each integer graph input that indexes a table (a Gather's or GatherElements' indices, directly
    or through value-preserving ops such as Cast or Reshape), the table's size along the gathered axis:
    valid indices are [0, bound). An input indexing several tables gets the smallest. Tables whose size
    along the axis is unknown (dynamic) give no bound."""
    graph = model.graph
    dims = {t.name: list(t.dims) for t in graph.initializer}
    for value in [*graph.value_info, *graph.input]:
        shape = value.type.tensor_type.shape
        if value.name not in dims and value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape"):
            dims[value.name] = [d.dim_value if d.HasField("dim_value") else -1 for d in shape.dim]
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    inputs, _ = io_specs(model)
    bounds: dict[str, int] = {}
    for spec in inputs:
        if spec.dtype == "bfloat16" or np.dtype(spec.dtype).kind not in "iu":
            continue
        found = [b for b in _gathered_sizes(spec.name, consumers, dims, set()) if b > 0]
        if found:
            bounds[spec.name] = min(found)
    return bounds


def _gathered_sizes(tensor: str, consumers, dims: dict[str, list[int]], seen: set[str]) -> list[int]:
    """The table sizes `tensor`'s values index, following value-preserving ops forward."""
    if tensor in seen:
        return []
    seen.add(tensor)
    sizes = []
    for node in consumers.get(tensor, []):
        if node.op_type in ("Gather", "GatherElements") and len(node.input) > 1 and node.input[1] == tensor:
            table = dims.get(node.input[0])
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            if table and -len(table) <= axis < len(table):
                sizes.append(table[axis])
        elif node.op_type in _VALUE_PRESERVING and node.input[0] == tensor:
            for out in node.output:
                sizes += _gathered_sizes(out, consumers, dims, seen)
    return sizes
