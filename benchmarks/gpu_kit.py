"""The GPU kit: what the GPU machine checks, in one call that brings its numbers back.

The GPU machine (an H200) has its own Python 3.12 with a CUDA torch, torchvision and onnxscript but no package
registry; a call carries at most 64 MiB, runs at most 10 minutes, and brings back only what lies in its output folder
(at most 8 files of 16 MiB each, two folders deep). The kit is this repository plus a wheelhouse of what that Python
lacks (`make wheelhouse`), installed there with pip --no-index, then this entry point under `timeout 540`: the one
line is DEVICE_LINE below (docs/backends.md quotes it). Each step is a child process with a share of the time left as
its timeout (one that fails or runs out is recorded and the next runs); cheap steps first, and every step's line is
appended to summary.txt as it finishes, so a call cut short still returns what it measured:

1. environment.json: Python, torch, CUDA, the GPU and its driver (nvidia-smi), torchvision's decoder, the packages;
2. gpu-check: benchmarks/gpu_check.py --quick (eager fp32/fp16/bf16 autocast, H2D/compute/D2H apart with CUDA
   events) -> gpu_check.txt and gpu_check.json;
3. gpu-tests: the tests marked `gpu` (their JUnit XML in the log archive);
4. device-job: benchmarks/device_job.py, the example ResNet-50 built with --backend torch for the device at fp32 and
   bf16 (one AOTInductor compile per precision: the bf16 build's fp32 baseline is the fp32 build's package), each
   build's gate judging the package against the eager fp32 module on held-out crops of the carried JPEGs
   (benchmarks/data/kit, the recipe benchmarks/gpu_kit.yaml) and its capacity run at batch 256; then the
   device-resident image job against a naive per-image job and a host-preprocessing job; the CUDA-graph ratio last
   -> device_job-*.txt, one line per build and job in summary.txt as each finishes;
5. verify --accuracy of each build, and doctor --json (in the log archive);
6. logs.tar.gz: every step's log, the builds' accuracy.json / signoff.md / benchmark.json, gpu-tests.xml
   (rewritten after every step, kept under 16 MiB);
7. summary.txt / summary.json: every step's status, seconds, exit code and files; the tables also go to stdout.

The work (JPEGs, packages of ~100 MB, builds) goes to a folder outside the output folder (--work, default a temp
folder). `--device cpu` runs the same steps on the CPU with the tiny example model: the rehearsal
(scripts/gpu_rehearsal.py) runs it in the GPU machine's package set, so that an import or a file the kit misses shows
here, not in a device start.

    python -m benchmarks.gpu_kit [--device cuda|cpu] [--out DIR] [--work DIR] [--deadline-s S]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KIT_JPEGS = ROOT / "benchmarks" / "data" / "kit"
KIT_RECIPE = ROOT / "benchmarks" / "gpu_kit.yaml"
PACKAGES = ("torch", "torchvision", "triton", "numpy", "onnx", "onnxruntime", "onnxscript", "polygraphy", "onnxslim",
            "pydantic", "pydantic-core", "click", "rich", "PyYAML", "Pillow", "scipy", "matplotlib", "pytest",
            "accel-opt")
# The one line pasted on the GPU machine, from the repository root with the wheelhouse beside it and $OUT the folder
# that comes back: install what its Python lacks without a registry, then the kit, all under the call's time.
DEVICE_LINE = ("timeout 540 sh -c '{python} -m pip install -q --no-index --no-deps {wheelhouse}/*.whl && "
               "{python} -m pip install -q --no-index --no-deps --no-build-isolation -e . && "
               "{python} -m benchmarks.gpu_kit --out \"$OUT\"'")
# What comes back from a call: files directly under the output folder or one folder below, at most this many, each
# at most this size, named plainly (the device tool leaves out links, odd names and what is too deep or too big).
OUTPUT_MAX_FILES, OUTPUT_MAX_FILE_BYTES, OUTPUT_MAX_DEPTH = 8, 16 * 2**20, 2
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
LOGS = "logs.tar.gz"
BUILD_REPORTS = ("accuracy.json", "signoff.md", "benchmark.json", "resource_config.json", "manifest.json")
# Per device: the model, JPEGs in the job, precisions, deployed batch, capacity batch, and the cheap steps' own caps.
PLANS = {"cuda": {"model": "resnet50", "count": 300, "precisions": "fp32,bf16", "batch": 32, "capacity": 256,
                  "gpu_check_s": 60, "gpu_tests_s": 90},
         "cpu": {"model": "tiny", "count": 48, "precisions": "fp32", "batch": 8, "capacity": 16, "gpu_check_s": 60,
                 "gpu_tests_s": 120}}
DEADLINE_S = 480  # the whole run: inside DEVICE_LINE's 540 s with the install before it and the archive after
RESERVE_S = 15  # kept back from every step for the summary and the archive


@dataclass
class Step:
    name: str
    status: str = "not run"  # passed, failed, timed out, skipped
    seconds: float = 0.0
    exit_code: int | None = None
    detail: str = ""
    files: list[str] = field(default_factory=list)

    def line(self) -> str:
        return f"{self.name:<28} {self.status:<10} {self.seconds:6.0f} s  {self.detail}".rstrip()


class Stopped(Exception):
    """The call's `timeout` sent SIGTERM: write what there is and stop."""


