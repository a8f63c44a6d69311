"""The whole job, not the model: a naive image-classification job against `accel-opt run` of a signed-off build.

On the same real JPEG files (generated offline: random crops of scikit-image's photos, re-encoded at
320-800 px), one run measures, each as a whole process from start to exit (imports, model loading,
decoding, resizing, inference, writing):
- the naive job: Pillow decode + resize per image, ONNX Runtime fp32 at batch 1, one image after another;
- `accel-opt run` of the artifact `accel-opt build --backend auto --precision auto --recipe image-classifier`
  with normalization fused into the model (unless --host-preprocessing),
  signed off (calibrated and gated on other crops of the same photos);
- the decode floor: reading and decoding every file once on all cores, nothing else.
It prints the ratio, the top-1 agreement between the two jobs, each job's accuracy against the photo a
crop came from (the classifier's head is trained on other crops: real class margins), the bottleneck
`accel-opt run` reports, and a GEMM probe of the host state beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

from accel_opt import zoo
from accel_opt.machine.cpu import available_cpus, cpu_info
from accel_opt.recipe.load import load_recipe
from benchmarks._common import wait_for_idle

ROOT = Path(__file__).resolve().parent.parent
NAIVE_JOB = """
import json, sys
from pathlib import Path
import numpy as np, onnxruntime as ort
from PIL import Image
from accel_opt.preprocess.images import preprocess_image
from accel_opt.recipe import load_recipe
model, folder, out = sys.argv[1:4]
pre = load_recipe("image-classifier").preprocessing
options = ort.SessionOptions()
options.intra_op_num_threads = int(sys.argv[4])
session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
with open(out, "w") as f:
    for path in sorted(Path(folder).iterdir()):
        with Image.open(path) as img:
            x = preprocess_image(img.convert("RGB"), pre)
        logits = session.run(None, {"image": x})[0][0]
        f.write(json.dumps({"input": str(path), "top1": int(np.argmax(logits))}) + "\\n")
"""


def make_jpegs(folder: Path, count: int, seed: int, sources: list[Path] | None = None) -> list[int]:
    """`count` JPEGs of 320-800 px (longer side): random crops of the photos (scikit-image's, or the image files
    `sources`: the GPU kit carries its own); returns each file's photo."""
    folder.mkdir(parents=True)
    photos = [Image.open(p).convert("RGB")
              for p in sources] if sources else [Image.fromarray(p) for p in zoo._skimage_photos()]
    rng = np.random.default_rng(seed)
    labels = []
    for i in range(count):
        label = int(rng.integers(len(photos)))
        photo = photos[label]
        side = rng.uniform(0.5, 1.0)
        w, h = int(photo.width * side), int(photo.height * side)
        left, top = int(rng.integers(0, photo.width - w + 1)), int(rng.integers(0, photo.height - h + 1))
        crop = photo.crop((left, top, left + w, top + h))
        longer = int(rng.integers(320, 801))
        scale = longer / max(crop.size)
        crop = crop.resize((max(1, round(crop.width * scale)), max(1, round(crop.height * scale))), Image.BICUBIC)
        crop.save(folder / f"img_{i:04d}.jpg", quality=90)
        labels.append(label)
    return labels


def _decode(path: str) -> int:
    with Image.open(path) as img:
        img.load()
        return img.width


def decode_floor(folder: Path) -> float:
    """Seconds to read and decode every file once with a process per CPU (pool start-up included)."""
    files = [str(p) for p in sorted(folder.iterdir())]
    start = time.perf_counter()
    with ProcessPoolExecutor(available_cpus()) as pool:
        list(pool.map(_decode, files, chunksize=16))
    return time.perf_counter() - start


