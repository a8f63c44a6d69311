"""What `accel-opt run` promises about its files: one writer at a time, answers of one artifact per file,
never an output over an input, and a repeated input answered once by a fresh and a resumed run alike."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner

from accel_opt import runtime
from accel_opt.artifact.folder import MANIFEST
from accel_opt.cli import main
from accel_opt.runtime.local.job import errors_path, run_job
from accel_opt.runtime.output import Outputs


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(*args) -> object:
    return CliRunner().invoke(main, ["run", *map(str, args)])


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_second_run_on_the_same_out_is_refused_at_once_naming_the_holder(classifier, photos, tmp_path):
    out = tmp_path / "preds.jsonl"
    first_batch_written, release = threading.Event(), threading.Event()

    def hold(done: int, total: int) -> None:
        first_batch_written.set()
        release.wait(60)

    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(run_job, runtime.load(classifier), [photos], out, on_progress=hold)
        try:
            assert first_batch_written.wait(60)
            for flags in ([], ["--resume"], ["--overwrite"]):
                refused = _run(classifier, photos, "--out", out, *flags)
                assert refused.exit_code == 2, refused.stderr
                assert f"another accel-opt run (pid {os.getpid()}) is writing it" in refused.stderr
                assert refused.stderr.count("\n") == 1
            # A job whose predictions would be the running job's errors file takes the same lock.
            refused = _run(classifier, photos, "--out", errors_path(out), "--overwrite")
            assert refused.exit_code == 2 and f"pid {os.getpid()}" in refused.stderr
        finally:
            release.set()
        summary = job.result(timeout=120)
    assert summary.predicted == 12
    lines = _lines(out)
    assert len(lines) == 12 and len({line["input"] for line in lines}) == 12


def test_a_lock_left_by_a_killed_run_does_not_block_the_next(classifier, photos, tmp_path):
    out = tmp_path / "preds.jsonl"
    holder = ("import sys, time\nfrom pathlib import Path\nfrom accel_opt.runtime.output import Outputs\n"
              "with Outputs(Path(sys.argv[1])).exclusive():\n    print('locked', flush=True)\n    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", holder, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "locked\n"
        refused = _run(classifier, photos, "--out", out)
        assert refused.exit_code == 2 and f"(pid {proc.pid})" in refused.stderr
    finally:
        proc.kill()  # SIGKILL: no cleanup runs; the lock file stays, its lock goes with the process
        proc.communicate(timeout=60)
    assert Outputs(out).lock.exists()
    done = _run(classifier, photos, "--out", out)
    assert done.exit_code == 0, done.stderr
    assert len(_lines(out)) == 12


def test_resume_with_another_artifact_is_refused_naming_both(classifier, photos, tmp_path):
    other = Path(shutil.copytree(classifier, tmp_path / "rebuilt"))  # a later build: another manifest
    manifest = json.loads((other / MANIFEST).read_text())
    manifest["created_utc"] = "2030-01-01T00:00:00+00:00"
    (other / MANIFEST).write_text(json.dumps(manifest, indent=2))
    ours, theirs = runtime.artifact_identity(classifier), runtime.artifact_identity(other)
    assert ours != theirs and runtime.load(other).identity == theirs

    out = tmp_path / "preds.jsonl"
    run_job(runtime.load(classifier), [photos / "00_0.jpg", photos / "00_1.jpg"], out)
    meta = Outputs(out).meta
    assert json.loads(meta.read_text())["artifact_identity"] == ours
    before = out.read_bytes()
    refused = _run(other, photos, "--out", out, "--resume")
    assert refused.exit_code == 2, refused.stderr
    assert f"{ours[:12]} ({classifier.name})" in refused.stderr and f"{theirs[:12]} (rebuilt)" in refused.stderr
    assert out.read_bytes() == before and json.loads(meta.read_text())["artifact_identity"] == ours

    started_over = _run(other, photos, "--out", out, "--overwrite")
    assert started_over.exit_code == 0 and len(_lines(out)) == 12
    assert json.loads(meta.read_text())["artifact_identity"] == theirs

    # A file without its sidecar (an older accel-opt wrote it): which artifact answered is unknown, so no resume.
    meta.unlink()
    refused = _run(other, photos, "--out", out, "--resume")
    assert refused.exit_code == 2 and "has no preds.meta.json" in refused.stderr and "--overwrite" in refused.stderr
    assert len(_lines(out)) == 12


@pytest.mark.parametrize("case", ["out is an input", "out in an input folder", "out hard-linked to an input",
                                  "input folder through a symlink", "input in the outputs folder"])
def test_outputs_never_land_on_inputs(classifier, photos, tmp_path, case):
    inputs = Path(shutil.copytree(photos, tmp_path / "photos"))
    first = inputs / "00_0.jpg"
    args = {
        "out is an input": [inputs, "--out", first, "--overwrite"],
        "out in an input folder": [inputs, "--out", inputs / "preds.jsonl"],
        "out hard-linked to an input": [first, "--out", tmp_path / "preds.jsonl", "--overwrite"],
        "input folder through a symlink": [tmp_path / "alias", "--out", inputs / "preds.jsonl"],
        "input in the outputs folder": [tmp_path / "preds.outputs", "--out", tmp_path / "preds.jsonl"],
    }[case]
    if case == "out hard-linked to an input":
        os.link(first, tmp_path / "preds.jsonl")
    elif case == "input folder through a symlink":
        (tmp_path / "alias").symlink_to(inputs)
    elif case == "input in the outputs folder":
        shutil.copytree(inputs, tmp_path / "preds.outputs")
    before = _snapshot(inputs)
    refused = _run(classifier, *args)
    assert refused.exit_code == 2, refused.stderr
    assert "outside the inputs" in refused.stderr or "outputs folder" in refused.stderr
    assert refused.stderr.count("\n") == 1
    assert _snapshot(inputs) == before  # nothing truncated, nothing added (no lock, no sidecar)


def test_a_repeated_input_is_answered_once_by_a_fresh_and_a_resumed_run(classifier, photos, tmp_path):
    files = sorted(photos.iterdir())
    inputs = [photos, files[3], f"{photos}/./{files[0].name}", files[5]]  # three paths given twice
    fresh = tmp_path / "fresh.jsonl"
    result = _run(classifier, *inputs, "--out", fresh, "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["inputs"], summary["duplicates"], summary["predicted"]) == (12, 3, 12)
    assert [line["input"] for line in _lines(fresh)] == [str(photos / f.name) for f in files]

    def interrupt(done: int, total: int) -> None:  # Ctrl-C after the first batch
        raise KeyboardInterrupt

    resumed = tmp_path / "resumed.jsonl"
    with pytest.raises(KeyboardInterrupt):
        run_job(runtime.load(classifier), inputs, resumed, on_progress=interrupt)
    assert len(_lines(resumed)) == 4  # one batch
    result = _run(classifier, *inputs, "--out", resumed, "--resume", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["skipped"], summary["predicted"], summary["duplicates"]) == (4, 8, 3)
    assert _lines(resumed) == _lines(fresh)
    text = _run(classifier, *inputs, "--out", tmp_path / "again.jsonl")
    assert "3 given twice (answered once)" in text.stderr


def test_resume_and_overwrite_together_is_a_usage_error(classifier, photos, tmp_path):
    out = tmp_path / "preds.jsonl"
    refused = _run(classifier, photos, "--out", out, "--resume", "--overwrite")
    assert refused.exit_code == 2 and "give one" in refused.stderr
    assert not out.exists() and not Outputs(out).lock.exists()
