"""Bias correction of a Q/DQ int8 graph: each quantized layer's bias absorbs the mean shift its rounded weights add.

Rounding a layer's weights shifts the mean of its output by E[conv(x; W_q - W)], which a following layer does not
undo; depthwise convolutions (9 weights per channel) shift the most (Nagel et al., "Data-Free Quantization Through
Weight Equalization and Bias Correction", 2019). The correction subtracts that shift from the layer's bias, measured
on the calibration samples: one run of the float model with, beside each quantized Conv/Gemm, the same layer with
W_q - W as its weights on the same input (exact at the borders, where padding makes a mean-based shift wrong).

Written here because no library corrects biases of a Q/DQ graph it did not place: NNCF's FastBiasCorrection and
AIMET's bias correction run inside their own quantizers, with their own Q/DQ placement; ONNX Runtime's quantizer
has none. This works on the graph the build ships (its int32 biases), so the gate judges exactly what it corrected.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from accel_opt.data import Sample
from accel_opt.graph.inspect import opset_of
from accel_opt.precision.qdq_weights import dequantized, quantized_layers

_SUFFIX = "__accel_opt_bias_shift"


def _layers(float_model: onnx.ModelProto, quantized: onnx.ModelProto):
    """(float node, quantized node, the bias's DequantizeLinear or None where the bias stays float (TensorRT's preset),
    W_q - W) for each quantized layer with a bias."""
    q_inits = {i.name: i for i in quantized.graph.initializer}
    producer = {out: n for n in quantized.graph.node for out in n.output}
    for layer in quantized_layers(float_model, quantized):
        node = layer.node
        if len(node.input) < 3 or not node.input[2]:
            continue
        bias_dq = producer.get(node.input[2])
        if bias_dq is not None and (bias_dq.op_type != "DequantizeLinear" or bias_dq.input[0] not in q_inits):
            continue
        if bias_dq is None and node.input[2] not in q_inits:
            continue
        rounded = dequantized(layer.weight_dq, q_inits)
        yield layer.original, node, bias_dq, (rounded - layer.float_weight.astype(np.float64)).astype(np.float32)


def _shift_taps(float_model: onnx.ModelProto, layers: list) -> onnx.ModelProto:
    """The float model with one more output per layer: the mean, over everything but the channel, of the layer's input
    through W_q - W (no bias)."""
    tapped = onnx.ModelProto()
    tapped.CopyFrom(float_model)
    axes_as_input = opset_of(tapped) >= 18  # ReduceMean takes its axes as an input from opset 18, an attribute before
    for index, (original, _, _, delta) in enumerate(layers):
        name = f"{index}{_SUFFIX}"
        tapped.graph.initializer.append(numpy_helper.from_array(delta, f"{name}_weight"))
        layer = helper.make_node(original.op_type, [original.input[0], f"{name}_weight"], [f"{name}_out"])
        layer.attribute.extend(a for a in original.attribute if a.name != "beta")  # Gemm's beta scales C: absent here
        channel_axes = [0] if original.op_type == "Gemm" else [0, *range(2, delta.ndim)]
        if axes_as_input:
            tapped.graph.initializer.append(numpy_helper.from_array(np.array(channel_axes, np.int64), f"{name}_axes"))
            mean = helper.make_node("ReduceMean", [f"{name}_out", f"{name}_axes"], [name], keepdims=0)
        else:
            mean = helper.make_node("ReduceMean", [f"{name}_out"], [name], keepdims=0, axes=channel_axes)
        tapped.graph.node.extend([layer, mean])
        tapped.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    return tapped


def correct_biases(float_path: Path, quantized_path: Path, samples: list[Sample]) -> str:
    """Correct the biases (int32, or float where they stay float) of the Q/DQ graph at `quantized_path` in place, from
    the `float_path` model it was quantized from, measured on `samples` (the calibration samples). Returns a line for
    the build's notes."""
    import onnxruntime as ort

    start = time.perf_counter()
    float_model = onnx.load(str(float_path))
    quantized = onnx.load(str(quantized_path))
    layers = list(_layers(float_model, quantized))
    if not layers or not samples:
        return "bias correction: no quantized layer with a bias to correct"
    tapped = _shift_taps(float_model, layers)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the layers as written
    session = ort.InferenceSession(tapped.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [f"{i}{_SUFFIX}" for i in range(len(layers))]
    inputs = {i.name for i in session.get_inputs()}
    totals = [np.float64(0.0)] * len(layers)  # per layer, the sum over samples of its per-channel shift
    for sample in samples:
        shifts = session.run(names, {k: v for k, v in sample.items() if k in inputs})
        totals = [total + shift.astype(np.float64) for total, shift in zip(totals, shifts)]
    q_inits = {i.name: i for i in quantized.graph.initializer}
    largest = 0.0
    for (_, node, bias_dq, _), total in zip(layers, totals):
        shift = total / len(samples)
        if bias_dq is None:  # a float bias
            bias = q_inits[node.input[2]]
            values = numpy_helper.to_array(bias)
            corrected = (values.astype(np.float64) - shift).astype(values.dtype)
        else:  # int32, in units of the input's scale times the weight's
            bias, scale = q_inits[bias_dq.input[0]], numpy_helper.to_array(q_inits[bias_dq.input[1]]).astype(np.float64)
            values = numpy_helper.to_array(bias).astype(np.float64)
            corrected = np.clip(np.rint(values - shift / scale), -(2**31), 2**31 - 1).astype(np.int32)
        bias.CopyFrom(numpy_helper.from_array(corrected, bias.name))
        largest = max(largest, float(np.max(np.abs(shift))))
    onnx.save(quantized, str(quantized_path))
    return (f"bias correction: {len(layers)} layers' biases absorb the mean shift of their rounded weights, measured "
            f"on {len(samples)} calibration samples (largest {largest:.3g}) in {time.perf_counter() - start:.1f} s")