def cpu_ms_per_image(folder: Path, artifact: str, count: int = 100) -> dict[str, float]:
    """Where a job's CPU goes, per image on one core: decoding, the deployed host preprocessing after it
    (resize, crop and whatever is not fused), and the model (its p50 at the deployed batch from the build's
    benchmark, times its threads: the cores it holds while it runs)."""
    from accel_opt.artifact.config import RESOURCE_CONFIG, ResourceConfig
    from accel_opt.preprocess.images import decode_image, preprocess_image

    config = ResourceConfig.model_validate_json((Path(artifact) / RESOURCE_CONFIG).read_text())
    pre = config.preprocessing
    files = sorted(folder.iterdir())[:count]
    decode_s = preprocess_s = float("inf")
    for _ in range(2):  # the better of two passes: the first also warms caches
        start = time.perf_counter()
        decoded = []
        for path in files:
            with Image.open(path) as img:
                decoded.append(decode_image(img, pre))
        decode_s = min(decode_s, time.perf_counter() - start)
        start = time.perf_counter()
        for rgb in decoded:
            preprocess_image(rgb, pre.host_part())
        preprocess_s = min(preprocess_s, time.perf_counter() - start)
    bench = json.loads((Path(artifact) / "benchmark.json").read_text())
    point = next(p for p in bench["sweep"] if p["batch_size"] == config.batch_size and p["concurrency"] == 1)
    return {"decode": decode_s / count * 1e3, "host preprocessing": preprocess_s / count * 1e3,
            "model": point["p50_ms"] / config.batch_size * config.threads}


def timed(cmd: list[str]) -> tuple[float, str]:
    wait_for_idle()
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return seconds, done.stdout


def top1s(predictions: Path) -> dict[str, int]:
    return {line["input"]: line["top1"] for line in map(json.loads, predictions.read_text().splitlines())}


