"""int8 saturation by CPU class: the same model quantized with 8-bit and 7-bit weights, judged and timed on each
kernel family this machine can run, interleaved in one run.

On AVX2 and AVX-512-without-VNNI CPUs the u8 x s8 kernels (VPMADDUBSW) sum pairs of products in int16 and
saturate; VNNI and AMX accumulate in int32. This host's own kernels run first; oneDNN's ISA cap
(ONEDNN_MAX_CPU_ISA=AVX2, set in a child process) then runs OpenVINO on the AVX2 kernels of the same CPU, and ONNX
Runtime's exact x64 path (session.x64quantprecision=1, u8u8) shows what the fix would cost there instead of 7 bits.

  python -m benchmarks.int8_saturation [--ppocr PATH/ch_PP-OCRv4_det_infer.onnx]

The PP-OCRv4 text detector comes from a package wheel (pip download rapidocr-onnxruntime==1.4.4 --no-deps, unzip);
it is fed generated document pages (benchmarks/real_models.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from accel_opt import zoo
from accel_opt.machine.cpu import CpuProfile, available_cpus, cpu_info
from accel_opt.precision.int8 import quantize
from accel_opt.recipe.stages import CalibrationConfig

REPEATS = 30  # timed calls per variant and round
ROUNDS = 3  # interleaved rounds; the median of the round medians is printed


def _ort(path: Path, exact: bool = False):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = available_cpus()
    if exact:
        options.add_session_config_entry("session.x64quantprecision", "1")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda feed: session.run(None, feed)[0]


def _openvino(path: Path):
    import openvino as ov

    compiled = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return lambda feed: compiled(feed)[0]


def measure(models: dict[str, Path], kernels: list[str], held_out: list[dict[str, np.ndarray]]) -> list[dict]:
    """Cosine and error (in units of the reference's std) against fp32 on `held_out`, and p50 ms at batch 1."""
    reference = _ort(models["fp32"])
    ref = np.concatenate([reference(x).ravel() for x in held_out])
    runners = {}
    for kernel in kernels:
        for name, path in models.items():
            if name != "fp32" or kernel == "ort":
                runners[(kernel, name)] = {"ort": _ort, "ort-exact": lambda p: _ort(p, exact=True),
                                           "openvino": _openvino}[kernel](path)
    rows = {key: {"kernels": key[0], "model": key[1], "ms": []} for key in runners}
    for _ in range(ROUNDS):  # interleaved: every variant once per round
        for key, run in runners.items():
            run(held_out[0])
            times = []
            for i in range(REPEATS):
                start = time.perf_counter()
                run(held_out[i % len(held_out)])
                times.append((time.perf_counter() - start) * 1e3)
            rows[key]["ms"].append(statistics.median(times))
    for key, run in runners.items():
        got = np.concatenate([run(x).ravel() for x in held_out])
        rows[key].update(cosine=float(got @ ref / (np.linalg.norm(got) * np.linalg.norm(ref))),
                         error=float(np.abs(got - ref).mean() / ref.std()), p50_ms=statistics.median(rows[key]["ms"]))
        del rows[key]["ms"]
    return list(rows.values())


def prepare(name: str, model_path: Path, samples: list[dict[str, np.ndarray]], folder: Path) -> dict[str, Path]:
    models = {"fp32": model_path}
    for target, label in (("amx", "int8 8-bit"), ("avx2", "int8 7-bit")):
        out = folder / f"{name}-{target}.onnx"
        quantize(model_path, samples[:32], CalibrationConfig(samples=32, target_cpu=target), "onnxruntime", out, None,
                 CpuProfile.here())
        models[label] = out
    return models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ppocr", type=Path, help="PP-OCRv4 detector (ch_PP-OCRv4_det_infer.onnx)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # json: models + kernels, run under the ISA cap
    args = parser.parse_args()
    if args.child:
        job = json.loads(Path(args.child).read_text())
        held_out = [dict(np.load(p)) for p in job["held_out"]]
        print(json.dumps(measure({k: Path(v) for k, v in job["models"].items()}, job["kernels"], held_out)))
        return

    print(f"CPU: {cpu_info()['model']}, class {CpuProfile.here().cpu_class}, {available_cpus()} CPUs")
    cases = {"saturating conv (zoo.saturating_conv)": (zoo.saturating_conv(), zoo.saturating_inputs(64))}
    if args.ppocr:
        from benchmarks.real_models import document_page, ppocr_input

        rng = np.random.default_rng(0)
        pages = [{"x": ppocr_input(document_page(320, rng))} for _ in range(48)]
        cases["PP-OCRv4 det, 320x320 pages"] = (args.ppocr, pages)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for title, (model, samples) in cases.items():
            slug = "".join(c for c in title if c.isalnum())[:16]
            model_path = zoo.save(model, tmp / f"{slug}.onnx") if not isinstance(model, Path) else model
            models = prepare(slug, model_path, samples, tmp)
            held_out = samples[32:]
            rows = measure(models, ["ort", "ort-exact", "openvino"], held_out)
            feeds = []
            for i, feed in enumerate(held_out):
                np.savez(tmp / f"{slug}-held{i}.npz", **feed)
                feeds.append(str(tmp / f"{slug}-held{i}.npz"))
            job = tmp / f"{slug}.json"
            job.write_text(json.dumps({"models": {k: str(v) for k, v in models.items()}, "kernels": ["openvino"],
                                       "held_out": feeds}))
            child = subprocess.run([sys.executable, "-m", "benchmarks.int8_saturation", "--child", str(job)],
                                   capture_output=True, text=True, env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"},
                                   check=True)
            for row in json.loads(child.stdout.strip().splitlines()[-1]):
                rows.append({**row, "kernels": "openvino, AVX2 cap"})
            fp32_ms = next(r["p50_ms"] for r in rows if r["model"] == "fp32")
            print(f"\n{title} ({len(held_out)} held-out inputs, batch 1; error in units of the fp32 output's std)")
            print(f"{'kernels':<20}{'weights':<12}{'cosine':>10}{'error':>9}{'p50 ms':>9}{'vs ORT fp32':>13}")
            for r in rows:
                print(f"{r['kernels']:<20}{r['model']:<12}{r['cosine']:>10.5f}{r['error']:>9.4f}{r['p50_ms']:>9.3f}"
                      f"{fp32_ms / r['p50_ms']:>12.2f}x")


if __name__ == "__main__":
    main()
