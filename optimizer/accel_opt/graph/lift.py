"""Old opsets: a valid model whose opset ONNX Runtime no longer implements is lifted to one it does.

ONNX Runtime 1.32 has no CPU kernels for many early op versions: 40 of the 140 backend test models
shipped in the onnx 1.23 wheel (pytorch-converted, pytorch-operator, simple) fail at session creation
with "Could not find an implementation for Add(6)" or "AveragePool(1)". The models are valid ONNX;
onnx's version converter rewrites them to LIFT_TO_OPSET, which ONNX Runtime implements. Only the real
error triggers the lift (a model ONNX Runtime runs keeps its opset), and only below LIFT_TO_OPSET:
lifting cannot help a model that is already there.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import onnx
from onnx import numpy_helper

from accel_opt.errors import Unsupported, first_line
from accel_opt.graph.save import save_model, upgrade_opset

log = logging.getLogger(__name__)

# The opset old models are lifted to: ONNX Runtime implements every op of it, and per-channel int8
# (DequantizeLinear's axis) needs it anyway.
LIFT_TO_OPSET = 13
_NO_KERNEL = re.compile(r"Could not find an implementation for (\S+?\(\d+\))")


def missing_kernel(path: Path) -> str | None:
    """The first op ONNX Runtime's CPU EP has no kernel for, as `Op(version)` (e.g. "Add(6)"), or None
    when the session loads, or fails for another reason (reported by the stages that run it)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # only the kernel lookup matters
    options.log_severity_level = 3
    try:
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises its own NotImplemented / Fail types
        found = _NO_KERNEL.search(str(exc))
        return found.group(1) if found else None
    return None


def lift_if_unimplemented(path: Path, opset: int, workdir: Path) -> tuple[Path, str] | None:
    """(the lifted model, a build note) when ONNX Runtime cannot run `path` at its `opset` and the
    version converter can lift it to LIFT_TO_OPSET; None when nothing needs lifting. Raises
    Unsupported (one line naming the op and opset) when the converter fails or the lifted model still
    lacks a kernel."""
    if opset >= LIFT_TO_OPSET:
        return None
    missing = missing_kernel(path)
    if missing is None:
        return None
    why = f"ONNX Runtime has no kernel for {missing} (model opset {opset}): running it"
    source = _with_channel_slopes(path, workdir / "lifted" / f"slopes-{path.name}") if opset < 7 else path
    lifted = upgrade_opset(source, LIFT_TO_OPSET, workdir / "lifted" / path.name, why)
    check_lifted(lifted)
    still = missing_kernel(lifted)
    if still is not None:
        raise Unsupported(f"ONNX Runtime has no kernel for {missing} (model opset {opset}), nor for {still} after "
                          f"lifting to opset {LIFT_TO_OPSET}")
    log.info("lifted %s from opset %d to %d (no kernel for %s)", path.name, opset, LIFT_TO_OPSET, missing)
    return lifted, (
        f"opset {opset} -> {LIFT_TO_OPSET}: ONNX Runtime has no kernel for {missing}; onnx's version converter "
        "lifted the model. The original cannot run on ONNX Runtime, so the lifted model is the accuracy "
        "reference (it was not compared with the original here).")


def check_lifted(path: Path) -> None:
    """The converter's output must pass onnx's checker: a broken conversion is exit 4, not a bad input."""
    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as exc:
        raise Unsupported(f"onnx's version converter produced an invalid model: {first_line(exc)}") from None


def _with_channel_slopes(path: Path, dest: Path) -> Path:
    """PRelu before opset 7 applied a slope of C values per channel (axis 1); from opset 7 the slope
    broadcasts numpy-style, from the last axis, and onnx's converter leaves it as it is (measured:
    PRelu([2, 3, 4], slope [3]) then fails to run). Such slopes (initializers) become [C, 1, ...].
    Returns `path` when no PRelu needs it, else the rewritten copy at `dest`."""
    model = onnx.load(str(path))
    shaped = onnx.shape_inference.infer_shapes(model)
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in [*shaped.graph.input, *shaped.graph.value_info]
             if v.type.tensor_type.HasField("shape")}
    initializers = {t.name: t for t in model.graph.initializer}
    changed = False
    for node in model.graph.node:
        if node.op_type != "PRelu" or len(node.input) < 2:
            continue
        slope, rank = initializers.get(node.input[1]), ranks.get(node.input[0], 0)
        if slope is None or len(slope.dims) != 1 or slope.dims[0] == 1 or rank <= 2:
            continue
        per_channel = numpy_helper.to_array(slope).reshape([slope.dims[0]] + [1] * (rank - 2))
        slope.CopyFrom(numpy_helper.from_array(per_channel, slope.name))
        for value in model.graph.input:  # old IR versions list initializers as inputs too
            if value.name == slope.name:
                del value.type.tensor_type.shape.dim[:]
                for dim in per_channel.shape:
                    value.type.tensor_type.shape.dim.add().dim_value = dim
        changed = True
    if not changed:
        return path
    save_model(model, dest)
    return dest
