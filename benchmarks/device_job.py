"""The whole image job on the torch backend's device, against the jobs users write, and against the device's limits.

On generated JPEGs of mixed sizes (random crops of scikit-image's photos re-encoded at 320-800 px), one run builds the
example factory with `--backend torch` (ResNet-50 layout from examples/resnet_torch.py, or `--model tiny`) at each
precision and times, each from loading the model to the last answer written, in the same process:
- naive: Pillow decode + resize per image, the eager fp32 module, batch 1, one host-to-device copy per image;
- host preprocessing: the same Pillow decode + resize on reader threads, the fp32 package at its deployed batch;
- device (`accel-opt run` of each torch build): decoding on the device where it can (nvJPEG through torchvision on
  CUDA; Pillow on the host elsewhere), resize/crop/normalize as tensor ops there, only the top-k copied back;
- on a CPU, beside them, `accel-opt run` of the same factory built on ONNX Runtime and OpenVINO (fp32).
And the limits, measured alone in the same run: decoding every file (nvJPEG in batches on CUDA; Pillow on every core
elsewhere), host-to-device bandwidth from pinned memory (CUDA), the fp32 package alone at its deployed batch on a
tensor already on the device, and, on CUDA, the package replayed as a CUDA graph against called plainly. It prints
and writes (`--out`, default benchmarks/results/) each job's images/s and ratio to the naive job, top-1 agreement with
the naive job, the device job's stages with the slowest named and its fraction of the matching limit, naming the
GPU (or the CPU and its class).

    python -m benchmarks.device_job [--device cuda|cpu] [--model resnet50|tiny] [--count N] [--precisions fp32,bf16]
                                      [--summary FILE]

On the H200 (`--device cuda`) this is the script the GPU kit runs; `--device cpu --model tiny` is its own test. Each
build, job and limit runs on its own (one that raises is reported and the next runs) and the result file is rewritten
after each, so a run cut short keeps what it measured; the CUDA-graph ratio comes last.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MODELS = {"resnet50": (f"{ROOT / 'examples' / 'resnet_torch.py'}:resnet50", [1, 3, 224, 224]),
          "tiny": (f"{ROOT / 'examples' / 'tiny_models.py'}:cnn", [1, 3, 32, 32])}
QUICK_BENCH = {"warmup_iterations": 2, "min_iterations": 10, "min_seconds": 0.2, "max_iterations": 200,
               "concurrency": [1], "window_seconds": 0.1, "max_windows": 4}


def main() -> int:
    import torch

    from accel_opt.machine.cpu import CpuProfile, available_cpus
    from benchmarks.e2e_job import make_jpegs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when torch sees a GPU, else cpu")
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet50")
    parser.add_argument("--count", type=int, help="JPEGs in the job (default: 3000 on cuda, 300 on cpu)")
    parser.add_argument("--precisions",
                        help="torch builds (default: fp32,bf16 on cuda, and on a CPU with native bf16; else fp32)")
    parser.add_argument("--batch", type=int, default=32, help="the deployed batch of every build")
    parser.add_argument("--peers", default=None,
                        help="CPU only: other backends' jobs beside (default: onnxruntime,openvino; '' for none)")
    parser.add_argument("--workdir", type=Path, help="keep files here (default: a temp dir)")
    parser.add_argument("--jpegs", type=Path, help="a folder of JPEGs the job's files are cropped from (default: "
                        "scikit-image's photos; the GPU kit carries benchmarks/data/kit)")
    parser.add_argument("--recipe", default="image-classifier", help="the builds' recipe (default: image-classifier)")
    parser.add_argument("--calibration", type=int, default=64, help="images the builds calibrate, steer and judge on")
    parser.add_argument("--capacity-batch", type=int, help="each build's capacity run at this batch (--max-shapes)")
    parser.add_argument("--strict-device", action=argparse.BooleanOptionalAction, default=None,
                        help="every image of a device job decoded on the device, or the job fails (default: on cuda)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the result file goes")
    parser.add_argument("--summary", type=Path, help="also append one line per finished build and job to this file")
    args = parser.parse_args()

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("device_job: skipped: --device cuda, but torch sees no CUDA GPU")
        return 0
    cpu = CpuProfile.here()
    precisions = (args.precisions or ("fp32,bf16" if cuda or cpu.native_bf16 else "fp32")).split(",")
    peers = [] if cuda else [p for p in (args.peers if args.peers is not None
                                         else "onnxruntime,openvino").split(",") if p]
    count = args.count or (3000 if cuda else 300)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="accel-opt-device-job-"))
    work.mkdir(parents=True, exist_ok=True)
    factory, shape = MODELS[args.model]
    where = (f"{torch.cuda.get_device_name()} (compute {'.'.join(map(str, torch.cuda.get_device_capability()))}, "
             f"driver CUDA {torch.version.cuda})" if cuda else f"{cpu.model}, {available_cpus()} CPUs, class "
             f"{cpu.kernel_class('onnxruntime')}")
    label = torch.cuda.get_device_name().replace(" ", "_") if cuda else cpu.kernel_class("onnxruntime")
    report = Report(args.out / f"device_job-{device}-{args.model}-{label}.txt", args.summary)
    report.add(f"device_job on {device}: {where}; torch {torch.__version__}; {platform.python_version()}",
               f"model: {args.model} ({factory.rsplit('/', 1)[-1]}), input {shape[2]}x{shape[3]}; {count} JPEGs of "
               f"320-800 px; deployed batch {args.batch}")

    jobs = work / "job"
    sources = sorted(args.jpegs.glob("*.jpg")) if args.jpegs else None
    if not jobs.exists():
        make_jpegs(jobs, count, seed=1, sources=sources)
        make_jpegs(work / "calib", args.calibration, seed=2, sources=sources)
    files = sorted(jobs.iterdir())
    strict = cuda if args.strict_device is None else args.strict_device

    # Each build, job and limit on its own: one that raises is reported with its reason and the next runs, and every
    # result is written as it comes (a run cut short by its deadline still leaves what it measured).
    builds: dict[str, Path] = {}
    for backend, precision in [("torch", p) for p in precisions] + [(b, "fp32") for b in peers]:
        name = f"{backend} {precision}"
        folder = report.attempt(f"build {name}", _build, factory, shape, backend, precision, device, args.batch,
                                work, args.recipe, args.capacity_batch)
        if folder is not None:
            builds[name] = folder
    fp32 = builds.get("torch fp32")
    if fp32 is None:
        report.add("no torch fp32 build: nothing to time the jobs against")
        return 1
    limits = {"decode": report.attempt("decode limit", _decode_limit, files, device),
              "model": report.attempt("package limit", _model_limit, fp32, args.batch, device)}
    if cuda:
        limits["h2d"] = report.attempt("host-to-device limit", _h2d_limit, args.batch, shape)
    results = {"naive": report.attempt("naive job", _naive_job, factory, fp32, files, device),
               "host preprocessing": report.attempt("host preprocessing job", _host_job, fp32, files)}
    for name, folder in builds.items():
        label = f"device: accel-opt run {name}" if name.startswith("torch") else f"accel-opt run {name}"
        results[label] = report.attempt(label, _run_job, folder, jobs, work / f"{name.replace(' ', '-')}.jsonl",
                                       strict and name.startswith("torch"))
    results = {name: job for name, job in results.items() if job is not None}
    naive = results.get("naive")
    report.add("", f"{'job (from loading the model to the last answer)':58} {'seconds':>8} {'images/s':>9} "
               f"{'vs naive':>9} {'top-1 = naive':>14}")
    for name, job in results.items():
        agree = np.mean([job["top1"].get(f) == t for f, t in naive["top1"].items()]) if naive else float("nan")
        versus = naive["seconds"] / job["seconds"] if naive else float("nan")
        report.add(f"{name:58} {job['seconds']:8.2f} {count / job['seconds']:9.1f} {versus:8.2f}x {agree:14.1%}")
    report.add("", "limits, each measured alone:")
    if limits["decode"]:
        report.add(f"  decode every file ({'nvJPEG, batches of 64' if limits['decode'][1] else 'Pillow, every core'}): "
                   f"{limits['decode'][0]:.0f} images/s")
    if limits["model"]:
        report.add(f"  the fp32 package alone at batch {args.batch}, input already on {device}: {limits['model']:.0f} "
                   "images/s")
    if limits.get("h2d"):
        report.add(f"  host-to-device from pinned memory: {limits['h2d']:.1f} GB/s")
    for name in [n for n in results if n.startswith("device")]:
        job = results[name]
        stages = {k: v for k, v in job["summary"]["stages_seconds"].items() if k not in ("wait_for_inputs",)}
        slowest = job["summary"]["bottleneck"]  # of the job thread's stages (read runs on parallel reader threads)
        # The whole job's rate against the decode limit (no job over these files can beat decoding them), and the
        # compute stage's rate against the package alone.
        job_rate = count / job["seconds"]
        compute_rate = count / max(stages["compute"], 1e-9)
        report.add(f"{name}: stages (s; read is summed over reader threads) "
                   + ", ".join(f"{k} {v:.2f}" for k, v in stages.items())
                   + f"; slowest: {slowest}; host-decoded {job['summary']['host_decoded']} of {count}"
                   + (f" ({job['summary']['host_decoded_reasons']})" if job['summary']['host_decoded'] else "")
                   + (f"; the job at {job_rate / limits['decode'][0]:.0%} of the decode limit"
                      if limits["decode"] else "")
                   + (f", its compute at {compute_rate / limits['model']:.0%} of the package alone" if limits["model"]
                      else ""))
    if cuda:  # last: a capture that fails must not cost the numbers above
        graph = report.attempt("CUDA graph", _cuda_graph_ratio, fp32, args.batch)
        if graph:
            report.add(f"  the fp32 package replayed as a CUDA graph: {graph:.2f}x its plain call at batch "
                       f"{args.batch}")
    print(f"written: {report.path}")
    return 0 if len(builds) == len(precisions) + len(peers) and not report.failed else 1


class Report:
    """The result file, rewritten after every line so that a run cut short keeps what it measured; the same lines on
    stdout, and each finished step's one line appended to `summary` (the GPU kit's)."""

    def __init__(self, path: Path, summary: Path | None):
        self.path, self.summary, self.lines, self.failed = path, summary, [], []
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, *lines: str) -> None:
        self.lines += lines
        print("\n".join(lines), flush=True)
        self.path.write_text("\n".join(self.lines) + "\n")

    def attempt(self, what: str, step, *args):
        """step(*args), or None when it raised (the reason reported in one line); its time in the summary."""
        started = time.perf_counter()
        try:
            result = step(*args)
        except Exception as exc:  # noqa: BLE001 - one failed step must not cost the others' numbers
            self.failed.append(what)
            self.add(f"{what}: FAILED after {time.perf_counter() - started:.0f} s: {type(exc).__name__}: "
                     f"{str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}")
            self._summary(f"device-job {what}: failed in {time.perf_counter() - started:.0f} s: {type(exc).__name__}")
            return None
        self._summary(f"device-job {what}: done in {time.perf_counter() - started:.0f} s")
        return result

    def _summary(self, line: str) -> None:
        if self.summary is not None:
            with open(self.summary, "a") as f:
                f.write(f"  {line}\n")


def _build(factory: str, shape: list[int], backend: str, precision: str, device: str, batch: int, work: Path,
           recipe_name: str = "image-classifier", capacity_batch: int | None = None):
    from accel_opt.builder.pipeline import build
    from accel_opt.recipe.load import load_recipe

    capacity = {"image": [capacity_batch, *shape[1:]]} if capacity_batch else {}
    recipe = load_recipe(recipe_name).with_overrides(
        backend=backend, precision=precision, shapes={"image": shape},
        benchmark={**QUICK_BENCH, "batch_sizes": [batch], "max_shapes": capacity},
        **{"selection.target_batch_size": batch, "torch.device": device if backend == "torch" else None,
           "precision_options.fallback.enabled": False})
    started = time.perf_counter()
    result = build(factory, recipe, data_dir=work / "calib", out_dir=work / "artifacts")
    verdict = "signed off" if result.signed_off else f"NOT signed off: {result.failures[:1]}"
    print(f"built {backend} {precision} in {time.perf_counter() - started:.0f} s: {Path(result.artifact_dir).name}, "
          f"{verdict}", flush=True)
    return Path(result.artifact_dir)


def _run_job(folder: Path, jobs: Path, out: Path, strict_device: bool = False) -> dict:
    from accel_opt import runtime
    from accel_opt.runtime.local.job import run_job

    started = time.perf_counter()
    summary = run_job(runtime.load(folder, trust_unsigned=True, allow_not_signed_off=True), [jobs], out, overwrite=True,
                      strict_device=strict_device)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "summary": summary.model_dump(), "top1": _top1s(out)}


def _top1s(path: Path) -> dict[str, int]:
    """Top-1 per file name (the jobs list the same files by other paths)."""
    from benchmarks.e2e_job import top1s

    return {Path(name).name: top1 for name, top1 in top1s(path).items()}


def _naive_job(factory: str, folder: Path, files: list[Path], device: str) -> dict:
    """Pillow per image, the eager fp32 module at batch 1, one copy to the device per image."""
    import torch
    from PIL import Image

    from accel_opt import runtime
    from accel_opt.backends.torch.factory import load_factory
    from accel_opt.preprocess.images import preprocess_image

    pre = runtime.load(folder, trust_unsigned=True, allow_not_signed_off=True).config.preprocessing
    started = time.perf_counter()
    module = load_factory(factory)().to(device)
    top1 = {}
    with torch.inference_mode():
        for path in files:
            with Image.open(path) as img:
                pixels = preprocess_image(img.convert("RGB"), pre)
            logits = module(torch.from_numpy(pixels).to(device))
            top1[path.name] = int(logits.argmax())
    return {"seconds": time.perf_counter() - started, "top1": top1}


def _host_job(folder: Path, files: list[Path]) -> dict:
    """Pillow decode + resize on reader threads, the package at its deployed batch (a pinned copy per batch)."""
    from PIL import Image

    from accel_opt import runtime
    from accel_opt.data import concat_samples
    from accel_opt.preprocess.images import preprocess_image

    started = time.perf_counter()
    deployment = runtime.load(folder, trust_unsigned=True, allow_not_signed_off=True)
    pre, batch = deployment.config.preprocessing, deployment.batch_size

    def read(path: Path):
        with Image.open(path) as img:
            return preprocess_image(img.convert("RGB"), pre)

    top1 = {}
    with deployment.runner() as runner, ThreadPoolExecutor() as pool:
        pixels = list(pool.map(read, files))  # the readers run ahead of the model, as the job's do
        for start in range(0, len(files), batch):
            chunk = pixels[start:start + batch]
            feed = concat_samples([{"image": p} for p in chunk + [chunk[-1]] * (batch - len(chunk))], {"image": 0})
            logits = next(iter(runner.infer(feed, check_inputs=False).values()))
            for path, row in zip(files[start:start + batch], logits):
                top1[path.name] = int(np.argmax(row))
    return {"seconds": time.perf_counter() - started, "top1": top1}


def _decode_limit(files: list[Path], device: str) -> tuple[float, bool]:
    """Images/s decoding every file once: nvJPEG in batches of 64 where torchvision does it, else Pillow on every core
    (e2e_job's decode floor)."""
    from accel_opt.preprocess.tensor_images import device_decoder_available

    if device_decoder_available(device):
        import torch
        from torchvision.io import ImageReadMode, decode_jpeg

        data = [torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8) for p in files]
        decode_jpeg(data[:64], mode=ImageReadMode.RGB, device=device)  # warm-up
        torch.cuda.synchronize()
        started = time.perf_counter()
        for start in range(0, len(data), 64):
            decode_jpeg(data[start:start + 64], mode=ImageReadMode.RGB, device=device)
        torch.cuda.synchronize()
        return len(files) / (time.perf_counter() - started), True
    from benchmarks.e2e_job import decode_floor

    return len(files) / decode_floor(files[0].parent), False


