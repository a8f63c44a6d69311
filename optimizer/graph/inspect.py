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
        return [i for i, d in enumerate(self.shape) if not isinstance(d, int) or d <= 0]


class ResolvedShapes(BaseModel):
    shapes: dict[str, list[int]]
    notes: list[str]  # e.g. "input x: dim 0 (batch) was dynamic and defaulted to 1"
    batch_dynamic: bool  # every input's leading dim is dynamic: batch sizes can be swept


def _spec(value: onnx.ValueInfoProto) -> TensorSpec:
    ttype = value.type.tensor_type
    dims: list[Dim] = []
    for d in ttype.shape.dim:
        if d.HasField("dim_value") and d.dim_value > 0:
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


def resolve_shapes(
    inputs: list[TensorSpec],
    given: dict[str, list[int]],
    data_shapes: dict[str, list[int]] | None = None,
) -> ResolvedShapes:
    """Fix every dynamic dimension: --shapes/recipe first, then the data's shapes, then batch=1.

    Only a leading (batch-like) dimension may default; any other dynamic dimension without a
    shape is a usage error naming the input and the axis.
    """
    names = {spec.name for spec in inputs}
    unknown = sorted(set(given) - names)
    if unknown:
        raise UsageError(f"--shapes names unknown input {unknown[0]!r}; model inputs: {', '.join(sorted(names))}")
    shapes: dict[str, list[int]] = {}
    notes: list[str] = []
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
            elif axis == 0:
                dims.append(1)
                notes.append(f"input {spec.name}: dim 0 ({dim or 'unnamed'}) is dynamic; batch defaulted to 1")
            else:
                raise UsageError(
                    f"input {spec.name!r} has dynamic dim {axis} ({dim or 'unnamed'}) in {_fmt(spec.shape)}; "
                    f"give it with --shapes {spec.name}:{'x'.join(str(d) if isinstance(d, int) else '?' for d in spec.shape)}"
                )
        shapes[spec.name] = dims
    batch_dynamic = bool(inputs) and all(spec.shape and 0 in spec.dynamic_axes for spec in inputs)
    return ResolvedShapes(shapes=shapes, notes=notes, batch_dynamic=batch_dynamic)


def with_batch(shapes: dict[str, list[int]], batch: int) -> dict[str, list[int]]:
    return {name: [batch, *dims[1:]] for name, dims in shapes.items()}


def opset_of(model: onnx.ModelProto) -> int:
    """The default-domain opset a model imports (0 if none)."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    return dict(Counter(n.op_type for n in model.graph.node).most_common())


def _fmt(shape: list[Dim]) -> str:
    return "[" + ", ".join(str(d) if d is not None else "?" for d in shape) + "]"
