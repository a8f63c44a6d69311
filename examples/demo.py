"""`make demo`: build the bundled example classifier at fp32, fp16 and int8 and show them side by side.

Everything is generated here, offline: a ResNet-layout classifier (optimizer/accel_opt/zoo.py) and real
photos shipped with scikit-image, preprocessed into .npz feed dicts for --data. Each build is the
same call `accel-opt build` makes; the table shows what each precision bought, measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from accel_opt import build, load_recipe, zoo
from accel_opt.errors import AccelOptError

IMAGE_SIZE = 128  # the demo model's input: small enough to build three precisions in about a minute


PHOTOS = 4  # JPEGs for `accel-opt run` in the README's tour
GROUPS_FILE = "photo-groups.csv"


def prepare(workdir: Path) -> tuple[Path, Path]:
    """Write the demo model, its photo data set and a few JPEGs to run the builds on (idempotent, deterministic)."""
    data_dir = workdir / "data"
    model_path = workdir / "demo_classifier.onnx"
    samples, labels = zoo.photo_dataset(IMAGE_SIZE)
    head = zoo.HEAD_TRAINING_COUNT
    if not model_path.exists():
        zoo.save(zoo.demo_classifier(head_training=(samples[:head], labels[:head])), model_path)
    samples, labels = samples[head:], labels[head:]  # the build calibrates and evaluates on images the head never saw
    if not data_dir.exists():
        data_dir.mkdir(parents=True)
        for i, sample in enumerate(samples):
            np.savez(data_dir / f"photo_{i:03d}.npz", **sample)
    groups = workdir / GROUPS_FILE  # the photo each crop came from (which is also its class): for --groups
    if not groups.exists():
        groups.write_text("file,group\n" + "".join(f"photo_{i:03d}.npz,photo{label}\n" for i,
                                                   label in enumerate(labels)))
    photos_dir = workdir / "photos"
    if not photos_dir.exists():
        from PIL import Image

        photos_dir.mkdir(parents=True)
        for name, photo in zip(("astronaut", "coffee", "chelsea", "rocket"), zoo._skimage_photos()[:PHOTOS]):
            Image.fromarray(photo).save(photos_dir / f"{name}.jpg", quality=90)
    return model_path, data_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("artifacts"))
    parser.add_argument("--precisions", default="fp32,fp16,int8")
    args = parser.parse_args()

    model_path, data_dir = prepare(args.out / "demo")
    print(f"model: {model_path} (ResNet layout, {IMAGE_SIZE}x{IMAGE_SIZE}); data: {len(list(data_dir.iterdir()))} "
          f"photos in {data_dir}")
    recipe = load_recipe("image-classifier")
    rows, exit_code = [], 0
    for precision in args.precisions.split(","):
        print(f"building {precision} ...", flush=True)
        try:
            result = build(model_path, recipe.with_overrides(precision=precision), data_dir=data_dir, out_dir=args.out)
        except AccelOptError as exc:
            rows.append((precision, "-", "-", "-", f"error (exit {exc.exit_code}): {exc}", "-"))
            exit_code = max(exit_code, exc.exit_code)
            continue
        by_batch = {h.batch_size: h for h in result.headline}
        speedups = " / ".join(f"{h.speedup_vs_fp32:.2f}x" for h in result.headline if h.speedup_vs_fp32 is not None)
        rows.append((
            precision,
            f"{by_batch[1].latency_p50_ms:.2f}" if 1 in by_batch else "-",
            f"{by_batch[8].latency_p50_ms:.2f}" if 8 in by_batch else "-",
            speedups or "-",
            ("signed off" if result.signed_off
             else f"NOT signed off ({result.verdict.outcome}, exit {result.exit_code})")
            + top1_evidence(result) + benefit_of(result),
            result.artifact_dir,
        ))

    header = ("precision", "p50 ms b1", "p50 ms b8", "speedup vs fp32 (b1 / b8)", "verdict", "artifacts")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)))
    photos = len({row.split(",")[1] for row in (model_path.parent / GROUPS_FILE).read_text().splitlines()[1:]})
    print(f"what the bounds cover: every sample is a crop of one of {photos} photos (each photo is also its class), "
          f"and calibration, steering and held-out crops come from the same {photos}: a bound above is a claim about "
          f"new crops of these photos, not about new photos. --groups {model_path.parent / GROUPS_FILE} deals whole "
          f"photos into the roles and counts held-out photos as the trials; {photos} photos are too few for any rate "
          "(exit 6).")
    # A gate that fails is a result the table shows, not a failed demo; errors are.
    return exit_code


def benefit_of(result) -> str:
    """A reduced precision's measured benefit, as its verdict judged it (the lower bound against the recipe's minimum).
    """
    benefit = result.verdict.benefit
    if benefit is None:
        return ""
    return (f"; benefit: lower bound {benefit.lower_bound or 0:.2f}x at batch {benefit.batch}, "
            f"minimum {benefit.min_speedup:.2f}x")


def top1_evidence(result) -> str:
    """What the held-out verdict rests on: top-1 agreement's lower bound and its counts (fp32: the observed rate)."""
    import json

    accuracy = json.loads((Path(result.artifact_dir) / "accuracy.json").read_text())
    top1 = next((c["evidence"] for c in accuracy["checks"] if c["name"].endswith(": top1") and c["evidence"]), None)
    if top1 is None:
        return ""
    if top1["status"] == "insufficient":
        return (f": {top1['trials']} held-out samples cannot show top-1 >= {top1['minimum']:.0%}, "
                f"{top1['needed']} needed")
    return (f": top-1 >= {top1['lower']:.1%} at {top1['confidence']:.0%} confidence ({top1['failures']} changed of "
            f"{top1['trials']} held-out)")


if __name__ == "__main__":
    sys.exit(main())
