"""The GPU kit (benchmarks/gpu_kit.py) works the first time on the GPU machine: rehearsed here in that machine's
package set, with nothing it lacks; and a GPU job's images decoded on the host are never silent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from accel_opt.cli import main
from accel_opt.cli.run import host_decoding_note
from accel_opt.runtime.local.job import JobSummary
from benchmarks.gpu_kit import DEVICE_LINE, LOGS, kit_bytes, output_problems

ROOT = Path(__file__).resolve().parents[1]


def test_a_gpu_jobs_host_decoded_images_are_said_with_why():
    summary = JobSummary(artifact="a", predictions="p.jsonl", errors="p.errors.jsonl", inputs=10, predicted=10,
                         rejected=0, skipped=0, workers=4, batch_size=8, seconds=1.0, inputs_per_s=10.0,
                         stages_seconds={},
                         bottleneck="compute", path="device", device="cuda:0", host_decoded=3, exit_code=0,
                         host_decoded_reasons={"not a JPEG (the device decodes JPEGs only)": 2,
                                               "the device decoder refused it (nvJPEG: a progressive, CMYK or broken "
                                               "JPEG)": 1})
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


def test_the_docs_quote_the_one_line_the_rehearsal_runs():
    line = DEVICE_LINE.format(python="python3", wheelhouse="wheelhouse")
    assert line.startswith("timeout 540 ") and "make" not in line.split() and "--no-index" in line
    assert line in (ROOT / "docs" / "backends.md").read_text()


def test_what_would_not_come_back_from_a_call_is_named(tmp_path):
    for name in ("summary.txt", "summary.json", "environment.json", LOGS):
        (tmp_path / name).write_text("x")
    assert output_problems(tmp_path) == []
    (tmp_path / "builds" / "fp32").mkdir(parents=True)
    (tmp_path / "builds" / "fp32" / "accuracy.json").write_text("{}")  # two folders deep
    (tmp_path / "big.bin").touch()
    os.truncate(tmp_path / "big.bin", 17 * 2**20)  # sparse: no disk
    (tmp_path / "odd name.txt").write_text("x")
    (tmp_path / "link.txt").symlink_to(tmp_path / "summary.txt")
    for extra in range(3):
        (tmp_path / f"extra{extra}.txt").write_text("x")
    problems = "; ".join(output_problems(tmp_path))
    for expected in ("builds/fp32/accuracy.json: deeper than 1 folder", "big.bin: 17.0 MiB, over 16 MiB",
                     "odd name.txt: not a plain name", "link.txt: not a plain file", "10 files, over 8"):
        assert expected in problems, problems


def test_the_kit_refuses_a_work_folder_inside_what_comes_back(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_kit", "--device", "cpu", "--out", str(tmp_path),
                           "--work", str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "must not come back" in done.stdout
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_the_calls_timeout_still_brings_back_the_summary_and_the_logs(tmp_path):
    """SIGTERM (what `timeout 540` sends) mid-step: the step and the stop are in the summary, the archive written."""
    out = tmp_path / "out"
    kit = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_kit", "--device", "cpu", "--out", str(out), "--work",
                            str(tmp_path / "work")], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    deadline = time.monotonic() + 120
    while "gpu-check" not in _read(out / "summary.txt") and time.monotonic() < deadline:
        time.sleep(0.2)
    kit.send_signal(signal.SIGTERM)
    stdout, _ = kit.communicate(timeout=60)
    assert kit.returncode == 1, stdout
    steps = {s["name"]: s["status"] for s in json.loads((out / "summary.json").read_text())["steps"]}
    assert steps["environment"] == "passed" and steps["stopped"] == "timed out", steps
    assert "stopped" in _read(out / "summary.txt") and (out / LOGS).is_file() and output_problems(out) == []


def _read(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


@pytest.mark.slow
def test_the_kit_installs_and_runs_in_the_gpu_machines_package_set(tmp_path):
    """scripts/gpu_rehearsal.py: the one line, with the network cut, in fresh venvs holding only the GPU machine's
    packages, on Python 3.12 and on this Python with its CPU torch; all the kit wrote would come back (minutes)."""
    done = subprocess.run([sys.executable, "scripts/gpu_rehearsal.py", "--work", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "gpu_rehearsal: passed" in done.stdout and "MiB) of the 64 MiB a run may carry" in done.stdout
    summary = json.loads((tmp_path / f"results-{sys.version_info[0]}.{sys.version_info[1]}"
                          / "summary.json").read_text())
    steps = {s["name"]: s["status"] for s in summary["steps"]}
    assert steps["device-job"] == "passed" and steps["doctor"] == "passed" and steps["verify-fp32"] == "passed"
    assert steps["gpu-check"] == "skipped"  # no CUDA GPU here: it says so
    assert summary["kit_bytes"] < 64 * 2**20
    on_312 = json.loads((tmp_path / "results-3.12" / "summary.json").read_text())
    assert on_312["python"].startswith("3.12.") and on_312["steps"][0]["status"] == "passed"
