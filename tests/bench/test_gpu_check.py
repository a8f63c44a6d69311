"""benchmarks/gpu_check.py (the GPU kit's second step): its contract on machines without a GPU, and its report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[2]


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda(), reason="a CUDA GPU is visible: gpu_check measures instead of skipping")
def test_without_a_gpu_it_says_why_and_exits_0(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gpu_check: skipped: ") and done.stdout.count("\n") == 1
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_other_runtimes_say_why_they_are_skipped():
    skipped = gpu_check.other_runtimes()
    assert set(skipped) == {"tensorrt", "onnxruntime-cuda"} and all(skipped.values())


def test_report_renders_stages_ratios_and_accuracy():
    report = gpu_check.Report(machine={"gpu": "NVIDIA H200", "compute_capability": "9.0", "torch": "2.x",
                                       "cuda": "12.8"})
    report.timings = [gpu_check.Timing("fp32", 8, 100, 0.2, 4.0, 4.2, 0.01, 4.3, 1860.0, 900.0),
                      gpu_check.Timing("fp16", 8, 100, 0.2, 1.0, 1.1, 0.01, 1.3, 6150.0, 500.0)]
    report.accuracy = [gpu_check.Accuracy("fp16", 0.99999, 0.01, 1.0)]
    report.skipped = {"tensorrt": "not installed"}
    text = gpu_check.render(report)
    assert "compute speed-up over fp32: fp16 b8: 4.00x" in text
    assert "fp16: cosine 0.999990" in text and "tensorrt: not installed" in text