class Kit:
    def __init__(self, out: Path, work: Path, device: str, deadline_s: float):
        self.out, self.work, self.device = out, work, device
        self.deadline = time.monotonic() + deadline_s
        self.started = time.monotonic()
        self.steps: list[Step] = []
        self.facts: dict = {}
        (work / "logs").mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic() - RESERVE_S

    def record(self, step: Step) -> Step:
        """The step in the summary (its line appended to summary.txt now), the archive rewritten."""
        if not any(s is step for s in self.steps):
            self.steps.append(step)
        with open(self.out / "summary.txt", "a") as f:
            f.write(step.line() + "\n")
        print(f"gpu_kit: {step.line()}", flush=True)
        self.write_summary()
        self.write_logs()
        return step

    def run(self, name: str, command: list[str], cap_s: float | None = None, min_seconds: float = 20) -> Step:
        """One step as a child process, its output in the work folder's logs, a share of the time left as its
        timeout (`cap_s` at most)."""
        step = Step(name)
        self.steps.append(step)
        budget = min(self.left(), cap_s or float("inf"))
        if budget < min_seconds:
            step.status, step.detail = "skipped", f"{max(self.left(), 0):.0f} s left of the deadline"
            return self.record(step)
        started = time.monotonic()
        log_path = self.work / "logs" / f"{name}.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        with open(log_path, "w") as log:
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            child = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                step.exit_code = child.wait(timeout=budget)
                step.status = "passed" if step.exit_code == 0 else "failed"
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                step.status, step.detail = "timed out", f"its {budget:.0f} s ran out"
            except Stopped:
                child.kill()
                child.wait()
                step.status, step.detail = "timed out", "the call's timeout came first"
                step.seconds = round(time.monotonic() - started, 1)
                self.record(step)
                raise
        step.seconds = round(time.monotonic() - started, 1)
        if step.status == "failed":
            step.detail = _last_line(log_path)
        return step

    def write_summary(self) -> None:
        summary = {"device": self.device, "seconds": round(time.monotonic() - self.started, 1),
                   "gpu": self.facts.get("gpu"), "torch": self.facts.get("torch"), "python": platform.python_version(),
                   "kit_bytes": self.facts.get("kit_bytes"), "steps": [asdict(s) for s in self.steps]}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    def write_logs(self) -> None:
        """logs.tar.gz: the work folder's logs and the builds' reports, smallest first up to 16 MiB before
        compression (so the archive is well under the 16 MiB a file may bring back)."""
        members = [p for p in (self.work / "logs").rglob("*") if p.is_file()]
        members += [p for p in (self.work / "device-job" / "artifacts").glob("*/*") if p.name in BUILD_REPORTS]
        kept, total = [], 0
        for path in sorted(members, key=lambda p: p.stat().st_size):
            if total + path.stat().st_size <= OUTPUT_MAX_FILE_BYTES:
                kept.append(path)
                total += path.stat().st_size
        partial = self.out / f".{LOGS}.part"
        with tarfile.open(partial, "w:gz") as archive:
            for path in sorted(kept):
                archive.add(path, arcname=str(path.relative_to(self.work)))
        os.replace(partial, self.out / LOGS)


