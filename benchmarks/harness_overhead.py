"""accel-opt's timing harness vs a bare `session.run` loop: same model, same threads, one run.

The harness (Polygraphy runner + per-call synchronize + perf_counter around the call) must stay
within 5% of the bare loop, or its latencies are not what the model costs. Exit 1 if it is not.

    python benchmarks/harness_overhead.py [--rounds 7] [--seconds 1.5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

from accel_opt import zoo
from accel_opt.backends.onnxruntime.backend import OnnxRuntimeBackend
from accel_opt.bench import Target, infer_and_sync, latency_stats, timed_calls
from accel_opt.machine.cpu import available_cpus
from accel_opt.recipe.load import load_recipe
from accel_opt.recipe.types import Precision
from benchmarks._common import wait_for_idle

LIMIT = 1.05


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=1.5, help="per round and contender")
    parser.add_argument("--threads", type=int, default=available_cpus())
    args = parser.parse_args()

    rows, worst = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        path = zoo.save(zoo.demo_classifier(), Path(tmp) / "demo.onnx")
        recipe = load_recipe().with_overrides(**{"benchmark.threads": args.threads})
        backend = OnnxRuntimeBackend()
        runner = backend.runner(backend.compile(path, Precision.fp32, recipe, Path(tmp)))
        runner.activate()
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        bare = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        for batch in (1, 8):
            feed = {"image": np.random.default_rng(0).standard_normal((batch, 3, 128, 128), dtype=np.float32)}
            harness_call = infer_and_sync(Target("accel-opt", runner, backend.synchronize), feed)
            bare_call = lambda feed=feed: bare.run(None, feed)  # noqa: E731
            for _ in range(5):
                harness_call(), bare_call()
            times = {"accel-opt": [], "bare": []}
            busy = []
            for _ in range(args.rounds):
                busy.append(wait_for_idle())
                times["accel-opt"] += timed_calls(harness_call, 10, args.seconds, 100000)
                times["bare"] += timed_calls(bare_call, 10, args.seconds, 100000)
            h, b = latency_stats(times["accel-opt"]), latency_stats(times["bare"])
            ratio = h.p50_ms / b.p50_ms
            worst = max(worst, ratio)
            rows.append((batch, h.p50_ms, b.p50_ms, ratio, h.iterations, b.iterations, max(busy)))
        runner.deactivate()

    print(f"demo classifier (ResNet layout, 128x128), {args.threads} threads, {args.rounds} interleaved rounds")
    print(f"{'batch':>5} {'accel-opt p50 ms':>17} {'bare p50 ms':>12} {'ratio':>7} {'iters':>13} {'max busy':>9}")
    for batch, hp, bp, ratio, hi, bi, busy in rows:
        print(f"{batch:>5} {hp:>17.3f} {bp:>12.3f} {ratio:>7.3f} {hi:>6}/{bi:<6} {busy:>8.0%}")
    verdict = "within" if worst <= LIMIT else "OUTSIDE"
    print(f"harness overhead: worst ratio {worst:.3f} ({verdict} the {LIMIT:.2f} limit)")
    return 0 if worst <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
