"""The rescue of reduced precision on networks where it matters: the naive build, accel-opt's measured search, and
NNCF's accuracy-controlled quantization, side by side in one run.

The model is the trained mobile classifier of examples/mobile_classifier.py (depthwise-separable blocks,
squeeze-excitation, hard-swish/ReLU6, 36 classes, trained here in about three minutes). Builds use the
image-classifier recipe on --data made of other crops than the ones every variant is finally judged on. For each backend
(OpenVINO, ONNX Runtime) the run builds fp32, int8 with --no-fallback (naive), int8 with the search at the recipe's
budget, and int8 with the search's speed budget lifted (what it reaches when speed does not stop it); NNCF's
`quantize_with_accuracy_control` runs on the same fp32 model, calibration images and metric (top-1 agreement with fp32,
max drop 1%). Then every variant is judged on held-out images: top-1 agreement with the fp32 model, accuracy against the
true class, and speed against the same backend's fp32 at batch 1 and 8, timed in interleaved rounds in one run; and each
search's time.

    python -m benchmarks.rescue [--backends openvino,onnxruntime] [--held-out N] [--out DIR]
    python -m benchmarks.rescue --model minilm    # the real all-MiniLM-L6-v2, int8 on its recipe's backend"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MOBILE = f"{ROOT / 'examples' / 'mobile_classifier.py'}:mobile"
QUICK_BENCH = {"warmup_iterations": 2, "min_iterations": 10, "min_seconds": 0.2, "max_iterations": 200,
               "batch_sizes": [1, 8],
               "concurrency": [1], "window_seconds": 0.1, "max_windows": 4}
TIMED_BATCHES = (1, 8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="openvino,onnxruntime")
    parser.add_argument("--held-out", type=int, default=10, help="held-out crops per class (36 classes)")
    parser.add_argument("--per-class", type=int, default=8,
                        help="--data crops per class (288 by default: 64 calibrate, "
                        "32 steer, 192 judge each build's own held-out verdict)")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-nncf", action="store_true")
    parser.add_argument("--model", choices=["mobile", "minilm"], default="mobile")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "examples"))
    if args.model == "minilm":
        return minilm(args)
    import mobile_classifier as mc

    from accel_opt.machine.cpu import CpuProfile, cpu_info

    work = args.workdir or Path(tempfile.mkdtemp(prefix="accel-opt-rescue-"))
    work.mkdir(parents=True, exist_ok=True)
    if not mc.WEIGHTS.is_file():
        mc.train(mc.WEIGHTS)
    data, held = work / "data", work / "held-out"
    if not data.exists():
        mc.write_images(data, args.per_class, seed=7)  # the builds' calibration, steering and held-out images
    held_labels = mc.write_images(held, args.held_out, seed=11) if not held.exists() else \
        json.loads((work / "held-out-labels.json").read_text())
    (work / "held-out-labels.json").write_text(json.dumps(held_labels))
    cpu = cpu_info()
    lines = [f"rescue on {cpu['model']}, {cpu['available_cpus']} CPUs, class "
             f"{CpuProfile.here().kernel_class('onnxruntime')} "
             f"(OpenVINO: {CpuProfile.here().kernel_class('openvino')})",
             f"model: the trained mobile classifier (examples/mobile_classifier.py, 36 classes, 96x96); builds on "
             f"{len(list(data.iterdir()))} crops, judged here on {len(held_labels)} held-out crops", ""]
    print("\n".join(lines), flush=True)

    from accel_opt.builder.pipeline import build
    from accel_opt.recipe.load import load_recipe

    recipe = load_recipe("image-classifier").with_overrides(shapes={"image": [1, 3, 96, 96]}, benchmark=QUICK_BENCH)
    variants: dict[str, dict] = {}
    for backend in args.backends.split(","):
        for label, overrides in (("fp32", {"precision": "fp32"}),
                                 ("int8 naive", {"precision": "int8", "precision_options.fallback.enabled": False}),
                                 ("int8 + search", {"precision": "int8"}),
                                 ("int8 + search, speed budget lifted",
                                  {"precision": "int8", "precision_options.fallback.min_speedup": 0.01})):
            started = time.monotonic()
            result = build(MOBILE, recipe.with_overrides(backend=backend, **overrides), data_dir=data,
                           out_dir=work / "artifacts")
            folder = Path(result.artifact_dir)
            fallback = json.loads((folder / "build.json").read_text()).get("fallback") or {}
            accuracy = json.loads((folder / "accuracy.json").read_text())
            top1 = next((c["evidence"] for c in accuracy["checks"] if c["name"].endswith(": top1")
                         and c["evidence"]), None)
            variants[f"{backend} {label}"] = {
                "folder": folder, "signed_off": result.signed_off, "build_s": time.monotonic() - started,
                "verdict": result.verdict,
                "bound": f"{top1['lower']:.3f} ({top1['failures']}/{top1['trials']})" if top1 else "-",
                "search_s": fallback.get("search_seconds", 0.0), "status": fallback.get("status", "-"),
                "reason": fallback.get("reason", ""), "kept": len(fallback.get("kept", [])), "backend": backend}
            print(f"built {backend} {label}: {'signed off' if result.signed_off else 'NOT signed off'}"
                  + (f"; fallback {fallback['status']}: {fallback['reason']}"
                     if fallback.get("status") not in (None, "disabled") else ""),
                  flush=True)
    if not args.no_nncf and "openvino" in args.backends:
        started = time.monotonic()
        path, note = _nncf_accuracy_control(variants["openvino fp32"]["folder"], data, work)
        variants["openvino NNCF quantize_with_accuracy_control"] = {
            "path": path, "signed_off": None, "verdict": "-", "bound": "-", "build_s": time.monotonic() - started,
            "search_s": time.monotonic() - started,
            "status": note, "reason": "", "kept": None, "backend": "openvino"}
        print(f"NNCF accuracy control: {note} in "
              f"{variants['openvino NNCF quantize_with_accuracy_control']['search_s']:.0f} s",
              flush=True)

    samples = _held_out_samples(held, recipe)
    outputs, speeds = _evaluate(variants, samples, work)
    minimum = recipe.accuracy.task_metrics[0].min_agreement[1]
    lines += ["Each build's own verdict rests on its held-out share of --data (the bound: top-1 agreement's lower "
              "bound "
              f"at 95%, changed/judged); then every variant is judged here on {len(held_labels)} crops none of its "
              "stages "
              f"saw: does its top-1 agreement with fp32 hold the recipe's {minimum}?", ""]
    lines += [f"{'variant':52} {'verdict':>21} {'bound':>15} {'top-1 = fp32':>12} {'holds':>5} {'accuracy':>9} "
              + " ".join(f"{'vs fp32 b' + str(b):>11}" for b in TIMED_BATCHES) + f" {'search s':>9}  fallback"]
    for name, v in variants.items():
        fp32 = outputs[f"{v['backend']} fp32"]
        top1 = np.mean([a == b for a, b in zip(outputs[name], fp32)])
        accuracy = np.mean([a == y for a, y in zip(outputs[name], held_labels)])
        lines.append(f"{name:52} {v['verdict']:>21} {v['bound']:>15} {top1:12.1%} "
                     f"{'yes' if top1 >= minimum else 'NO':>5} {accuracy:9.1%} "
                     + " ".join(f"{speeds[name][b]:10.2f}x" for b in TIMED_BATCHES)
                     + f" {v['search_s']:9.0f}  {v['status']}{': ' + v['reason'] if v['reason'] else ''}")
    text = "\n".join(lines)
    print("\n".join(lines[3:]))
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"rescue-mobile-{CpuProfile.here().kernel_class('onnxruntime')}.txt"
    out.write_text(text + "\n")
    print(f"written: {out}")
    return 0


def minilm(args) -> int:
    """The real all-MiniLM-L6-v2 on examples/sentences.txt, int8 (MatMul/Gemm Q/DQ) on the text-encoder recipe's
    backend (OpenVINO): naive, the search at the recipe's budget, and with its speed budget lifted; each build's own
    gate (the embedding-cosine metric on the evaluation sentences), its speed against fp32 from the build's
    interleaved benchmark, and the search's steps and time."""
    import minilm as mini

    from accel_opt.builder.pipeline import build
    from accel_opt.machine.cpu import CpuProfile
    from accel_opt.recipe.load import load_recipe

    work = args.workdir or Path(tempfile.mkdtemp(prefix="accel-opt-rescue-minilm-"))
    feeds = work / "feeds"
    if not feeds.exists():
        mini.write_feeds(feeds)
    recipe = load_recipe("text-encoder").with_overrides(
        shapes={"input_ids": [1, 128], "attention_mask": [1, 128]}, benchmark=QUICK_BENCH,
        **{"precision_options.calibration.samples": 24})
    factory = f"{ROOT / 'examples' / 'minilm.py'}:minilm"
    lines = [f"rescue, all-MiniLM-L6-v2 on {len(list(feeds.iterdir()))} sentences (24 calibrate, the rest judge), "
             f"{recipe.backend.value} int8 on class {CpuProfile.here().kernel_class(recipe.backend)}", "",
             f"{'variant':40} {'signed off':>10} {'worst cosine':>12} {'vs fp32 b1':>10} {'vs fp32 b8':>10} "
             f"{'search s':>9}  fallback"]
    for label, overrides in (("int8 naive", {"precision_options.fallback.enabled": False}), ("int8 + search", {}),
                             ("int8 + search, speed budget lifted", {"precision_options.fallback.min_speedup": 0.01})):
        result = build(factory, recipe.with_overrides(precision="int8", **overrides), data_dir=feeds,
                       out_dir=work / "out")
        folder = Path(result.artifact_dir)
        fallback = json.loads((folder / "build.json").read_text()).get("fallback") or {}
        speed = {h.batch_size: h.speedup_vs_fp32 for h in result.headline}
        lines.append(f"{label:40} {'yes' if result.signed_off else 'no':>10} {result.worst_cosine:12.5f} "
                     + " ".join(f"{speed.get(b) or float('nan'):9.2f}x" for b in TIMED_BATCHES)
                     + f" {fallback.get('search_seconds', 0):9.0f}  {fallback.get('status', '-')}: "
                       f"{fallback.get('reason', '')}")
        print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"rescue-minilm-{CpuProfile.here().kernel_class(recipe.backend)}.txt"
    out.write_text("\n".join(lines) + "\n")
    print(f"written: {out}")
    return 0


