"""What no int8 scale can represent, refused before ONNX Runtime's quantizer meets it (it stops on an assertion,
"scale issue", which reads as a bug): a NaN/Inf weight of a layer to quantize, a calibrated range that is not finite."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from accel_opt.errors import InputRejected


def refuse_nonfinite_weights(model: Path, op_types: set[str], exclude: set[str]) -> None:
    """InputRejected (exit 3) naming a NaN/Inf weight of a node that would be quantized: it has no int8 scale (ONNX
    Runtime stops on an assertion, "scale issue"). Weights of nodes left in float (a -inf mask constant) are fine."""
    proto = onnx.load(str(model))
    weights = {t.name: t for t in proto.graph.initializer
               if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)}
    for node in proto.graph.node:
        if node.op_type not in op_types or node.name in exclude:
            continue
        for name in (n for n in node.input if n in weights):
            values = numpy_helper.to_array(weights[name])
            if not np.isfinite(values).all():
                raise InputRejected(f"int8: weight {name!r} of node {node.name!r} ({node.op_type}) holds "
                                    f"{int((~np.isfinite(values)).sum())} NaN/Inf value(s): no int8 scale can "
                                    "represent "
                                    "it; fix the weights, or build fp32/fp16")


def refuse_nonfinite_ranges(ranges_file: Path) -> None:
    """InputRejected (exit 3) naming a tensor whose calibrated range is not finite: the calibration data drove it to
    NaN or past float32 (data holding float32's largest value, or a NaN weight of a layer left in float upstream).
    No int8 scale represents it; ONNX Runtime's quantizer would stop on an assertion ("scale issue", read as a bug)."""
    from onnxruntime.quantization.calibrate import load_tensors_data

    for name, entry in load_tensors_data(ranges_file).items():
        low, high = (float(np.max(np.abs(np.asarray(v, np.float64)))) for v in entry.range_value)
        if not (math.isfinite(low) and math.isfinite(high)):
            raise InputRejected(f"int8: the calibration data drives tensor {name!r} to NaN or Inf (its range is "
                                f"{entry.range_value[0]!r} .. {entry.range_value[1]!r}): no int8 scale can represent "
                                "it; check the data (and the model's weights) for NaN/Inf and float32's extremes, or "
                                "build fp32/fp16")
