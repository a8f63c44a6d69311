"""Which precisions run faster than fp32 on this CPU, per backend: measured, not read off a table of flags.

A flag table said "int8: none faster" on an AVX2-only Zen 3 where a ResNet-50-layout int8 build ran 1.92x faster
than fp32 on ONNX Runtime; VNNI, AMX and the runtimes' kernels decide together, so the doctor times a small
convolutional network (a ResNet block stack at 112x112, batch 8; ~10 s in all) in each precision, interleaved, once
per CPU and tool versions, and caches the ratios in the user's cache (~/.cache/accel-opt/cpu-speed/)."""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from accel_opt.files import now_utc, tool_versions, user_cache_dir, write_json
from accel_opt.machine.cpu import CpuProfile, available_cpus

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
FASTER_ABOVE = 1.15  # a precision counts as faster than fp32 when its p50 is at least this much lower
ROUNDS, CALLS = 3, 8  # interleaved rounds x timed calls per variant
BATCH = 8
IMAGE_SIZE_PX = 112  # pixels: convolutions large enough that the kernels, not the call overhead, dominate


def _cache_path(cpu: CpuProfile) -> Path:
    identity = json.dumps({"cpu": cpu.record(), "tools": tool_versions(), "format": CACHE_FORMAT},
                          sort_keys=True)
    return user_cache_dir("cpu-speed") / f"{hashlib.sha256(identity.encode()).hexdigest()[:24]}.json"


def speedups(cpu: CpuProfile, refresh: bool = False) -> dict[str, dict[str, float]]:
    """{backend: {precision: fp32 p50 / precision p50}} measured on this CPU, whose profile is `cpu` (cached; `refresh`
    measures again)."""
    path = _cache_path(cpu)
    if not refresh:
        try:
            return json.loads(path.read_text())["speedups"]
        except (OSError, ValueError, KeyError):
            pass
    measured = _measure(cpu)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"cpu_class": cpu.cpu_class, "measured_utc": now_utc(),
                                    "speedups": measured})
    except OSError as exc:  # a read-only home: measured, not remembered
        log.warning("could not cache the CPU speed measurement: %s", exc)
    return measured


def faster_than_fp32(backend: str, table: dict[str, dict[str, float]]) -> list[str]:
    return ["fp32"] + [p for p, ratio in table.get(backend, {}).items() if p != "fp32" and ratio >= FASTER_ABOVE]


def _measure(cpu: CpuProfile) -> dict[str, dict[str, float]]:
    import importlib.util

    import onnxruntime as ort

    from accel_opt import zoo
    from accel_opt.precision.int8 import quantize
    from accel_opt.recipe.stages import CalibrationConfig

    threads = available_cpus()
    rng = np.random.default_rng(0)
    feed = {"image": rng.standard_normal((BATCH, 3, IMAGE_SIZE_PX, IMAGE_SIZE_PX), dtype=np.float32)}
    calibration = [{"image": rng.standard_normal((1, 3, IMAGE_SIZE_PX, IMAGE_SIZE_PX), dtype=np.float32)}
                   for _ in range(8)]
    runs: dict[tuple[str, str], object] = {}
    with tempfile.TemporaryDirectory(prefix="accel-opt-cpu-speed-") as tmp_name:
        tmp = Path(tmp_name)
        fp32 = zoo.save(zoo.resnet(layout=(1, 1), width=64, num_classes=10, image_size=IMAGE_SIZE_PX, seed=0),
                        tmp / "fp32.onnx")
        int8 = {}
        for backend in ("onnxruntime", "openvino"):
            if backend == "openvino" and importlib.util.find_spec("openvino") is None:
                continue
            int8[backend] = tmp / f"int8-{backend}.onnx"
            quantize(fp32, calibration, CalibrationConfig(samples=8), backend, int8[backend], None, cpu)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        for precision, path in (("fp32", fp32), ("int8", int8["onnxruntime"])):
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            runs[("onnxruntime", precision)] = lambda s=session: s.run(None, feed)
        if "openvino" in int8:
            import openvino as ov

            core = ov.Core()
            supported = core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
            config = {"INFERENCE_NUM_THREADS": threads}
            variants = [("fp32", fp32, "f32"), ("int8", int8["openvino"], "f32")]
            variants += [("bf16", fp32, "bf16")] if "BF16" in supported else []
            for precision, path, hint in variants:
                compiled = core.compile_model(str(path), "CPU", {**config, "INFERENCE_PRECISION_HINT": hint})
                runs[("openvino", precision)] = lambda c=compiled: c(feed)
        times: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
        for run in runs.values():
            run()  # warm-up
        for _ in range(ROUNDS):
            for key, run in runs.items():
                start = time.perf_counter()
                for _ in range(CALLS):
                    run()
                times[key].append((time.perf_counter() - start) / CALLS)
    p50 = {key: statistics.median(values) for key, values in times.items()}
    return {backend: {precision: round(p50[(backend, "fp32")] / p50[(b, precision)], 3)
                      for b, precision in p50 if b == backend}
            for backend in {b for b, _ in p50}}