def _model_limit(folder: Path, batch: int, device: str) -> float:
    """Images/s of the package alone at `batch`, its input already on the device (median of timed calls)."""
    import torch

    from accel_opt import runtime

    deployment = runtime.load(folder, trust_unsigned=True, allow_not_signed_off=True)
    shape = list(deployment.config.inputs[0].shape_used)
    shape[0] = batch
    with deployment.runner() as runner:
        x = torch.randn(*shape, device=device)
        times = []
        for i in range(30):
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            runner.infer_tensors([x])
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= 5:
                times.append(time.perf_counter() - started)
    return batch / statistics.median(times)


def _h2d_limit(batch: int, shape: list[int]) -> float:
    """GB/s of one batch of float32 images copied from pinned host memory (median of 20)."""
    import torch

    host = torch.randn(batch, *shape[1:]).pin_memory()
    times = []
    for _ in range(20):
        torch.cuda.synchronize()
        started = time.perf_counter()
        host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return host.numel() * 4 / statistics.median(times) / 1e9


def _cuda_graph_ratio(folder: Path, batch: int) -> float:
    """The fp32 package captured once as a CUDA graph and replayed, against called plainly: plain time / replay time.
    The package is loaded single-threaded: its default runner synchronizes through CUDA events, and an event query
    inside a capture fails it (cudaErrorStreamCaptureUnsupported)."""
    import torch

    from accel_opt import runtime
    from accel_opt.backends.torch.loader import load_package

    deployment = runtime.load(folder, trust_unsigned=True, allow_not_signed_off=True)
    shape = list(deployment.config.inputs[0].shape_used)
    shape[0] = batch
    model = load_package(torch, folder / deployment.config.model_file, 0, single_threaded=True)
    static = torch.randn(*shape, device="cuda")
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                model(static)  # warm-up on a side stream, as capture requires
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(static)

        def timed(call) -> float:
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(50):
                call()
            torch.cuda.synchronize()
            return (time.perf_counter() - started) / 50

        return timed(lambda: model(static)) / timed(graph.replay)


if __name__ == "__main__":
    sys.exit(main())
