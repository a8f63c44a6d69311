"""int8 Q/DQ (accel_opt.precision.int8, ort_cpu preset) vs fp32 on ONNX Runtime's CPU EP, ResNet-50 layout.

Builds the zoo ResNet-50 with a head trained on crops of real photos, quantizes it with `quantize()` on photo
samples disjoint from the evaluation photos, then times default ORT sessions (ORT_ENABLE_ALL,
2 intra-op threads) at batch 1 and 8. fp32 and int8 blocks alternate in rounds and each block
first waits for idle CPUs (/proc/stat), so a noisy neighbour shows in the noise columns instead
of in one variant's number. Targets: >= 2.5x at batch 8, top-1 agreement >= 99%, cosine >= 0.99,
quantization < 60 s.

Run from the repository root: python -m benchmarks.int8_speed [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from accel_opt import zoo
from accel_opt.backends.onnxruntime.backend import CPU_PROVIDER, create_session
from accel_opt.data import batch_of
from accel_opt.machine.cpu import CpuProfile
from accel_opt.precision.int8 import quantize
from accel_opt.recipe.stages import CalibrationConfig
from benchmarks._common import wait_for_idle

SIZE = 224
THREADS = 2
BATCHES = (1, 8)
TARGETS = {"speedup_b8": 2.5, "top1": 0.99, "cosine": 0.99, "quantize_s": 60.0}


def _split(photos: list[dict[str, np.ndarray]], calibration: int) -> tuple[list, list]:
    """Calibration first, evaluation the rest: disjoint samples (photo variants, see the note printed)."""
    if len(photos) <= calibration:
        raise SystemExit(f"only {len(photos)} photo samples; need more than {calibration}")
    return photos[:calibration], photos[calibration:]


def _time_block(session, feed: dict[str, np.ndarray], iterations: int) -> list[float]:
    session.run(None, feed)  # warm-up: first run allocates
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        session.run(None, feed)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _accuracy(fp32, int8, evaluation: list[dict[str, np.ndarray]]) -> dict[str, float]:
    ref = np.concatenate([fp32.run(None, s)[0] for s in evaluation]).astype(np.float64)
    got = np.concatenate([int8.run(None, s)[0] for s in evaluation]).astype(np.float64)
    # Over all samples together: a per-sample cosine is meaningless when a reference row is ~0.
    cosine = float((ref * got).sum() / (np.linalg.norm(ref) * np.linalg.norm(got)))
    rows = (ref * got).sum(1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1))
    top5 = np.argsort(-got, axis=1)[:, :5]
    return {
        "top1": float(np.mean(ref.argmax(1) == got.argmax(1))),
        "top5": float(np.mean([r in t for r, t in zip(ref.argmax(1), top5, strict=True)])),
        "cosine": cosine,
        "worst_row_cosine": float(rows.min()),
        "classes": float(len(set(ref.argmax(1)))),
    }


def _feature_error(fp32_path: Path, int8_path: Path, evaluation: list[dict[str, np.ndarray]]) -> float | None:
    """Relative int8 error at the classifier's input (the Flatten output): what the head then maps to logits."""
    model = onnx.load(str(fp32_path), load_external_data=False)
    name = next((n.output[0] for n in model.graph.node if n.op_type == "Flatten"), None)
    if name is None:
        return None
    features = []
    for path in (fp32_path, int8_path):  # Q/DQ insertion keeps the Flatten output's name
        probe = onnx.load(str(path))
        probe.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
        probe_path = zoo.save(probe, path.with_suffix(".probe.onnx"))
        session = create_session(probe_path, [CPU_PROVIDER], THREADS)
        features.append(np.concatenate([session.run([name], s)[0] for s in evaluation]))
    return float(np.linalg.norm(features[1] - features[0]) / np.linalg.norm(features[0]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few samples and rounds: checks the script works")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 6, quick 2)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the models here (default: a temp dir)")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 6)
    calibration_count = 16 if args.quick else 64
    iterations = {1: 5, 8: 2} if args.quick else {1: 30, 8: 6}

    photos, labels = zoo.photo_dataset(SIZE)
    head = zoo.HEAD_TRAINING_COUNT
    calibration, evaluation = _split(photos[head:], calibration_count)
    with tempfile.TemporaryDirectory(prefix="int8-speed-") as tmp_name:
        workdir = args.workdir or Path(tmp_name)
        workdir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        fp32_path = zoo.save(zoo.resnet(head_training=(photos[:head], labels[:head])), workdir / "resnet50.onnx")
        build_s = time.perf_counter() - start

        wait_for_idle()
        start = time.perf_counter()
        report = quantize(fp32_path, calibration, CalibrationConfig(samples=len(calibration)), "onnxruntime",
                          workdir / "resnet50-int8.onnx", cache_dir=None, cpu=CpuProfile.here())
        quantize_s = time.perf_counter() - start

        sessions = {
            "fp32": create_session(fp32_path, [CPU_PROVIDER], THREADS),
            "int8": create_session(workdir / "resnet50-int8.onnx", [CPU_PROVIDER], THREADS),
        }
        accuracy = _accuracy(sessions["fp32"], sessions["int8"], evaluation)
        feature_error = _feature_error(fp32_path, workdir / "resnet50-int8.onnx", evaluation)

        feeds = {b: batch_of(evaluation, b) for b in BATCHES}
        latencies = {(v, b): [] for v in sessions for b in BATCHES}
        round_medians = {(v, b): [] for v in sessions for b in BATCHES}
        busy_before: list[float] = []
        for r in range(rounds):
            for batch in BATCHES:
                # Alternate which variant goes first, so drift over a round does not favour one.
                order = list(sessions) if r % 2 == 0 else list(reversed(sessions))
                for variant in order:
                    busy_before.append(wait_for_idle())
                    times = _time_block(sessions[variant], feeds[batch], iterations[batch])
                    latencies[(variant, batch)].extend(times)
                    round_medians[(variant, batch)].append(statistics.median(times))

    print(f"ResNet-50 layout, {SIZE}x{SIZE}, ONNX Runtime CPU EP, {THREADS} intra-op threads, ORT_ENABLE_ALL")
    print(f"model build {build_s:.1f} s; quantize {quantize_s:.1f} s on {len(calibration)} photos "
          f"({report.calibration.preset}: {report.calibration.activation_type} activations, "
          f"{report.calibration.weight_type} per-channel weights, {report.calibration.method})")
    print(f"evaluation: {len(evaluation)} photo samples, disjoint from calibration (random crops of 9 photos, "
          f"none used to train the head); {int(accuracy['classes'])} distinct fp32 classes")
    print()
    print(f"{'batch':>5} | {'fp32 p50 ms':>11} | {'int8 p50 ms':>11} | {'speedup':>7} | {'fp32 noise':>10} | "
          f"{'int8 noise':>10}")
    print("-" * 70)
    speedups = {}
    for batch in BATCHES:
        p50 = {v: statistics.median(latencies[(v, batch)]) for v in sessions}
        noise = {}
        for v in sessions:
            medians = round_medians[(v, batch)]
            noise[v] = (max(medians) - min(medians)) / statistics.median(medians)
        speedups[batch] = p50["fp32"] / p50["int8"]
        print(f"{batch:>5} | {p50['fp32']:>11.1f} | {p50['int8']:>11.1f} | {speedups[batch]:>6.2f}x | "
              f"{noise['fp32']:>9.0%} | {noise['int8']:>9.0%}")
    print("(noise: spread of per-round medians, (max - min) / median)")
    noisy = sum(b > 0.15 for b in busy_before)
    print(f"CPU busy before blocks (other tenants, /proc/stat): median {statistics.median(busy_before):.0%}, "
          f"max {max(busy_before):.0%}; {noisy}/{len(busy_before)} blocks started above 15% after waiting")
    print()
    print(f"top-1 agreement {accuracy['top1']:.1%}, top-5 (fp32 top-1 in int8 top-5) {accuracy['top5']:.1%}, "
          f"cosine (all samples) {accuracy['cosine']:.5f}, worst sample {accuracy['worst_row_cosine']:.5f}")
    if feature_error is not None:
        print(f"int8 error at the classifier input (Flatten output): {feature_error:.2%} relative; "
              "the logits' error beyond that comes from how the head weights it")
    checks = {
        f"speedup at batch 8 >= {TARGETS['speedup_b8']}x": speedups[8] >= TARGETS["speedup_b8"],
        f"top-1 agreement >= {TARGETS['top1']:.0%}": accuracy["top1"] >= TARGETS["top1"],
        f"cosine >= {TARGETS['cosine']}": accuracy["cosine"] >= TARGETS["cosine"],
        f"quantization < {TARGETS['quantize_s']:.0f} s": quantize_s < TARGETS["quantize_s"],
    }
    for name, ok in checks.items():
        print(f"  [{'met' if ok else 'NOT MET'}] {name}")
    if args.quick:
        print("(--quick: few calibration samples and rounds; a check that the script works, not a measurement)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
