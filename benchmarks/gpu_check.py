"""The GPU check: what this GPU machine runs, measured the way the project measures (no TensorRT needed).

The GPU kit's second step (benchmarks/gpu_kit.py runs it with --quick).

PyTorch on CUDA with the examples' ResNet-50-layout classifier (examples/resnet_torch.py, seeded
weights, 224x224) at fp32 (TF32 off, so fp32 is fp32), fp16 autocast and bf16 autocast, batch 1, 8
and 32. Each call is H2D from pinned host memory, the forward pass, D2H into pinned memory, each
bracketed by CUDA events on one stream: the three are reported apart (trtexec's split), with the
peak of torch.cuda.max_memory_allocated. Warm-up is by time, then calls until the measuring time is
spent. Accuracy of fp16/bf16 against the fp32 outputs on the same inputs: cosine, max abs error,
top-1 agreement. TensorRT and ONNX Runtime's CUDA EP are reported as skipped, with why, when they
are not installed. Without a CUDA GPU it prints why and exits 0.

Self-contained: needs torch (a CUDA build) and numpy only; accel-opt need not be installed, except for --package
FOLDER, which also times a torch build's AOTInductor package loaded through accel-opt's runtime.
Run from the repository root: python -m benchmarks.gpu_check [--quick]; writes
benchmarks/results/gpu_check.json and gpu_check.txt. Budget: under 8 minutes (a deadline skips what
is left, saying so).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEADLINE_S = 7 * 60  # leaves a minute of the 8 for start-up and writing
BATCHES = (1, 8, 32)
PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass
class Timing:
    precision: str
    batch_size: int
    calls: int
    h2d_ms_p50: float
    compute_ms_p50: float
    compute_ms_p90: float
    d2h_ms_p50: float
    total_ms_p50: float
    images_per_s: float
    peak_memory_mib: float


@dataclass
class Accuracy:
    precision: str
    cosine: float
    max_abs_error: float
    top1_agreement: float


@dataclass
class Report:
    machine: dict
    timings: list[Timing] = field(default_factory=list)
    accuracy: list[Accuracy] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _load_example(torch):
    spec = importlib.util.spec_from_file_location("resnet_torch_example", ROOT / "examples" / "resnet_torch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.resnet50().eval()


def _autocast(torch, precision: str):
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    return torch.autocast("cuda", dtype=dtype) if dtype else torch.autocast("cuda", enabled=False)


def measure(torch, model, precision: str, batch: int, warmup_s: float, measure_s: float,
            autocast: bool = True) -> Timing:
    """Per call: pinned H2D, forward, D2H into pinned memory, each between CUDA events on one stream. `model` is any
    callable on a CUDA tensor (the eager module under autocast, or a built package with its own precision)."""
    stream = torch.cuda.Stream()
    host_in = torch.randn(batch, 3, 224, 224).pin_memory()
    device_in = torch.empty_like(host_in, device="cuda")
    host_out = torch.empty(batch, 1000).pin_memory()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    h2d, compute, d2h, total = [], [], [], []
    start = time.perf_counter()
    with torch.inference_mode(), torch.cuda.stream(stream), _autocast(torch, precision if autocast else "fp32"):
        while True:
            events[0].record(stream)
            device_in.copy_(host_in, non_blocking=True)
            events[1].record(stream)
            out = model(device_in)
            events[2].record(stream)
            host_out.copy_(out.float(), non_blocking=True)
            events[3].record(stream)
            events[3].synchronize()
            elapsed = time.perf_counter() - start
            if elapsed >= warmup_s:
                h2d.append(events[0].elapsed_time(events[1]))
                compute.append(events[1].elapsed_time(events[2]))
                d2h.append(events[2].elapsed_time(events[3]))
                total.append(events[0].elapsed_time(events[3]))
            if elapsed >= warmup_s + measure_s and len(total) >= 10:
                break
    p50 = statistics.median
    return Timing(precision, batch, len(total), p50(h2d), p50(compute), statistics.quantiles(compute, n=10)[-1],
                  p50(d2h), p50(total), batch * 1e3 / p50(total), torch.cuda.max_memory_allocated() / 2**20)


def accuracy(torch, model, precision: str, reference, inputs) -> Accuracy:
    with torch.inference_mode(), _autocast(torch, precision):
        got = model(inputs).float()
    a, b = got.flatten().double(), reference.flatten().double()
    cosine = float(torch.dot(a, b) / (a.norm() * b.norm()))
    top1 = float((got.argmax(1) == reference.argmax(1)).float().mean())
    return Accuracy(precision, cosine, float((got - reference).abs().max()), top1)


def package_timings(torch, folder: Path, warmup_s: float, measure_s: float) -> list[Timing]:
    """A torch build's AOTInductor package (an `accel-opt build --backend torch --device cuda` folder), loaded through
    accel-opt's runtime as deployed, timed like the eager module at every batch."""
    from accel_opt import runtime

    deployment = runtime.load(folder, trust_unsigned=True)
    label = f"package {deployment.config.precision.value}"
    with deployment.runner() as runner:
        def forward(x):
            return runner.infer_tensors([x])[0]

        return [measure(torch, forward, label, batch, warmup_s, measure_s, autocast=False) for batch in BATCHES]


