"""Bias fitting of a Q/DQ int8 graph: every quantized layer's bias trained together so the graph's outputs come
closest to the float model's on the calibration samples, with the activations' and weights' rounding in the loop.

Bias correction moves each bias by the mean shift its own layer's rounded weights add, layer by layer; what the
rounded activations add, and what each layer's error does downstream, it leaves. Here the biases are trained as
quantization-aware training does (rounding's gradient passed straight through, torch_graph.py) against the float
model's outputs, a distillation without labels. Only the biases move: they are int32 at the scale of their layer's
input times its weights, so the graph stays the same standard Q/DQ with other biases. The integer weights were
tried too and left alone: trained on 48 EfficientNet-Lite0 crops they made the error on the 16 held back worse
after 50 steps (measured: 11,341 integers moved, 0.96x at best, then rising).

A quarter of the samples is held back from the fitting: the biases kept are those of the checkpoint with the lowest
output error there, and none are kept unless that beats the graph as it came. Measured on EfficientNet-Lite0 (64
calibration crops, 144 held out, 2-vCPU AMX host, benchmarks/ptq_mobile.py): logit RMS error of naive int8 0.201 ->
0.112 and top-1 agreement 86.8% -> 91.7% in 135 s (bias correction: 0.164, 90.3%; AdaRound: 0.074, 93.1% in 310 s);
after percentile + AdaRound + bias correction 0.077 -> 0.074, but 7 -> 9 changed (within chance). So it is a recipe
option, cheaper than AdaRound, and not a remedy the rescue search spends its budget on.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from accel_opt.data import Sample
from accel_opt.errors import Unsupported
from accel_opt.precision.qdq_weights import quantized_layers, restore_tensors, save_tensors

BATCH = 8
HELD_BACK = 0.25  # of the samples: judge the checkpoints, never fitted
CHECK_EVERY = 25  # steps between checkpoints
LEARNING_RATE = 1e-3  # Adam's, on the biases in their float units
# The torch form's output error against ONNX Runtime's, relative to the float outputs' RMS. Not 0: the two sum a
# convolution in another order, which moves a few activations across a rounding boundary (4 of 401,408 in
# EfficientNet-Lite0's first layer), and 50 layers on that is 4% of its logits' RMS (0.047, and 2 of 240 crops' top-1
# differ between ONNX Runtime's own optimized and unoptimized runs of the same graph). An operator read wrongly is
# far more.
TORCH_FORM_TOLERANCE = 0.1


def fit_biases(float_model: onnx.ModelProto, quantized: onnx.ModelProto, samples: list[Sample], *, steps: int,
               time_budget_s: float = float("inf"), seed: int = 0) -> tuple[dict[str, np.ndarray], str]:
    """Fit the biases of `quantized` (a Q/DQ graph of `float_model`, changed in place) to the float model's outputs on
    `samples` (see the module). Returns ({bias initializer: the values written}, a line for the build's notes)."""
    try:
        import torch
    except ImportError as exc:
        raise Unsupported("bias fitting needs PyTorch: pip install 'accel-opt[ptq]'") from exc
    from accel_opt.precision.torch_graph import TorchGraph

    start = time.monotonic()
    if len(samples) < 4:
        return {}, f"bias fit: skipped, {len(samples)} samples are too few to hold any back"
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    inits = {i.name: i for i in quantized.graph.initializer}
    biases = _biases(float_model, quantized, inits)
    if not biases:
        return {}, "bias fit: skipped, no quantized Conv/Gemm layer with a bias"
    trained = {tensor: torch.nn.Parameter(torch.from_numpy(values)) for tensor, (values, _) in biases.items()}
    graph = TorchGraph(quantized, trained)
    inputs = [i.name for i in quantized.graph.input if i.name not in inits]
    feeds = [{name: torch.from_numpy(np.asarray(s[name])) for name in inputs} for s in samples]
    targets = [[torch.from_numpy(t) for t in out] for out in _float_outputs(float_model, samples)]
    output_power = [float(torch.cat([t[k] for t in targets]).pow(2).mean()) or 1.0 for k in range(len(targets[0]))]

    def loss(indices: list[int]):  # the outputs' mean squared error, each in units of its own power
        outputs = graph({name: torch.cat([feeds[i][name] for i in indices]) for name in inputs})
        return sum(((out - torch.cat([targets[i][k] for i in indices])) ** 2).mean() / power
                   for k, (out, power) in enumerate(zip(outputs, output_power)))

    _check_torch_form(quantized, graph, samples[:BATCH], inputs, [t[0] for t in targets[:BATCH]], torch)
    order = rng.permutation(len(samples)).tolist()
    held_back_count = max(1, int(len(samples) * HELD_BACK))
    held_back, fitted = order[:held_back_count], order[held_back_count:]

    def held_back_loss() -> float:
        with torch.no_grad():
            chunks = [held_back[i: i + BATCH] for i in range(0, len(held_back), BATCH)]
            return sum(float(loss(chunk)) * len(chunk) for chunk in chunks) / len(held_back)

    optimizer = torch.optim.Adam(list(trained.values()), lr=LEARNING_RATE)
    baseline = best = held_back_loss()
    best_state, best_step, step = None, 0, 0
    for step in range(1, steps + 1):
        if time.monotonic() - start >= time_budget_s:
            step -= 1
            break
        optimizer.zero_grad()
        loss(rng.choice(fitted, size=min(BATCH, len(fitted)), replace=False).tolist()).backward()
        optimizer.step()
        if (step % CHECK_EVERY == 0 or step == steps) and (checked := held_back_loss()) < best:
            best, best_step = checked, step
            best_state = {tensor: p.detach().numpy().copy() for tensor, p in trained.items()}
    summary = (f"{step} steps of {BATCH} over {len(fitted)} samples, {len(held_back)} held back, "
               f"in {time.monotonic() - start:.1f} s")
    if best_state is None:
        return {}, f"bias fit: nothing kept, no checkpoint beat the graph as it came on the held-back samples ({summary})"
    written = {}
    for tensor, (_, stored) in biases.items():
        if stored is None:  # a float bias
            written[tensor] = best_state[tensor]
        else:
            name, scale = stored
            written[name] = np.clip(np.round(best_state[tensor] / scale), -2**31, 2**31 - 1).astype(np.int32)
    for name, values in written.items():
        inits[name].CopyFrom(numpy_helper.from_array(values, name))
    return written, (f"bias fit: the biases of {len(biases)} layers from step {best_step} kept, the held-back samples' output "
            f"error {best / baseline:.2f}x the graph's as it came ({summary})")


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


def _float_outputs(float_model: onnx.ModelProto, samples: list[Sample]) -> list[list[np.ndarray]]:
    import onnxruntime as ort

    session = ort.InferenceSession(float_model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return [session.run(None, {k: v for k, v in s.items() if k in names}) for s in samples]


def _check_torch_form(quantized: onnx.ModelProto, graph, samples: list[Sample], inputs: list[str], references,
                      torch) -> None:
    """Raise Unsupported where the torch form's first output is not ONNX Runtime's (an operator read differently):
    its gradients would fit another graph than the one that ships. `references`: the float model's, per sample."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the Q/DQ graph as written
    session = ort.InferenceSession(quantized.SerializeToString(), options, providers=["CPUExecutionProvider"])
    with torch.no_grad():
        ours = graph({name: torch.cat([torch.from_numpy(np.asarray(s[name])) for s in samples]) for name in inputs})[0]
    theirs = np.concatenate([session.run(None, {name: s[name] for name in inputs})[0] for s in samples])
    if tuple(ours.shape) != theirs.shape:
        raise Unsupported(f"bias fit: the torch form's output has shape {tuple(ours.shape)}, ONNX Runtime's "
                          f"{theirs.shape} (a batch of {len(samples)} fed)")
    difference = float(np.sqrt(np.mean((ours.numpy() - theirs) ** 2)))
    size = max(float(np.sqrt(np.mean(np.concatenate([r.numpy() for r in references]) ** 2))), 1e-6)
    if difference > TORCH_FORM_TOLERANCE * size:
        raise Unsupported(f"bias fit: the torch form's output differs from ONNX Runtime's by {difference:.3g} RMS, "
                          f"{difference / size:.0%} of the float output's")


def fit_file(float_path: Path, quantized_path: Path, samples: list[Sample], steps: int, time_budget_s: float,
             cache: Path | None = None) -> str:
    """fit_biases on the Q/DQ graph at `quantized_path`, in place. The fit is learned once, on the graph with every
    layer quantized, and kept at `cache` (.npz): a build that keeps some layers in float (the rescue search makes
    many) takes its biases for the layers still quantized instead of fitting again. Returns a line for the notes."""
    quantized = onnx.load(str(quantized_path))
    if cache is not None and cache.is_file():
        applied, fitted = restore_tensors(cache, {i.name: i for i in quantized.graph.initializer})
        note = f"bias fit: the biases fitted on the whole graph reused for {applied} of its {fitted} layers"
    else:
        written, note = fit_biases(onnx.load(str(float_path)), quantized, samples, steps=steps,
                                   time_budget_s=time_budget_s)
        if cache is not None:
            save_tensors(cache, written)
    onnx.save(quantized, str(quantized_path))
    return note
