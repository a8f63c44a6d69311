"""AdaRound on a Q/DQ int8 graph: each layer's weights rounded up or down so its output, not each weight, is closest.

Rounding every weight to nearest minimises each weight's own error, not the layer's output error. AdaRound (Nagel et
al., "Up or Down? Adaptive Rounding for Post-Training Quantization", 2020) learns per weight whether to round down or
up, minimising the layer's output error on the calibration samples, with a regulariser that drives each choice to 0
or 1. Sequential here: each layer's input comes from the Q/DQ graph with the layers before it already re-rounded,
and its target is the float model's output of that layer, so each layer also absorbs the error upstream of it.
Measured on EfficientNet-Lite0 (64 calibration crops, 240 held out, 2-vCPU AMX host): top-1 agreement with fp32
90.0% -> 94.6% and logit RMS error 0.212 -> 0.074, every layer still int8; with each layer's input from the float
model instead of the re-rounded one (an earlier prototype), 89.6%.

Written here rather than called from aimet-onnx 2.42, the library that has it: its apply_adaround writes back the
soft-rounded weights (`adaround_weights(..., True)` at the end of `adaround_module`), which below its default 10,000
iterations per layer stay near the float weights and round back to nearest in a Q/DQ graph (measured: 0 weights
re-rounded on EfficientNet-Lite0); its activation quantizers stay on while it optimizes (its `with
(disable_quantizers(...) and TemporaryDirectory() as tmp)` enters only the directory); and it quantizes with its own
Q/DQ placement, not the graph this project ships and its gate checks. The maths below follows AIMET's (the rectified
sigmoid, its initialisation, the annealed regulariser) and the paper's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from accel_opt.data import Sample
from accel_opt.errors import Unsupported
from accel_opt.files import install_line
from accel_opt.precision.qdq_weights import (
    QuantizedLayer,
    broadcast_along,
    dequantized,
    int8_weight_range,
    learned_in_place,
    quantized_layers,
)
from accel_opt.precision.torch_graph import conv_or_gemm

ZETA, GAMMA = 1.1, -0.1  # the rectified sigmoid's stretch: h(V) reaches 0 and 1 exactly
REGULARIZER_WEIGHT = 0.01
BETA_START, BETA_END, WARM_UP = 20.0, 2.0, 0.2  # the regulariser's exponent, annealed after the warm-up fraction
LEARNING_RATE = 1e-2
BATCH = 8  # calibration samples per step
TARGETS_BUDGET_BYTES = 512 * 2**20  # the float model's outputs held at once


@dataclass
class _Target:
    tensor: str  # in the float graph: the layer's output, or its Relu/Clip's where that is its only consumer
    low: float | None = None
    high: float | None = None


def _activation_targets(float_model: onnx.ModelProto, layers: list[onnx.NodeProto]) -> dict[str, _Target]:
    """The float tensor each layer (by name) is fitted to. ONNX Runtime's quantizer folds a Relu/Clip that follows a
    Conv into the output's quantization range, so the layer's output is compared after that activation (else a
    pre-activation difference the graph clips away would steer the rounding)."""
    graph = float_model.graph
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    constants = {i.name: i for i in graph.initializer} | {
        n.output[0]: n.attribute[0].t for n in graph.node
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
    targets = {}
    for node in layers:
        readers = consumers.get(node.output[0], [])
        activation = readers[0] if len(readers) == 1 and readers[0].op_type in ("Relu", "Clip") else None
        bounds = [*activation.input[1:3], "", ""][:2] if activation is not None else []  # Clip's min, max ("": absent)
        if activation is None or any(name and name not in constants for name in bounds):
            targets[node.name] = _Target(node.output[0])  # no activation, or bounds computed at run time
        elif activation.op_type == "Relu":
            targets[node.name] = _Target(activation.output[0], 0.0)
        else:
            legacy = {a.name: a.f for a in activation.attribute}  # Clip before opset 11: min/max attributes
            low, high = (float(numpy_helper.to_array(constants[name])) if name else legacy.get(key)
                         for name, key in zip(bounds, ("min", "max")))
            targets[node.name] = _Target(activation.output[0], low, high)
    return targets


def _with_outputs(model: onnx.ModelProto, names: list[str], as_inputs: dict[str, onnx.TensorProto] | None = None):
    """An InferenceSession of `model` (graph optimizations off: the layers as written) with `names` as extra outputs
    and the initializers in `as_inputs` fed at each run instead (the weights being re-rounded)."""
    import onnxruntime as ort

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    known = {o.name for o in copy.graph.output}
    copy.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in dict.fromkeys(names) if n not in known)
    if as_inputs:
        kept = [i for i in copy.graph.initializer if i.name not in as_inputs]
        del copy.graph.initializer[:]
        copy.graph.initializer.extend(kept)
        copy.graph.input.extend(helper.make_tensor_value_info(name, t.data_type, list(t.dims))
                                for name, t in as_inputs.items())
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(copy.SerializeToString(), options, providers=["CPUExecutionProvider"])


class _FloatTargets:
    """The float model's output of each layer on every sample, taken in layer order: computed for as many layers at
    once as fit in `budget_bytes`, one pass over the samples per group rather than per layer (measured on
    EfficientNet-Lite0 at 100 steps per layer: one pass per layer took 54 s of AdaRound's 226)."""

    def __init__(self, session, names: list[str], feeds: list[dict], budget_bytes: int = TARGETS_BUDGET_BYTES):
        self.session, self.feeds, self.budget_bytes = session, feeds, budget_bytes
        self.pending = list(dict.fromkeys(names))
        self.bytes_per_sample = dict(zip(self.pending, (a.nbytes for a in session.run(self.pending, feeds[0]))))
        self.ready: dict[str, np.ndarray] = {}

    def pop(self, name: str) -> np.ndarray:
        if name not in self.ready:
            group, used = [], 0
            for pending in self.pending:
                size = self.bytes_per_sample[pending] * len(self.feeds)
                if group and used + size > self.budget_bytes:
                    break
                group.append(pending)
                used += size
            self.pending = self.pending[len(group):]
            runs = [self.session.run(group, feed) for feed in self.feeds]
            self.ready = {n: np.concatenate([run[i] for run in runs]) for i, n in enumerate(group)}
        return self.ready.pop(name)


def adaround(float_model: onnx.ModelProto, quantized: onnx.ModelProto, samples: list[Sample], *, qmin: int, qmax: int,
             iterations: int, time_budget_s: float = float("inf"), seed: int = 0) -> tuple[dict[str, np.ndarray], str]:
    """Re-round the integer weights of `quantized` (a Q/DQ graph of `float_model`, changed in place), layer by layer in
    graph order, each kept only where it lowers the layer's output error on `samples` against round-to-nearest.
    `qmin`/`qmax`: the integer range the weights were quantized to. Once `time_budget_s` has passed (checked before
    each layer), the layers left keep nearest rounding. Returns ({weight initializer: its integers}, a
    line for the build's notes)."""
    try:
        import torch
        from torch.nn import functional
    except ImportError as exc:
        raise Unsupported(f"AdaRound needs PyTorch: {install_line('ptq')}") from exc
    start = time.monotonic()
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    inits = {i.name: i for i in quantized.graph.initializer}
    layers = [(layer, forward) for layer in quantized_layers(float_model, quantized)
              if (forward := conv_or_gemm(layer.node, layer.float_weight.ndim, functional)) is not None]
    if not layers or not samples:
        return {}, "AdaRound: no quantized Conv/Gemm layer to re-round"
    targets = _activation_targets(float_model, [layer.original for layer, _ in layers])
    integers = {layer.weight_dq.input[0]: numpy_helper.to_array(inits[layer.weight_dq.input[0]]) for layer, _ in layers}
    float_session = _with_outputs(float_model, [t.tensor for t in targets.values()])
    graph_inputs = {i.name for i in quantized.graph.input}  # a layer left unquantized on its input reads it as fed
    quantized_session = _with_outputs(quantized, [layer.node.input[0] for layer, _ in layers
                                                  if layer.node.input[0] not in graph_inputs],
                                      {name: inits[name] for name in integers})
    float_inputs = {i.name for i in float_session.get_inputs()}
    float_targets = _FloatTargets(float_session, [targets[layer.node.name].tensor for layer, _ in layers],
                                  [{k: v for k, v in s.items() if k in float_inputs} for s in samples])
    model_inputs = {i.name for i in quantized_session.get_inputs()} - integers.keys()

    rerounded, changed, total, fitted = {}, 0, 0, 0
    for layer, forward in layers:
        if time.monotonic() - start >= time_budget_s:
            break
        fitted += 1
        target = targets[layer.node.name]
        source = layer.node.input[0]
        x = torch.from_numpy(np.concatenate([s[source] if source in s else quantized_session.run(
            [source], {k: v for k, v in s.items() if k in model_inputs} | integers)[0] for s in samples]))
        y = torch.from_numpy(float_targets.pop(target.tensor))
        name = layer.weight_dq.input[0]
        hard, error_nearest, error_hard = _fit(layer, forward, target, x, y, integers[name], inits, quantized, qmin,
                                               qmax, iterations, rng, torch)
        total += hard.size
        if error_hard < error_nearest:
            changed += int((hard != integers[name]).sum())
            integers[name] = rerounded[name] = hard.astype(integers[name].dtype)
    for name, values in rerounded.items():
        inits[name].CopyFrom(numpy_helper.from_array(values, name))
    return rerounded, (
        f"AdaRound: {len(rerounded)} of {len(layers)} layers re-rounded ({changed} of {total} weights away from "
        f"nearest), each fitted to the float model's output over {len(samples)} calibration samples, {iterations} "
        f"steps per layer, in {time.monotonic() - start:.1f} s"
        + (f"; the {time_budget_s:.0f} s budget ran out: the last {len(layers) - fitted} layers keep nearest rounding"
           if fitted < len(layers) else ""))


def _fit(layer: QuantizedLayer, forward, target: _Target, x, y, nearest: np.ndarray, inits, quantized, qmin: int,
         qmax: int, iterations: int, rng: np.random.Generator, torch) -> tuple[np.ndarray, float, float]:
    """One layer's AdaRound: (its hard-rounded integers, the output's mean squared error on every sample with the
    nearest integers, with these)."""
    scale, *zero = (numpy_helper.to_array(inits[n]).astype(np.float32) for n in layer.weight_dq.input[1:])
    scale = torch.from_numpy(broadcast_along(scale, layer.weight_dq, layer.float_weight.ndim))
    zero_point = torch.from_numpy(broadcast_along(zero[0], layer.weight_dq, layer.float_weight.ndim)) if zero else 0
    bias = _bias(layer.node, quantized, inits, torch)
    weight = torch.from_numpy(layer.float_weight.astype(np.float32))
    floor = torch.floor(weight / scale)

    def output(w_int, inputs):
        out = forward(inputs, (w_int - zero_point) * scale, bias)
        return out.clamp(target.low, target.high) if target.low is not None or target.high is not None else out

    def error(w_int) -> float:
        with torch.no_grad():
            return float(((output(w_int, x) - y) ** 2).mean())

    rest = (weight / scale - floor).clamp(0.01, 0.99)  # AIMET's start: h(V) equals the fractional part
    v = (-torch.log((ZETA - GAMMA) / (rest - GAMMA) - 1)).requires_grad_(True)
    optimizer = torch.optim.Adam([v], lr=LEARNING_RATE)
    for step in range(iterations):
        batch = torch.from_numpy(rng.choice(len(x), size=min(BATCH, len(x)), replace=False))
        h = (torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA).clamp(0, 1)
        loss = ((output((floor + h).clamp(qmin, qmax), x[batch]) - y[batch]) ** 2).sum(1).mean()  # AIMET's: summed
        if step >= WARM_UP * iterations:  # over channels; the regulariser drives each h to 0 or 1 after the warm-up
            progress = (step - WARM_UP * iterations) / ((1 - WARM_UP) * iterations)
            beta = BETA_END + 0.5 * (BETA_START - BETA_END) * (1 + math.cos(progress * math.pi))
            loss = loss + REGULARIZER_WEIGHT * (1 - (2 * h - 1).abs().pow(beta)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    hard = (floor + (v.detach() >= 0).float()).clamp(qmin, qmax)
    return hard.numpy(), error(torch.from_numpy(nearest.astype(np.float32))), error(hard)


def _bias(node: onnx.NodeProto, quantized: onnx.ModelProto, inits: dict[str, onnx.TensorProto], torch):
    """The layer's bias as the Q/DQ graph computes it (int32 through a DequantizeLinear, or float), or None."""
    if len(node.input) < 3 or not node.input[2]:
        return None
    if node.input[2] in inits:
        return torch.from_numpy(numpy_helper.to_array(inits[node.input[2]]).astype(np.float32))
    producer = next((n for n in quantized.graph.node if node.input[2] in n.output), None)
    values = dequantized(producer, inits) if producer is not None and producer.op_type == "DequantizeLinear" else None
    if values is None:
        raise Unsupported(f"AdaRound: the bias of {node.name} is computed at run time")
    return torch.from_numpy(values.astype(np.float32))


def round_weights(float_path: Path, quantized_path: Path, samples: list[Sample], reduce_range: bool, iterations: int,
                  time_budget_s: float, cache: Path | None) -> str:
    """AdaRound the Q/DQ graph at `quantized_path` in place (see adaround): its weights symmetric int8 as every preset
    makes them, 7-bit where `reduce_range`. The rounding is learned once on the
    graph with every layer quantized and kept at `cache` (.npz): a build that keeps some layers in float (the rescue
    search makes many) reuses it for the layers that stay quantized instead of learning it again. Returns a line for
    the build's notes."""
    qmin, qmax = int8_weight_range(reduce_range)
    return learned_in_place(
        quantized_path, cache,
        lambda quantized: adaround(onnx.load(str(float_path)), quantized, samples, qmin=qmin, qmax=qmax,
                                   iterations=iterations, time_budget_s=time_budget_s),
        lambda applied, learned: f"AdaRound: the rounding learned for {learned} layers reused for the {applied} still "
                                 "quantized")
