"""The GPU kit: everything the GPU machine checks, in one run that writes one results folder (`make gpu-check`).

The GPU machine (an H200) has its own Python 3.12 with a CUDA torch and torchvision but no package registry; the kit
is this repository plus a wheelhouse of what that Python lacks (`make wheelhouse`), installed there with
`make gpu-install` (pip --no-index --no-deps). Then, each step a child process with the time left as its timeout
(a step that fails or runs out is recorded, and the next runs):

1. environment.json: Python, torch, CUDA, the GPU and its driver (nvidia-smi), torchvision, the installed packages;
2. device-job: benchmarks/device_job.py builds the example classifier with --backend torch for the device
   (AOTInductor; fp32, fp16 and bf16 on CUDA), each build's gate judging the package against the eager fp32 module on
   every held-out image (the kit's recipe, benchmarks/gpu_kit.yaml, on crops of the carried JPEGs in
   benchmarks/data/kit) and its capacity run at a large batch; then times the device-resident image job (nvJPEG
   decode, resize, compute, top-k back; strict on CUDA: an image decoded on the host fails the job) against a naive
   per-image torch job and a host-preprocessing job, in the same run;
3. builds/: each build's accuracy.json, signoff.md and benchmark.json (its capacity run), copied;
4. verify-*.json: `accel-opt verify --accuracy` of each build on this device;
5. doctor.json: `accel-opt doctor --json`;
6. gpu_check: eager fp32/fp16/bf16 autocast timings and the fp16 build's AOTInductor package alone (H2D, compute,
   D2H apart, with CUDA events);
7. gpu-tests.xml: the tests marked `gpu`;
8. summary.json / summary.txt: every step's status, seconds, exit code and files.

`--device cpu` runs the same steps on the CPU with the tiny example model: the rehearsal (scripts/gpu_rehearsal.py)
runs it in a fresh venv holding only the GPU machine's packages, so that an import or file the kit misses shows here,
not in a device start.

    python -m benchmarks.gpu_kit [--device cuda|cpu] [--out DIR] [--deadline-s S]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KIT_JPEGS = ROOT / "benchmarks" / "data" / "kit"
KIT_RECIPE = ROOT / "benchmarks" / "gpu_kit.yaml"
PACKAGES = ("torch", "torchvision", "triton", "numpy", "onnx", "onnxruntime", "polygraphy", "onnxslim", "pydantic",
            "pydantic-core", "click", "rich", "PyYAML", "Pillow", "scipy", "matplotlib", "pytest", "accel-opt")
# Per device: the model, JPEGs in the job, precisions, deployed batch, capacity batch, the whole run's deadline.
# On the H200 the run must leave a rerun's worth of the 15 device minutes (a start costs one or two).
PLANS = {"cuda": {"model": "resnet50", "count": 600, "precisions": "fp32,fp16,bf16", "batch": 32, "capacity": 256,
                  "deadline_s": 360},
         "cpu": {"model": "tiny", "count": 48, "precisions": "fp32", "batch": 8, "capacity": 16, "deadline_s": 900}}


@dataclass
class Step:
    name: str
    status: str = "not run"  # passed, failed, timed out, skipped
    seconds: float = 0.0
    exit_code: int | None = None
    detail: str = ""
    files: list[str] = field(default_factory=list)


class Kit:
    def __init__(self, out: Path, deadline_s: float):
        self.out, self.deadline = out, time.monotonic() + deadline_s
        self.steps: list[Step] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, command: list[str], log: str | None = None, min_seconds: float = 20) -> Step:
        """One step as a child process, its output in OUT/LOG, the time left as its timeout."""
        step = Step(name)
        self.steps.append(step)
        if self.left() < min_seconds:
            step.status, step.detail = "skipped", f"{self.left():.0f} s left of the deadline"
            return step
        started = time.monotonic()
        log_path = self.out / (log or f"{name}.log")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        try:
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=self.left(), env=env)
            log_path.write_text(f"$ {' '.join(command)}\n{done.stdout}\n--- stderr ---\n{done.stderr}")
            step.exit_code = done.returncode
            step.status = "passed" if done.returncode == 0 else "failed"
            tail = (done.stderr or done.stdout).strip().splitlines()
            step.detail = tail[-1][:300] if tail and done.returncode else ""
        except subprocess.TimeoutExpired as exc:
            log_path.write_text(f"$ {' '.join(command)}\n{exc.stdout or ''}\n--- stderr ---\n{exc.stderr or ''}")
            step.status, step.detail = "timed out", "the deadline came first"
        step.seconds = round(time.monotonic() - started, 1)
        step.files.append(log_path.name)
        print(f"gpu_kit: {name}: {step.status} in {step.seconds:.0f} s {step.detail}", flush=True)
        return step


def environment(device: str) -> dict:
    """What this machine is and has: the facts every number of the run depends on."""
    import torch

    facts = {"python": platform.python_version(), "platform": platform.platform(), "device": device,
             "torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
             "packages": {}, "kit_bytes": kit_bytes()}
    for name in PACKAGES:
        try:
            facts["packages"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            facts["packages"][name] = None
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name()
        facts["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    if shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True)
        facts["nvidia_smi"] = query.stdout.strip() or query.stderr.strip()
    try:
        from torchvision.io import decode_jpeg  # noqa: F401 - the device decoder the image job needs on CUDA

        facts["torchvision_decode_jpeg"] = True
    except Exception as exc:  # noqa: BLE001 - ImportError, or torchvision's ops failing to load beside this torch
        facts["torchvision_decode_jpeg"] = f"not loadable: {type(exc).__name__}: {str(exc)[:200]}"
    return facts


KIT_SKIPS = {".git", ".venv", "artifacts", "__pycache__", ".pytest_cache", ".ruff_cache", "build", "dist", "results"}


def kit_bytes(root: Path = ROOT) -> int:
    """Bytes the kit carries: the repository's files and the wheelhouse (not .git, a venv, caches, build outputs or
    earlier results)."""
    total = 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in KIT_SKIPS and not d.endswith(".egg-info")]
        total += sum((Path(folder) / name).stat().st_size for name in files)
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=sorted(PLANS), help="default: cuda when torch sees a GPU, else cpu")
    parser.add_argument("--out", type=Path, help="the results folder (default: benchmarks/results/gpu-kit-DEVICE)")
    parser.add_argument("--deadline-s", type=float, help="the whole run's time (default: 360 on cuda, 900 on cpu)")
    args = parser.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_kit: --device cuda, but torch sees no CUDA GPU (a CPU build of torch, or no driver)")
        return 4
    plan = PLANS[device]
    out = (args.out or ROOT / "benchmarks" / "results" / f"gpu-kit-{device}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    kit = Kit(out, args.deadline_s or plan["deadline_s"])
    started = time.monotonic()

    facts = environment(device)
    (out / "environment.json").write_text(json.dumps(facts, indent=1))
    kit.steps.append(Step("environment", "passed", files=["environment.json"],
                          detail=f"torch {facts['torch']}, {facts.get('gpu') or 'no GPU'}"))
    python = sys.executable
    work = out / "device-job"
    job = kit.run("device-job", [python, "-m", "benchmarks.device_job", "--device", device, "--model", plan["model"],
                                 "--count", str(plan["count"]), "--precisions", plan["precisions"], "--batch",
                                 str(plan["batch"]), "--capacity-batch", str(plan["capacity"]), "--jpegs", str(KIT_JPEGS),
                                 "--recipe", str(KIT_RECIPE), "--peers", "", "--workdir", str(work),
                                 "--out", str(out)])
    job.files += sorted(p.name for p in out.glob("device_job-*.txt"))
    folders = sorted(p for p in (work / "artifacts").glob("*-torch-*") if (p / "manifest.json").is_file())
    builds = Step("builds", "passed" if folders else "failed", detail=f"{len(folders)} torch builds")
    kit.steps.append(builds)
    for folder in folders:
        keep = out / "builds" / folder.name
        keep.mkdir(parents=True, exist_ok=True)
        for name in ("accuracy.json", "signoff.md", "benchmark.json", "resource_config.json", "manifest.json"):
            if (folder / name).is_file():
                shutil.copy2(folder / name, keep / name)
        builds.files.append(f"builds/{folder.name}")
        verdict = json.loads((folder / "manifest.json").read_text())
        builds.detail += f"; {folder.name}: {'signed off' if verdict['signed_off'] else 'NOT signed off'}"
    for folder in folders:
        step = kit.run(f"verify-{folder.name}", [python, "-m", "accel_opt.cli", "verify", str(folder), "--accuracy",
                                                 "--json"], log=f"verify-{folder.name}.log")
        _json_of(out / step.files[-1], out / f"verify-{folder.name}.json", step)
    step = kit.run("doctor", [python, "-m", "accel_opt.cli", "doctor", "--json"])
    _json_of(out / step.files[-1], out / "doctor.json", step)
    fp16 = next((f for f in folders if "-fp16-" in f.name), None)
    check = kit.run("gpu-check", [python, "-m", "benchmarks.gpu_check", "--out", str(out),
                                  *(["--package", str(fp16)] if fp16 else [])])
    check.files += sorted(p.name for p in out.glob("gpu_check.*"))
    tests = kit.run("gpu-tests", [python, "-m", "pytest", "-m", "gpu", "tests/backends", "-q", "-p", "no:cacheprovider",
                                  "-rs", f"--junitxml={out / 'gpu-tests.xml'}"], min_seconds=10)
    if tests.exit_code == 5:  # pytest: no test selected ran (every GPU test skipped on a CPU)
        tests.status = "passed"
    tests.files.append("gpu-tests.xml")

    summary = {"device": device, "seconds": round(time.monotonic() - started, 1), "kit_bytes": facts["kit_bytes"],
               "steps": [asdict(s) for s in kit.steps]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [f"gpu_kit on {device}: {facts.get('gpu') or platform.processor() or 'CPU'}; torch {facts['torch']}; "
             f"Python {facts['python']}; {summary['seconds']:.0f} s; kit {facts['kit_bytes'] / 2**20:.1f} MiB"]
    lines += [f"  {s.name:<40} {s.status:<10} {s.seconds:6.0f} s  {s.detail}" for s in kit.steps]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"written: {out}")
    return 0 if all(s.status in ("passed", "skipped") for s in kit.steps) else 1


def _json_of(log: Path, target: Path, step: Step) -> None:
    """The JSON object a CLI step printed on stdout, saved as `target` (steps that printed none keep their log)."""
    text = log.read_text() if log.is_file() else ""
    stdout = text.split("\n--- stderr ---\n")[0].split("\n", 1)[-1]
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            target.write_text(line + "\n")
            step.files.append(target.name)
            return


if __name__ == "__main__":
    sys.exit(main())
