"""The real all-MiniLM-L6-v2, batch 8 x 128 tokens, real sentences: what accel-opt signs off vs what users run.

1. `build_auto` on the PyTorch factory (examples/minilm.py:minilm) with the text-encoder recipe:
   every (backend, precision) pair that makes sense here is exported, transformed, gated against
   the PyTorch module (cosine per sentence) and benchmarked; the table lists each with its speedup
   over PyTorch eager and over the same backend's fp32, measured in its own build.
2. The winner's model.onnx compiled as the pipeline compiles it, timed interleaved against ONNX
   Runtime fp32 with default session options and PyTorch eager, same threads, same inputs.

Run from the repository root: python -m benchmarks.minilm_speed [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from accel_opt import runtime
from accel_opt.bench import timed_calls
from accel_opt.builder.auto import build_auto
from accel_opt.recipe.load import load_recipe
from benchmarks._common import wait_for_idle

ROOT = Path(__file__).resolve().parent.parent
FACTORY = f"{ROOT / 'examples' / 'minilm.py'}:minilm"
BATCH, SEQUENCE, THREADS = 8, 128, 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0, help="per round and contender")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "examples"))
    import minilm
    import onnxruntime as ort
    import torch

    with tempfile.TemporaryDirectory(prefix="minilm-speed-") as tmp:
        work = Path(tmp)
        minilm.write_feeds(work / "feeds", max_length=SEQUENCE)
        recipe = load_recipe("text-encoder").with_overrides(
            shapes={"input_ids": [1, SEQUENCE], "attention_mask": [1, SEQUENCE]}, **{"benchmark.threads": THREADS}
        )
        start = time.perf_counter()
        winner, selection = build_auto(FACTORY, recipe, "auto", "auto", work / "feeds", work / "artifacts")
        print(f"accel-opt build --backend auto --precision auto: {time.perf_counter() - start:.0f} s, "
              f"{len(selection.candidates)} candidates; {selection.backend_reason}")
        print(f"{'backend':12} {'precision':9} {'signed':6} {'p50 ms b8':>9} {'vs fp32':>8} {'vs eager':>8} "
              f"{'cosine':>8}  verdict")
        for c in selection.candidates:
            ratios = {}
            if c.artifact_dir:
                bench = json.loads((Path(c.artifact_dir) / "benchmark.json").read_text())
                ratios = {k: v.get(str(BATCH)) for k, v in bench["speedup_vs_baseline"].items()}
            fp32 = next((v for k, v in ratios.items() if k.endswith("-fp32")), 1.0 if c.precision == "fp32" else None)
            eager = ratios.get("pytorch-eager")
            print(f"{c.backend:12} {c.precision:9} {'yes' if c.signed_off else 'no':6} "
                  f"{c.latency_p50_ms or float('nan'):9.1f} "
                  f"{fp32 or float('nan'):7.2f}x {eager or float('nan'):7.2f}x {c.cosine or float('nan'):8.5f}  "
                  f"{c.verdict[:90]}")
        if winner is None:
            print("no candidate signed off")
            return 1

        feeds = [dict(np.load(p)) for p in sorted((work / "feeds").glob("*.npz"))]
        feed = {k: np.concatenate([f[k] for f in feeds[:BATCH]]) for k in feeds[0]}
        runner = runtime.load(winner.artifact_dir).runner({k: v.dtype for k, v in feed.items()})
        runner.activate()
        exported = next(Path(c.artifact_dir) for c in selection.candidates
                        if c.artifact_dir and c.backend == "onnxruntime" and c.precision == "fp32")
        options = ort.SessionOptions()
        options.intra_op_num_threads = THREADS
        ort_fp32 = ort.InferenceSession(str(exported / "model.onnx"), options, providers=["CPUExecutionProvider"])
        torch.set_num_threads(THREADS)
        module = minilm.minilm()
        tensors = {k: torch.from_numpy(v) for k, v in feed.items()}

        def eager():
            with torch.inference_mode():
                return module(**tensors).numpy()

        contenders = {
            f"accel-opt ({winner.backend} {winner.precision})":
                lambda: next(iter(runner.infer(feed, check_inputs=False).values())),
            "ORT fp32, default session": lambda: ort_fp32.run(None, feed)[0],
            "PyTorch eager fp32": eager,
        }
        reference = eager()
        cosines = {name: float(np.min(np.sum(call() * reference, axis=1)
                                      / np.linalg.norm(call(), axis=1) / np.linalg.norm(reference, axis=1)))
                   for name, call in contenders.items()}
        medians: dict[str, list[float]] = {name: [] for name in contenders}
        busy = []
        for call in contenders.values():
            call()
        for _ in range(args.rounds):
            for name, call in contenders.items():
                busy.append(wait_for_idle())
                medians[name].append(statistics.median(timed_calls(call, 5, args.seconds, 1000)) * 1e3)
        runner.deactivate()

    ort_ms = statistics.median(medians["ORT fp32, default session"])
    print(f"\nMiniLM-L6, batch {BATCH} x {SEQUENCE} tokens, {THREADS} threads, {args.rounds} interleaved rounds "
          f"(CPU busy before blocks: median {statistics.median(busy):.0%}, max {max(busy):.0%})")
    print(f"{'contender':34} {'p50 ms':>8} {'vs ORT fp32':>11} {'worst cosine vs PyTorch':>24}")
    for name, values in medians.items():
        ms = statistics.median(values)
        print(f"{name:34} {ms:8.1f} {ort_ms / ms:10.2f}x {cosines[name]:24.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
