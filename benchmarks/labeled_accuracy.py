"""Accuracy on real labels, gated by its paired bound: scikit-learn's digits as an ImageFolder of PNGs and the demo's
photo crops with a labels CSV, each built at int8 and fp16 under both gates, side by side in one run.

- digits: the 1797 labeled 8x8 digits shipped with scikit-learn, rendered to 32x32 PNGs; a small CNN trained here on
  one half at a fixed seed (a few seconds), the other half the build's --data as an ImageFolder (--labels folders).
- demo: `make demo`'s classifier and its photo crops (.npz), each crop labeled with the photo it came from, as a
  file,label CSV (--labels FILE.csv).

Per build: fp32's and the candidate's top-1 on the held-out labels, the samples lost and gained, the drop and its
one-sided bound, top-1 agreement with fp32 (and its lower bound), and the verdict under `gate: both` (agreement and
labels) and `gate: labels` (labels alone).

    python -m benchmarks.labeled_accuracy [--max-drop 0.02] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
QUICK_BENCH = {"warmup_iterations": 1, "min_iterations": 5, "min_seconds": 0.05, "max_iterations": 50,
               "batch_sizes": [1, 8], "concurrency": [1], "window_seconds": 0.05, "max_windows": 4}
DIGIT_SIZE = 32
DIGIT_PRE = {"resize": DIGIT_SIZE, "crop": DIGIT_SIZE, "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}


def digits(workdir: Path, seed: int = 0) -> tuple[Path, Path]:
    """(the trained CNN as ONNX, the ImageFolder of the held-out half)."""
    import torch
    from PIL import Image
    from sklearn.datasets import load_digits
    from torch import nn

    from accel_opt.preprocess.images import preprocess_image
    from accel_opt.recipe.deployed import Preprocessing

    images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(labels))
    train, held = order[: len(order) // 2], order[len(order) // 2:]
    pre = Preprocessing(**DIGIT_PRE)

    def png(i: int) -> Image.Image:
        pixels = (images[i].reshape(8, 8) * (255 / 16)).astype(np.uint8)
        return Image.fromarray(pixels).resize((DIGIT_SIZE, DIGIT_SIZE), Image.NEAREST).convert("RGB")

    folder = workdir / "digits"
    for i in held:
        (folder / str(labels[i])).mkdir(parents=True, exist_ok=True)
        png(i).save(folder / str(labels[i]) / f"d{i:04d}.png")
    x = torch.from_numpy(np.concatenate([preprocess_image(png(i), pre) for i in train]))
    y = torch.from_numpy(labels[train]).long()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    for _ in range(8):  # epochs: ~97% on the held-out half
        for batch in torch.randperm(len(y)).split(64):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
    model.eval()
    path = workdir / "digits_cnn.onnx"
    torch.onnx.export(model, (x[:1],), str(path), dynamo=False, input_names=["image"], output_names=["logits"],
                      dynamic_axes={"image": {0: "N"}, "logits": {0: "N"}})
    return path, folder


def demo(workdir: Path) -> tuple[Path, Path, Path]:
    """(the demo classifier, its .npz photo crops, a CSV labeling each crop with its photo)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from demo import GROUPS_FILE, prepare

    model, data = prepare(workdir)
    rows = (workdir / GROUPS_FILE).read_text().splitlines()[1:]  # file,photoN: the photo is the crop's class
    csv = workdir / "labels.csv"
    csv.write_text("file,label\n" + "".join(f"{r.split(',')[0]},{r.split(',')[1].removeprefix('photo')}\n"
                                            for r in rows))
    return model, data, csv


def figures(folder: Path) -> dict:
    """What a build's accuracy.json says on the labels and on top-1 agreement."""
    accuracy = json.loads((folder / "accuracy.json").read_text())
    top1 = next(c["labeled"] for c in accuracy["checks"] if c["name"] == "labels: top-1 accuracy")
    agreement = next((c["evidence"] for c in accuracy["checks"] if c["name"].endswith(": top1")
                      and c["evidence"]), None)
    return {"labeled": top1, "agreement": agreement, "verdict": accuracy["verdict"]}


def run(name: str, model: Path, data: Path, source: str, recipe_name: str, overrides: dict, precision: str,
        gate: str, max_drop: float, out: Path) -> dict:
    from accel_opt import build, load_recipe

    recipe = load_recipe(recipe_name).with_overrides(**{
        **overrides, "precision": precision, "benchmark": QUICK_BENCH, "accuracy.labels.source": source,
        "accuracy.labels.max_drop": max_drop, "accuracy.labels.gate": gate})
    started = time.perf_counter()
    result = build(model, recipe, data_dir=data, out_dir=out / f"{name}-{precision}-{gate}")
    return {"data": name, "precision": precision, "gate": gate, "exit_code": result.exit_code,
            "seconds": round(time.perf_counter() - started, 1), **figures(Path(result.artifact_dir))}


def row(r: dict) -> list[str]:
    lab, agree = r["labeled"], r["agreement"]
    return [r["data"], r["precision"], r["gate"], f"{lab['reference_accuracy']:.2%}",
            f"{lab['candidate_accuracy']:.2%}",
            f"{lab['lost']}/{lab['gained']}", f"{lab['drop']:+.2%}", f"{lab['drop_bound']:+.2%}", str(lab["samples"]),
            "-" if agree is None else f"{agree['rate']:.1%} (>= {agree['lower']:.1%})",
            f"{r['verdict']} (exit {r['exit_code']})"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-drop", type=float, default=0.02, help="the absolute top-1 drop allowed (0.02: 2 points)")
    parser.add_argument("--precisions", default="int8,fp16")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from accel_opt.machine.cpu import CpuProfile

    cpu = CpuProfile.here()
    results = []
    with tempfile.TemporaryDirectory(prefix="accel-opt-labeled-") as tmp:
        work = Path(tmp)
        digit_model, digit_folder = digits(work)
        demo_model, demo_data, demo_csv = demo(work / "demo")
        sets = [("digits", digit_model, digit_folder, "folders",
                 {"preprocessing": {**DIGIT_PRE, "input": None}, "accuracy.max_samples": 2000}),
                ("demo", demo_model, demo_data, str(demo_csv), {})]
        for name, model, data, source, overrides in sets:
            for precision in args.precisions.split(","):
                for gate in ("both", "labels"):
                    print(f"building {name} {precision} gate={gate} ...", flush=True)
                    results.append(run(name, model, data, source, "image-classifier", overrides, precision, gate,
                                       args.max_drop, work / "out"))
    header = ["data", "precision", "gate", "fp32 top-1", "candidate top-1", "lost/gained", "drop", "drop bound",
              "held-out", "top-1 agreement", "verdict"]
    table = [header, *map(row, results)]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = [f"labeled accuracy, drop limit {args.max_drop:.0%} absolute, 95% confidence; CPU class {cpu.cpu_class} "
             f"({cpu.model}, {os.cpu_count()} vCPUs)", ""]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in table]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"labeled_accuracy-{cpu.cpu_class}.txt").write_text(text)
    (args.out / f"labeled_accuracy-{cpu.cpu_class}.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
