"""The GPU kit (benchmarks/gpu_kit.py) works the first time on the GPU machine: rehearsed here in that machine's
package set, with nothing it lacks; and a GPU job's images decoded on the host are never silent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from accel_opt.cli import main
from accel_opt.cli.run import host_decoding_note
from accel_opt.runtime.local.job import JobSummary
from benchmarks.gpu_kit import kit_bytes

ROOT = Path(__file__).resolve().parents[1]


def test_a_gpu_jobs_host_decoded_images_are_said_with_why():
    summary = JobSummary(artifact="a", predictions="p.jsonl", errors="p.errors.jsonl", inputs=10, predicted=10,
                         rejected=0, skipped=0, workers=4, batch_size=8, seconds=1.0, inputs_per_s=10.0, stages_seconds={},
                         bottleneck="compute", path="device", device="cuda:0", host_decoded=3, exit_code=0,
                         host_decoded_reasons={"not a JPEG (the device decodes JPEGs only)": 2,
                                               "the device decoder refused it (nvJPEG: a progressive, CMYK or broken JPEG)": 1})
    note = host_decoding_note(summary)
    assert note.startswith("; 3 of 10 decoded on the host, not the device (2 not a JPEG") and "--strict-device" in note
    assert host_decoding_note(summary.model_copy(update={"device": "cpu"})) == ""  # on a CPU that is the design


def test_strict_device_refuses_an_artifact_that_does_not_run_images_on_a_device(classifier, photos, tmp_path):
    done = CliRunner().invoke(main, ["run", str(classifier), str(photos), "--out", str(tmp_path / "p.jsonl"),
                                     "--strict-device"])
    assert done.exit_code == 2 and "--strict-device" in done.stderr and "does not run images on a device" in done.stderr
    assert not (tmp_path / "p.jsonl").exists()


def test_the_kit_fits_the_gpu_machines_carry_limit():
    assert kit_bytes() < 64 * 2**20
    assert len(list((ROOT / "benchmarks" / "data" / "kit").glob("*.jpg"))) >= 8  # carried, not generated there


@pytest.mark.slow
def test_the_kit_installs_and_runs_in_the_gpu_machines_package_set(tmp_path):
    """scripts/gpu_rehearsal.py: a fresh venv with only the GPU machine's packages, the kit installed without a
    registry, the entry point's --device cpu run writing every result file (minutes: pip and an AOTInductor build)."""
    done = subprocess.run([sys.executable, "scripts/gpu_rehearsal.py", "--work", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "gpu_rehearsal: passed" in done.stdout and "MiB) of the 64 MiB a run may carry" in done.stdout
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    steps = {s["name"]: s["status"] for s in summary["steps"]}
    assert steps["device-job"] == "passed" and steps["doctor"] == "passed" and steps["builds"] == "passed"
    assert summary["kit_bytes"] < 64 * 2**20
