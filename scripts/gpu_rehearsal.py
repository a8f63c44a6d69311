"""The GPU kit rehearsed on this machine (`make gpu-rehearsal`, and a slow test in CI): what the GPU machine will do,
with nothing it lacks.

1. A wheelhouse made by `make wheelhouse` for this Python (the GPU machine's is made for 3.12 the same way).
2. A fresh venv holding only the GPU machine's package set (its Python has torch with CUDA, torchvision, triton, onnx,
   a CPU onnxruntime, numpy, Pillow, click, rich, PyYAML, matplotlib, pytest, hypothesis, scikit-image and the
   Hugging Face libraries, which the kit does not use). This machine's CPU torch stands in for the CUDA one;
   torchvision does not load beside a CPU torch, so its absence is part of the rehearsal. setuptools is removed: the
   kit must bring what its editable install needs.
3. The kit's size: the repository's files that travel with a run (tracked and untracked, not ignored) and the
   wheelhouse, against the GPU machine's 64 MiB limit.
4. The kit installed with `make gpu-install` (pip --no-index --no-deps), then `make gpu-check` with `--device cpu`.
5. Every result file present, every step passed (or skipped where a GPU is needed), no import error in any log.

    python scripts/gpu_rehearsal.py [--work DIR]      exit 0: rehearsed; 1: something the GPU machine would miss
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRY_LIMIT_BYTES = 64 * 2**20
# The GPU machine's packages the kit's code paths import (pinned where the CPU build of torch must come from this
# machine's wheel: any other torch spec downloads a CUDA build of several GB).
GPU_MACHINE_PACKAGES = ["torch==2.13.0", "numpy", "onnx", "onnxruntime", "Pillow", "click", "rich", "PyYAML",
                        "matplotlib", "pytest", "hypothesis", "scikit-image"]
EXPECTED = ["environment.json", "summary.json", "summary.txt", "doctor.json", "gpu-tests.xml", "device-job.log"]


def sh(*command: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    print("$ " + " ".join(command), flush=True)
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env)
    if done.returncode:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
        raise SystemExit(f"gpu_rehearsal: failed: {' '.join(command)} (exit {done.returncode})")
    return done


def carried_bytes(wheelhouse: Path) -> int:
    """What a device run carries: the files git would copy (tracked, and untracked but not ignored), and the
    wheelhouse named in `carry`."""
    listed = sh("git", "ls-files", "--cached", "--others", "--exclude-standard", "-z").stdout.split("\0")
    files = [ROOT / name for name in listed if name and (ROOT / name).is_file()]
    return sum(f.stat().st_size for f in files) + sum(f.stat().st_size for f in wheelhouse.glob("*.whl"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="keep the venv, wheelhouse and results here (default: a temp dir)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="accel-opt-gpu-rehearsal-"))
    work.mkdir(parents=True, exist_ok=True)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    wheelhouse = work / "wheelhouse"
    sh("make", "wheelhouse", f"WHEELHOUSE={wheelhouse}", f"WHEELHOUSE_PYTHON={version}", f"PYTHON={sys.executable}")

    env_dir = work / "venv"
    venv.create(env_dir, with_pip=True, clear=True)
    python = str(env_dir / "bin" / "python")
    sh(python, "-m", "pip", "uninstall", "--quiet", "-y", "setuptools")
    sh(python, "-m", "pip", "install", "--quiet", *GPU_MACHINE_PACKAGES)
    absent = sh(python, "-c", "import importlib.util as u; print([m for m in ('polygraphy', 'onnxslim', 'pydantic', "
                "'openvino', 'ray', 'model_signing', 'torchao', 'onnxscript') if u.find_spec(m)])").stdout.strip()
    if absent != "[]":
        raise SystemExit(f"gpu_rehearsal: the venv holds packages the GPU machine lacks: {absent}")

    size = carried_bytes(wheelhouse)
    print(f"gpu_rehearsal: the kit carries {size / 2**20:.1f} MiB (repository {(size - sum(f.stat().st_size for f in wheelhouse.glob('*.whl'))) / 2**20:.1f} "
          f"MiB, wheelhouse {sum(f.stat().st_size for f in wheelhouse.glob('*.whl')) / 2**20:.1f} MiB) of the "
          f"{CARRY_LIMIT_BYTES / 2**20:.0f} MiB a run may carry", flush=True)
    if size > CARRY_LIMIT_BYTES:
        raise SystemExit("gpu_rehearsal: the kit is over the GPU machine's carry limit")

    sh("make", "gpu-install", f"GPU_PYTHON={python}", f"WHEELHOUSE={wheelhouse}")
    results = work / "results"
    done = subprocess.run(["make", "gpu-check", f"GPU_PYTHON={python}", f"OUT={results}"], cwd=ROOT, capture_output=True,
                          text=True)
    print(done.stdout[-4000:], done.stderr[-2000:], sep="\n")
    missing = [name for name in EXPECTED if not (results / name).is_file()]
    missing += [] if list(results.glob("device_job-cpu-*.txt")) else ["device_job-cpu-*.txt"]
    missing += [] if list(results.glob("builds/*/accuracy.json")) else ["builds/*/accuracy.json"]
    missing += [] if list(results.glob("verify-*.json")) else ["verify-*.json"]
    broken = [log.name for log in results.glob("*.log")
              if "ModuleNotFoundError" in log.read_text() or "ImportError" in log.read_text()]
    if done.returncode or missing or broken:
        raise SystemExit(f"gpu_rehearsal: FAILED: exit {done.returncode}; missing {missing}; import errors in {broken}")
    print(f"gpu_rehearsal: passed: every step of the kit ran in the GPU machine's package set ({results})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