def _held_out_samples(folder: Path, recipe) -> list[dict[str, np.ndarray]]:
    from accel_opt.data import load_samples
    from accel_opt.graph.inspect import TensorSpec
    from accel_opt.preprocess.fit import fit_preprocessing

    spec = TensorSpec(name="image", dtype="float32", shape=["batch", 3, 96, 96])
    fitted = fit_preprocessing(recipe, [spec], [])
    return load_samples(folder, [spec], fitted.preprocessing)[0]


def _nncf_accuracy_control(fp32_folder: Path, data: Path, work: Path) -> tuple[Path, str]:
    """NNCF's quantize_with_accuracy_control on the fp32 model the fp32 build exported: calibration and validation on
    the builds' images, the metric top-1 agreement with the fp32 model, at most 1% dropped."""
    import nncf
    import openvino as ov

    from accel_opt.recipe.load import load_recipe

    onnx_path = fp32_folder / "model.onnx"
    model = ov.Core().read_model(str(onnx_path))
    samples = _held_out_samples(data, load_recipe("image-classifier").with_overrides(shapes={"image": [1, 3, 96, 96]}))
    fp32 = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    references = [int(np.argmax(fp32(s["image"])[0])) for s in samples]
    calibration = nncf.Dataset(samples, lambda s: s["image"])
    validation = nncf.Dataset(list(zip(samples, references)), lambda pair: (pair[0]["image"], pair[1]))

    def agreement(compiled, items) -> float:
        return float(np.mean([int(np.argmax(compiled(x)[0])) == y for x, y in items]))

    quantized = nncf.quantize_with_accuracy_control(model, calibration, validation, validation_fn=agreement,
                                                    max_drop=0.01,
                                                    drop_type=nncf.DropType.ABSOLUTE, subset_size=len(samples))
    out = work / "nncf-qac.xml"
    ov.save_model(quantized, str(out), compress_to_fp16=False)
    return out, "quantized"


