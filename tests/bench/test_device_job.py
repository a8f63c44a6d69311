"""benchmarks/device_job.py runs end to end on the CPU as a test of itself: every job, stage, limit and ratio printed
and written (the same script measures the H200 with --device cuda)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch extra: pip install '.[torch]' torch==2.13.0")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_device_job_script_runs_on_the_cpu_and_reports_every_stage(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.device_job", "--device", "cpu", "--model",
                           "tiny", "--count",
                           "24", "--batch", "8", "--peers", "onnxruntime", "--workdir", str(tmp_path / "work"), "--out",
                           str(tmp_path / "results")], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (written,) = (tmp_path / "results").glob("device_job-cpu-tiny-*.txt")
    text = written.read_text()
    for job in ("naive", "host preprocessing", "device: accel-opt run torch fp32", "accel-opt run onnxruntime fp32"):
        row = next(line for line in text.splitlines() if line.startswith(job))
        assert row.split()[-2].endswith("x") and row.split()[-1].endswith("%"), row  # ratio to naive, top-1 agreement
    assert "decode every file (Pillow, every core)" in text and "the fp32 package alone at batch 8" in text
    stages = next(line for line in text.splitlines() if line.startswith("device: accel-opt run torch fp32: stages"))
    for stage in ("read", "decode", "h2d", "preprocess", "compute", "d2h", "write", "slowest:", "host-decoded 24 of 24",
                  "of the decode limit", "of the package alone"):
        assert stage in stages, stage
