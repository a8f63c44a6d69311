"""The GPU kit rehearsed on this machine (`make gpu-rehearsal`, and a slow test in CI): the one line a reviewer pastes
on the GPU machine (benchmarks.gpu_kit.DEVICE_LINE), run here with the network cut, in that machine's package set.

The GPU machine's Python is 3.12 with a CUDA torch, torchvision, triton, onnxscript, onnx, a CPU onnxruntime, numpy,
scipy, Pillow, click, rich, PyYAML, matplotlib, pytest, hypothesis and scikit-image, and no package registry. No CPU
build of torch for Python 3.12 is reachable from the development machines (only this Python's CPU wheel lies on
disk; PyPI's cp312 torch is a CUDA build, 502 MiB plus several GB of CUDA libraries), so the rehearsal runs twice:

1. Python 3.12 (found under pyenv, or on PATH; none is a clear failure): a fresh venv with that package set except
   torch, the cp312 wheelhouse (`make wheelhouse`, what travels) and the kit installed by DEVICE_LINE under
   `unshare -n` (no network); every module of accel_opt and the kit imported; the kit's own run records torch's
   absence and stops.
2. This Python with its CPU torch standing in for the CUDA one (torchvision absent: it does not load beside a CPU
   torch): the same package set and line, the kit's steps on the CPU with the tiny example model, each passed or
   skipped for want of a GPU.

Both times: what the kit wrote must all come back (at most 8 plain-named files of at most 16 MiB, at most one folder
deep), with summary.txt, summary.json, environment.json and the log archive among them, and the kit (the repository's
files that travel and the wheelhouse) must fit the 64 MiB a call carries.

    python scripts/gpu_rehearsal.py [--work DIR]      exit 0: rehearsed; 1: something the GPU machine would miss
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.gpu_kit import DEVICE_LINE, LOGS, output_problems  # noqa: E402

CARRY_LIMIT_BYTES = 64 * 2**20
GPU_PYTHON_VERSION = "3.12"
# The GPU machine's packages the kit's code paths import, torch aside (pinned per Python below: any other torch spec
# downloads a CUDA build of several GB).
GPU_MACHINE_PACKAGES = ["numpy", "scipy", "onnx", "onnxruntime", "onnxscript", "Pillow", "click", "rich", "PyYAML",
                        "matplotlib", "pytest", "hypothesis", "scikit-image"]
CPU_TORCH = "torch==2.13.0"  # this machine's CPU wheel (Python 3.11)
NOT_ON_THE_GPU_MACHINE = ("polygraphy", "onnxslim", "pydantic", "openvino", "ray", "model_signing", "torchao")
EXPECTED = ["summary.txt", "summary.json", "environment.json", LOGS]
# Every module of the package and the kit, imported in the venv: an import the GPU machine lacks fails here (torch
# and what comes with it are there, and absent from the 3.12 venv).
IMPORT_ALL = """
import importlib, pkgutil, sys, accel_opt
names = [m.name for m in pkgutil.walk_packages(accel_opt.__path__, 'accel_opt.') if not m.name.endswith('__main__')]
missing = {}
for name in names + ['benchmarks.gpu_kit', 'benchmarks.gpu_check', 'benchmarks.device_job']:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name not in ('torch', 'torchvision', 'triton'):
            missing[name] = exc.name