def environment(device: str) -> dict:
    """What this machine is and has: the facts every number of the run depends on."""
    from accel_opt.machine.cpu import CpuProfile, available_cpus

    cpu = CpuProfile.here()
    facts = {"python": platform.python_version(), "platform": platform.platform(), "device": device,
             "cpu": f"{cpu.model}, {available_cpus()} CPUs, class {cpu.cpu_class}", "packages": {},
             "kit_bytes": kit_bytes()}
    for name in PACKAGES:
        try:
            facts["packages"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            facts["packages"][name] = None
    if shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
        facts["nvidia_smi"] = query.stdout.strip() or query.stderr.strip()
    if importlib.util.find_spec("torch") is None:
        facts["torch"] = None
        return facts
    import torch

    facts.update(torch=torch.__version__, cuda_available=torch.cuda.is_available(), torch_cuda=torch.version.cuda)
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name()
        facts["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
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


def output_problems(out: Path) -> list[str]:
    """Why what lies under `out` would not all come back from a call: too many files, one too big, too deep, a link
    or special file, an odd name. Empty when everything would."""
    problems, files = [], []
    for path in sorted(out.rglob("*")):
        relative = path.relative_to(out)
        if any(not PLAIN_NAME.fullmatch(part) for part in relative.parts):
            problems.append(f"{relative}: not a plain name")
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            problems.append(f"{relative}: not a plain file or folder")
        elif path.is_file():
            files.append(relative)
            if len(relative.parts) > OUTPUT_MAX_DEPTH:
                problems.append(f"{relative}: deeper than {OUTPUT_MAX_DEPTH - 1} folder")
            if path.stat().st_size > OUTPUT_MAX_FILE_BYTES:
                problems.append(f"{relative}: {path.stat().st_size / 2**20:.1f} MiB, over 16 MiB")
    if len(files) > OUTPUT_MAX_FILES:
        problems.append(f"{len(files)} files, over {OUTPUT_MAX_FILES}: {', '.join(map(str, files))}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=sorted(PLANS), help="default: cuda when torch sees a GPU, else cpu")
    parser.add_argument("--out", type=Path,
                        help="the folder that comes back (default: benchmarks/results/gpu-kit-DEVICE)")
    parser.add_argument("--work", type=Path, help="builds, JPEGs and logs, outside --out (default: a temp folder)")
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S, help="the whole run's time (default: 480)")
    args = parser.parse_args()
    torch_installed = importlib.util.find_spec("torch") is not None
    cuda = False
    if torch_installed:
        import torch

        cuda = torch.cuda.is_available()
    device = args.device or ("cuda" if cuda else "cpu")
    if device == "cuda" and not cuda:
        print("gpu_kit: --device cuda, but torch sees no CUDA GPU (torch absent, a CPU build, or no driver)")
        return 4
    plan = PLANS[device]
    out = (args.out or ROOT / "benchmarks" / "results" / f"gpu-kit-{device}").resolve()
    work = (args.work or Path(tempfile.mkdtemp(prefix="accel-opt-gpu-kit-"))).resolve()
    if work == out or out in work.parents:
        print(f"gpu_kit: --work {work} lies inside --out {out}: the work (~100 MB packages) must not come back")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("summary.txt", "summary.json", LOGS):
        (out / stale).unlink(missing_ok=True)
    kit = Kit(out, work, device, args.deadline_s)

    def stop(signum, frame):
        raise Stopped()

    signal.signal(signal.SIGTERM, stop)
    try:
        steps(kit, plan, torch_installed)
    except Stopped:
        kit.record(Step("stopped", "timed out",
                        detail="SIGTERM (the call's timeout): the steps after this did not run"))
    finally:
        kit.write_summary()
        kit.write_logs()
        if args.work is None:  # a temp folder of builds and JPEGs: nothing in it comes back
            shutil.rmtree(work, ignore_errors=True)
    problems = output_problems(out)
    head = (f"gpu_kit on {device}: {kit.facts.get('gpu') or kit.facts.get('cpu')}; torch "
            f"{kit.facts.get('torch')}; Python {platform.python_version()}; {time.monotonic() - kit.started:.0f} s")
    print("\n" + head)
    print((out / "summary.txt").read_text(), end="")
    for table in [*sorted(out.glob("device_job-*.txt")), out / "gpu_check.txt"]:
        if table.is_file():
            print(f"\n--- {table.name}\n{table.read_text()}", end="")
    print(f"\nwritten: {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
    if problems:
        print("gpu_kit: what would not come back: " + "; ".join(problems))
    return 0 if all(s.status in ("passed", "skipped") for s in kit.steps) and not problems else 1


def steps(kit: Kit, plan: dict, torch_installed: bool) -> None:
    """The kit's steps, cheapest first."""
    out, work, python = kit.out, kit.work, sys.executable
    (out / "summary.txt").write_text(f"gpu_kit on {kit.device}, Python {platform.python_version()}, started "
                                     f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
    kit.facts = environment(kit.device)
    (out / "environment.json").write_text(json.dumps(kit.facts, indent=1) + "\n")
    kit.record(Step("environment", "passed", files=["environment.json"],
                    detail=f"torch {kit.facts['torch']}, {kit.facts.get('gpu') or 'no GPU'}, kit "
                           f"{kit.facts['kit_bytes'] / 2**20:.1f} MiB"))
    if not torch_installed:
        kit.record(Step("torch", "failed", detail="torch is not installed: every other step needs it"))
        return

    check = kit.run("gpu-check", [python, "-m", "benchmarks.gpu_check", "--quick", "--out", str(work / "gpu-check")],
                    cap_s=plan["gpu_check_s"])
    for name in ("gpu_check.txt", "gpu_check.json"):
        if (work / "gpu-check" / name).is_file():
            shutil.copy2(work / "gpu-check" / name, out / name)
            check.files.append(name)
    if check.status == "passed" and not check.files:  # it says why it measured nothing (no CUDA GPU)
        check.status, check.detail = "skipped", _last_line(work / "logs" / "gpu-check.log")
    kit.record(check)

    xml = work / "logs" / "gpu-tests.xml"
    tests = kit.run("gpu-tests", [python, "-m", "pytest", "-m", "gpu", "tests/backends", "-q", "-p", "no:cacheprovider",
                                  "-rs", f"--junitxml={xml}"], cap_s=plan["gpu_tests_s"], min_seconds=10)
    if tests.exit_code == 5:  # pytest: no test selected ran (every GPU test skipped on a CPU)
        tests.status = "passed"
    tests.detail = tests.detail or _junit_counts(xml)
    kit.record(tests)

    job_work = work / "device-job"
    results = work / "device-job-results"
    job = kit.run("device-job", [python, "-m", "benchmarks.device_job", "--device", kit.device, "--model",
                                 plan["model"], "--count", str(plan["count"]), "--precisions", plan["precisions"],
                                 "--batch", str(plan["batch"]), "--capacity-batch", str(plan["capacity"]), "--jpegs",
                                 str(KIT_JPEGS), "--recipe", str(KIT_RECIPE), "--peers", "", "--workdir",
                                 str(job_work), "--out", str(results), "--summary", str(out / "summary.txt")])
    for table in sorted(results.glob("device_job-*.txt")):  # written as it went: a step cut short keeps its lines
        shutil.copy2(table, out / table.name)
        job.files.append(table.name)
    folders = sorted(p for p in (job_work / "artifacts").glob("*-torch-*") if (p / "manifest.json").is_file())
    manifests = {folder: json.loads((folder / "manifest.json").read_text()) for folder in folders}
    verdicts = [f"{m['precision']} {'signed off' if m['signed_off'] else 'NOT signed off'}" for m in manifests.values()]
    job.detail = "; ".join(filter(None, [job.detail, ", ".join(verdicts)]))
    kit.record(job)

    for folder, manifest in manifests.items():
        kit.record(kit.run(f"verify-{manifest['precision']}",
                           [python, "-m", "accel_opt.cli", "verify", str(folder), "--accuracy", "--json",
                            "--trust-unsigned"]))
    kit.record(kit.run("doctor", [python, "-m", "accel_opt.cli", "doctor", "--json"], min_seconds=10))


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.is_file() else []
    return lines[-1][:300] if lines else ""


def _junit_counts(junit: Path) -> str:
    """'N passed, M skipped, ...' from pytest's JUnit XML (empty when it wrote none)."""
    if not junit.is_file():
        return ""
    from xml.etree import ElementTree

    suite = ElementTree.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return f"{passed} passed, {counts['skipped']} skipped, {counts['failures']} failed, {counts['errors']} errors"


if __name__ == "__main__":
    sys.exit(main())