def _evaluate(variants: dict[str, dict], samples: list[dict],
              work: Path) -> tuple[dict[str, list[int]], dict[str, dict[int, float]]]:
    """Each variant's top-1 on the held-out samples, and its speed against its backend's fp32 at each timed batch, all
    targets of a backend timed in one interleaved run."""
    from accel_opt import runtime
    from accel_opt.backends.openvino.backend import OpenVinoBackend
    from accel_opt.bench import Target, run_benchmark
    from accel_opt.machine.cpu import available_cpus
    from accel_opt.recipe.schema import Recipe
    from accel_opt.recipe.stages import BenchmarkConfig
    from accel_opt.recipe.types import Precision

    runners = {}
    for name, v in variants.items():
        if "folder" in v:
            runners[name] = runtime.load(v["folder"], allow_not_signed_off=True).runner()
        else:
            backend = OpenVinoBackend()
            compiled = backend.compile(v["path"], Precision.int8, Recipe(dynamic_shapes=True), work / "nncf-compiled",
                                       shapes={"image": [1, 3, 96, 96]})
            runners[name] = backend.runner(compiled)
    outputs = {}
    for name, runner in runners.items():
        with runner:
            outputs[name] = [int(np.argmax(next(iter(runner.infer(s, check_inputs=False).values())))) for s in samples]
    speeds: dict[str, dict[int, float]] = {name: {} for name in variants}
    config = BenchmarkConfig(warmup_iterations=5, min_iterations=50, min_seconds=2.0, max_iterations=3000)
    for backend in {v["backend"] for v in variants.values()}:
        names = [n for n, v in variants.items() if v["backend"] == backend]
        fresh = {n: runtime.load(variants[n]["folder"], allow_not_signed_off=True).runner() if "folder" in variants[n]
                 else runners[n] for n in names}
        report = run_benchmark([Target(n, fresh[n]) for n in names], samples, list(TIMED_BATCHES), config,
                               available_cpus(), {"image": 0})
        by_label = {m.label: m for m in report.models}
        for n in names:
            for b in TIMED_BATCHES:
                speeds[n][b] = by_label[f"{backend} fp32"].at(b).latency.p50_ms / by_label[n].at(b).latency.p50_ms
    return outputs, speeds


if __name__ == "__main__":
    sys.exit(main())