def other_runtimes() -> dict[str, str]:
    """Why TensorRT and ONNX Runtime's CUDA EP are not measured here."""
    skipped = {}
    if importlib.util.find_spec("tensorrt") is None:
        skipped["tensorrt"] = "not installed (pip install 'accel-opt[tensorrt]'; libraries from NVIDIA's package index)"
    else:
        try:
            import tensorrt

            skipped["tensorrt"] = (f"TensorRT {tensorrt.__version__} is installed; this check does not build engines: "
                                   "run accel-opt build MODEL --backend tensorrt")
        except Exception as exc:  # the bindings without their libraries
            skipped["tensorrt"] = f"installed but does not import: {type(exc).__name__}: {exc}"
    try:
        import onnxruntime

        providers = onnxruntime.get_available_providers()
        if "CUDAExecutionProvider" in providers:
            skipped["onnxruntime-cuda"] = ("onnxruntime-gpu is installed; this check does not time it: run accel-opt "
                                           "with ONNX Runtime's CUDA EP")
        else:
            skipped["onnxruntime-cuda"] = (f"onnxruntime {onnxruntime.__version__} is the CPU build (providers: "
                                           f"{', '.join(providers)}); pip uninstall -y onnxruntime && pip install "
                                           "'accel-opt[gpu]'")
    except ImportError:
        skipped["onnxruntime-cuda"] = "onnxruntime is not installed"
    return skipped


def render(report: Report) -> str:
    lines = [f"gpu_check: {report.machine.get('gpu')} (compute capability {report.machine.get('compute_capability')}), "
             f"torch {report.machine.get('torch')}, CUDA {report.machine.get('cuda')}", ""]
    lines.append(f"{'precision':<9} {'batch':>5} {'calls':>6} {'h2d ms':>8} {'compute ms':>11} {'p90':>7} "
                 f"{'d2h ms':>7} {'total ms':>9} {'img/s':>9} {'peak MiB':>9}")
    for t in report.timings:
        lines.append(f"{t.precision:<9} {t.batch_size:>5} {t.calls:>6} {t.h2d_ms_p50:>8.3f} {t.compute_ms_p50:>11.3f} "
                     f"{t.compute_ms_p90:>7.3f} {t.d2h_ms_p50:>7.3f} {t.total_ms_p50:>9.3f} {t.images_per_s:>9.1f} "
                     f"{t.peak_memory_mib:>9.1f}")
    fp32 = {t.batch_size: t.compute_ms_p50 for t in report.timings if t.precision == "fp32"}
    ratios = [f"{t.precision} b{t.batch_size}: {fp32[t.batch_size] / t.compute_ms_p50:.2f}x"
              for t in report.timings if t.precision != "fp32" and t.batch_size in fp32]
    if ratios:
        lines += ["", "compute speed-up over fp32: " + ", ".join(ratios)]
    lines += ["", "accuracy vs fp32 (same inputs):"]
    lines += [f"  {a.precision}: cosine {a.cosine:.6f}, max abs error {a.max_abs_error:.4g}, top-1 agreement "
              f"{a.top1_agreement:.3f}" for a in report.accuracy]
    lines += ["", "skipped:"] + [f"  {name}: {why}" for name, why in report.skipped.items()]
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="0.3 s warm-up and 0.5 s per point")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--package", type=Path,
                        help="also time this torch build's AOTInductor package (a built folder)")
    args = parser.parse_args(argv)
    began = time.monotonic()
    try:
        import torch
    except ImportError:
        print("gpu_check: skipped: torch is not installed (this check needs a CUDA build of PyTorch)")
        return 0
    if not torch.cuda.is_available():
        print(f"gpu_check: skipped: no CUDA GPU visible to torch {torch.__version__} "
              "(" + ("a CPU build" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build, no device")
              + ")")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: TF32 rounds inputs to a 10-bit mantissa
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    props = torch.cuda.get_device_properties(0)
    report = Report(machine={
        "gpu": props.name, "compute_capability": f"{props.major}.{props.minor}",
        "gpu_memory_mib": props.total_memory // 2**20,
        "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(), "tf32": False, "model": "examples/resnet_torch.py:resnet50 (seeded)",
    })
    warmup_s, measure_s = (0.3, 0.5) if args.quick else (1.0, 2.0)
    model = _load_example(torch).cuda()
    inputs = torch.randn(32, 3, 224, 224, generator=torch.Generator().manual_seed(0)).cuda()
    with torch.inference_mode():
        reference = model(inputs).float()
    for precision in PRECISIONS:
        if precision == "bf16" and not torch.cuda.is_bf16_supported():
            report.skipped["bf16"] = f"{props.name} has no bf16 support"
            continue
        if precision != "fp32":
            report.accuracy.append(accuracy(torch, model, precision, reference, inputs))
        for batch in BATCHES:
            if time.monotonic() - began > DEADLINE_S:
                report.notes.append(f"deadline of {DEADLINE_S} s reached: {precision} batch {batch} and later not "
                                    "measured")
                break
            try:
                report.timings.append(measure(torch, model, precision, batch, warmup_s, measure_s))
            except torch.cuda.OutOfMemoryError:
                report.notes.append(f"{precision} batch {batch}: out of GPU memory")
                torch.cuda.empty_cache()
    if args.package is not None:
        try:
            report.timings += package_timings(torch, args.package, warmup_s, measure_s)
        except Exception as exc:  # noqa: BLE001 - the eager timings stand; say why the package's do not
            report.notes.append(f"package {args.package.name}: {type(exc).__name__}: {exc}")
    report.skipped.update(other_runtimes())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    text = render(report)
    (args.out / "gpu_check.txt").write_text(text)
    print(text, end="")
    print(f"wrote {args.out / 'gpu_check.json'} and gpu_check.txt in {time.monotonic() - began:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