def gemm_probe_gflops(threads: int) -> float:
    """fp32 GEMM rate now (a 1024^3 matmul in numpy): the host state beside the ratios."""
    a = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return 2 * 1024**3 / best / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=500, help="JPEG files in the job")
    parser.add_argument("--model", choices=["resnet50", "light"], default="resnet50",
                        help="resnet50: compute-bound (8 GFLOP/image); light: a small ResNet where decoding dominates")
    parser.add_argument("--width", type=int,
                        help="the ResNet's first width (default: 64 for resnet50; 8 for light, 0.07 GFLOP/image: at "
                             "width "
                             "16, 0.23 GFLOP, its compute costs more CPU than decoding on a CPU without AMX)")
    parser.add_argument("--threads", type=int, default=available_cpus())
    parser.add_argument("--workdir", type=Path, help="keep files here (default: a temp dir)")
    parser.add_argument("--host-preprocessing", action="store_true",
                        help="normalize on the host, as the recipe does; by default the build fuses normalization into "
                             "the model (checked by the gate)")
    parser.add_argument("--draft-decode", action="store_true",
                        help="also decode JPEGs in draft mode (checked by the gate; little gain on 320-800 px files, "
                             "and its pixel differences fail the fp32 candidates' tolerance)")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="accel-opt-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    recipe = "image-classifier"
    fast_preprocessing = {**({} if args.host_preprocessing else {"preprocessing.fused": True}),
                          **({"preprocessing.draft_decode": True} if args.draft_decode else {})}
    if fast_preprocessing:
        import yaml

        recipe = str(work / "image-classifier-fast_preprocessing.yaml")
        Path(recipe).write_text(yaml.safe_dump(load_recipe("image-classifier").with_overrides(**fast_preprocessing).model_dump(mode="json")))
    bin_dir = Path(sys.executable).parent

    samples, labels = zoo.photo_dataset(224)
    head = zoo.HEAD_TRAINING_COUNT
    layout = {"resnet50": zoo.RESNET50_LAYOUT, "light": (1, 1, 1, 1)}[args.model]
    width = args.width or {"resnet50": 64, "light": 8}[args.model]
    model = zoo.save(zoo.resnet(layout=layout, width=width, head_training=(samples[:head], labels[:head])),
                     work / f"{args.model}.onnx")
    job_files, job_labels = work / "job", make_jpegs(work / "job", args.count, seed=1)
    calib_files = work / "calib"
    make_jpegs(calib_files, 128, seed=2)  # the build's calibration and gate images: not the job's

    start = time.perf_counter()
    build = subprocess.run([str(bin_dir / "accel-opt"), "build", str(model), "--backend", "auto", "--precision", "auto",
                            "--recipe", recipe, "--data", str(calib_files), "--out", str(work / "artifacts"),
                            "--json", "--threads", str(args.threads)], capture_output=True, text=True)
    build_seconds = time.perf_counter() - start
    if build.returncode != 0:
        raise SystemExit(f"accel-opt build failed ({build.returncode}): {build.stderr[-2000:]}")
    built = json.loads(build.stdout)
    artifact = built["artifact_dir"]

    floor = decode_floor(job_files)
    probe_before = gemm_probe_gflops(args.threads)
    naive_s, _ = timed([sys.executable, "-c", NAIVE_JOB, str(model), str(job_files), str(work / "naive.jsonl"),
                        str(args.threads)])
    run_s, run_out = timed([str(bin_dir / "accel-opt"), "run", artifact, str(job_files), "--out",
                            str(work / "run.jsonl"), "--overwrite", "--json"])
    probe_after = gemm_probe_gflops(args.threads)
    summary = json.loads(run_out)
    costs = cpu_ms_per_image(job_files, artifact)

    naive, fast = top1s(work / "naive.jsonl"), top1s(work / "run.jsonl")
    files = sorted(naive)
    agreement = np.mean([naive[f] == fast.get(f) for f in files])
    truth = dict(zip([str(job_files / f"img_{i:04d}.jpg") for i in range(args.count)], job_labels))
    naive_acc = np.mean([naive[f] == truth[f] for f in files])
    fast_acc = np.mean([fast.get(f) == truth[f] for f in files])

    cpu = cpu_info()
    print(f"host: {cpu['model']}, {cpu['available_cpus']} CPUs, flags {' '.join(cpu['flags'])}")
    print(f"model: {args.model} ({'x'.join(map(str, layout))} blocks, width {width}) at 224x224; {args.count} JPEGs of "
          "320-800 px")
    print(f"build ({build_seconds:.0f} s, not part of the job): {built['backend']} {built['precision']} signed off -> "
          f"{artifact}"
          + "".join(f"; {what} (checked by the gate)" for key,
                    what in [("preprocessing.fused", "normalization fused into the model"),
                                                                         ("preprocessing.draft_decode", "draft JPEG "
                                                                                                        "decoding")]
                    if key in fast_preprocessing))
    print()
    print(f"{'job (whole process)':42} {'seconds':>8} {'images/s':>9} {'vs naive':>9}")
    print(f"{'naive: Pillow + ORT fp32 batch 1, serial':42} {naive_s:8.2f} {args.count / naive_s:9.1f} {1.0:8.2f}x")
    print(f"{'accel-opt run (' + built['backend'] + ' ' + built['precision'] + ')':42} {run_s:8.2f} "
          f"{args.count / run_s:9.1f} "
          f"{naive_s / run_s:8.2f}x")
    print(f"{'decode floor: decode only, all cores':42} {floor:8.2f} {args.count / floor:9.1f} {naive_s / floor:8.2f}x")
    print()
    stages = summary["stages_seconds"]
    print(f"accel-opt run: {run_s / floor:.2f}x the decode floor; bottleneck: {summary['bottleneck']} "
          f"(read {stages['read']:.1f} s over {summary['workers']} threads, waited for inputs "
          f"{stages['wait_for_inputs']:.1f} s, compute {stages['compute']:.1f} s, write {stages['write']:.2f} s)")
    print(f"top-1 agreement, accel-opt run vs naive: {agreement:.1%}; accuracy vs the photo: naive {naive_acc:.1%}, "
          f"accel-opt run {fast_acc:.1%}")
    print("CPU per image (one core): " + ", ".join(f"{k} {v:.2f} ms" for k, v in costs.items())
          + f"; together {sum(costs.values()) / costs['decode']:.1f}x the decoding alone, on the same {args.threads} "
            "cores")
    print(f"host state: fp32 GEMM probe {probe_before:.0f} GFLOP/s before the jobs, {probe_after:.0f} after")
    target = 6.0 if args.model == "resnet50" else None
    if target:
        print(f"  [{'met' if naive_s / run_s >= target else 'NOT MET'}] >= {target}x the naive job: "
              f"{naive_s / run_s:.2f}x")
    else:
        print(f"  [{'met' if run_s <= 3 * floor else 'NOT MET'}] within 3x of the decode floor: {run_s / floor:.2f}x")
    print(f"  [{'met' if agreement >= 0.98 else 'NOT MET'}] top-1 agreement >= 98%: {agreement:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