print(len(names), 'modules')
sys.exit(f'imports the GPU machine lacks: {missing}' if missing else 0)
"""


def sh(*command: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    print("$ " + " ".join(command), flush=True)
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env)
    if done.returncode:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
        raise SystemExit(f"gpu_rehearsal: FAILED: {' '.join(command)} (exit {done.returncode})")
    return done


def find_python(version: str) -> str:
    """A Python `version` interpreter: pyenv's (the development machines carry several beside their default), else
    one on PATH."""
    candidates = []
    if shutil.which("pyenv"):
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip()
        candidates += sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"), reverse=True)
    candidates += [found] if (found := shutil.which(f"python{version}")) else []
    for candidate in candidates:
        if subprocess.run([candidate, "-c", "import venv, ensurepip"], capture_output=True).returncode == 0:
            return candidate
    raise SystemExit(f"gpu_rehearsal: FAILED: no Python {version} found (looked under `pyenv root`/versions/"
                     f"{version}.* and for python{version} on PATH): the GPU machine runs {version}; install one "
                     f"(pyenv install {version}) to rehearse it")


def carried_bytes(wheelhouse: Path) -> tuple[int, int]:
    """What a device call carries: the files git would copy (tracked, and untracked but not ignored), and the
    wheelhouse named in `carry`."""
    listed = sh("git", "ls-files", "--cached", "--others", "--exclude-standard", "-z").stdout.split("\0")
    files = [ROOT / name for name in listed if name and (ROOT / name).is_file()]
    return sum(f.stat().st_size for f in files), sum(f.stat().st_size for f in wheelhouse.glob("*.whl"))


def rehearse(python: str, torch_spec: str | None, work: Path) -> Path:
    """A venv of `python` holding the GPU machine's packages, the kit installed and run by the one line with the
    network cut; the folder the kit wrote, its rules checked."""
    version = subprocess.run([python, "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
                             capture_output=True, text=True).stdout.strip()
    wheelhouse = work / f"wheelhouse-{version}"
    sh("make", "wheelhouse", f"WHEELHOUSE={wheelhouse}", f"WHEELHOUSE_PYTHON={version}", f"PYTHON={sys.executable}")
    env_dir = work / f"venv-{version}"
    sh(python, "-m", "venv", "--clear", str(env_dir))
    venv_python = str(env_dir / "bin" / "python")
    sh(venv_python, "-m", "pip", "uninstall", "--quiet", "-y", "setuptools")  # the kit must bring its own
    sh(venv_python, "-m", "pip", "install", "--quiet", *GPU_MACHINE_PACKAGES, *([torch_spec] if torch_spec else []))
    present = sh(venv_python, "-c", f"import importlib.util as u; print([m for m in {NOT_ON_THE_GPU_MACHINE!r} "
                 "if u.find_spec(m)])").stdout.strip()
    if present != "[]":
        raise SystemExit(f"gpu_rehearsal: FAILED: the venv holds packages the GPU machine lacks: {present}")

    results = work / f"results-{version}"
    line = DEVICE_LINE.format(python=venv_python, wheelhouse=wheelhouse)
    print(f"$ OUT={results} unshare -n sh -c {shlex.quote(line)}", flush=True)
    done = subprocess.run(["unshare", "-n", "sh", "-c", line], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OUT": str(results)})
    print(done.stdout[-5000:], done.stderr[-2000:], sep="\n")
    if not (results / "summary.json").is_file():
        raise SystemExit(f"gpu_rehearsal: FAILED: Python {version}: the line wrote no summary (exit {done.returncode})")
    imported = sh(venv_python, "-c", IMPORT_ALL).stdout.strip()
    print(f"gpu_rehearsal: Python {version}: imported {imported} and the kit's scripts")

    missing = [name for name in EXPECTED if not (results / name).is_file()]
    problems = output_problems(results)
    if missing or problems:
        raise SystemExit(f"gpu_rehearsal: FAILED: Python {version}: missing {missing}; would not come back: {problems}")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="keep the venvs, wheelhouses and results here (default: a temp dir)")
    args = parser.parse_args()
    work = (args.work or Path(tempfile.mkdtemp(prefix="accel-opt-gpu-rehearsal-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    gpu_python = find_python(GPU_PYTHON_VERSION)
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode:
        raise SystemExit("gpu_rehearsal: FAILED: `unshare -n` cannot cut the network here (it needs root or user "
                         "namespaces): the install could reach a registry the GPU machine does not have")

    # 1. The GPU machine's Python: the line installs and imports everything; the kit says torch is absent.
    results = rehearse(gpu_python, None, work)
    steps = {s["name"]: s for s in json.loads((results / "summary.json").read_text())["steps"]}
    if steps.get("environment", {}).get("status") != "passed" or "torch" not in steps:
        raise SystemExit(f"gpu_rehearsal: FAILED: Python {GPU_PYTHON_VERSION}: the kit's steps were {steps}")

    # 2. This Python, with a CPU torch: every step of the kit.
    results = rehearse(sys.executable, CPU_TORCH, work)
    summary = json.loads((results / "summary.json").read_text())
    failed = [f"{s['name']}: {s['status']} {s['detail']}" for s in summary["steps"]
              if s["status"] not in ("passed", "skipped")]
    names = [s["name"] for s in summary["steps"]]
    if failed or "device-job" not in names or not list(results.glob("device_job-cpu-*.txt")):
        raise SystemExit(f"gpu_rehearsal: FAILED: the kit's steps on the CPU: {failed or names}")

    repository, wheels = carried_bytes(work / f"wheelhouse-{GPU_PYTHON_VERSION}")
    print(f"gpu_rehearsal: the kit carries {(repository + wheels) / 2**20:.1f} MiB (repository "
          f"{repository / 2**20:.1f} "
          f"MiB, wheelhouse {wheels / 2**20:.1f} MiB) of the {CARRY_LIMIT_BYTES / 2**20:.0f} MiB a run may carry")
    if repository + wheels > CARRY_LIMIT_BYTES:
        raise SystemExit("gpu_rehearsal: FAILED: the kit is over the GPU machine's carry limit")
    print(f"gpu_rehearsal: passed: the one line installed the kit with the network cut on Python {GPU_PYTHON_VERSION} "
          f"and {sys.version_info[0]}.{sys.version_info[1]}, every step ran, and all it wrote would come back ({work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
