"""Ordinary faults around a build: signals, killed builds, concurrent builds, unusable or full --out."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from accel_opt.artifact.folder import MANIFEST
from accel_opt.builder.pipeline import build
from accel_opt.errors import ResourceExhausted, UsageError
from accel_opt.files import sha256_file

from .conftest import FAST_BENCH, matmul_model, save

SLOW_BENCH = {**FAST_BENCH, "min_seconds": 30.0, "max_iterations": 10**6}  # keeps a build busy to be signalled


def _recipe_file(tmp_path: Path, bench: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    lines = "\n".join(f"  {k}: {v}" for k, v in bench.items())
    path.write_text(f"name: faults\naccuracy:\n  synthetic_samples: 4\nbenchmark:\n{lines}\n")
    return path


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "accel_opt.cli", "build", *map(str, args)]


def _build_folders(out: Path) -> list[Path]:
    return [p for p in out.glob(".*.build-*")] if out.exists() else []


def _wait_for(predicate, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


def _start_busy_build(model: Path, out: Path, tmp_path: Path) -> subprocess.Popen:
    proc = subprocess.Popen(_cli(model, "--recipe", _recipe_file(tmp_path, SLOW_BENCH), "--out", out),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # The benchmark stage writes nothing: wait until the staged model exists, then a little longer.
    _wait_for(lambda: any((p / "staging" / "resource_config.json").exists() for p in _build_folders(out)))
    return proc


def test_sigterm_cleans_up_like_ctrl_c(tiny_cnn_path, tmp_path):
    out = tmp_path / "out"
    proc = _start_busy_build(tiny_cnn_path, out, tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    assert "terminated" in stderr and "Traceback" not in stderr
    assert not _build_folders(out)
    assert not list(out.rglob(MANIFEST))


def test_a_termination_a_library_swallowed_still_ends_the_command_as_terminated(monkeypatch, capsys):
    """SIGTERM's exception can land inside a library that catches it and raises its own error (Polygraphy's array
    dispatch did: exit 70, an "internal error"); the command still ends as terminated, exit 143."""
    import accel_opt.errors as errors
    from accel_opt.cli.common import fail

    monkeypatch.setattr(errors, "_TERMINATION", [])
    assert errors.termination_requested() is None
    try:
        try:
            errors.request_termination(signal.SIGTERM)
        except BaseException:  # noqa: BLE001 - what the library did
            raise RuntimeError("Function: shape is unsupported for objects of type: ndarray") from None
    except RuntimeError as exc:
        with pytest.raises(SystemExit) as ended:
            fail(exc, verbose=False, as_json=False)
    assert ended.value.code == 143 and "terminated" in capsys.readouterr().err


@pytest.mark.slow
def test_a_killed_builds_folder_is_removed_by_the_next_build(tiny_cnn_path, fast_recipe, tmp_path):
    out = tmp_path / "out"
    proc = _start_busy_build(tiny_cnn_path, out, tmp_path)
    proc.kill()  # SIGKILL: no cleanup can run
    proc.communicate(timeout=60)
    (left,) = _build_folders(out)
    assert not list(out.rglob(MANIFEST))
    result = build(tiny_cnn_path, fast_recipe, out_dir=out)
    assert result.signed_off and not left.exists() and not _build_folders(out)


@pytest.mark.slow
def test_a_running_builds_folder_is_left_alone(tiny_cnn_path, fast_recipe, tmp_path):
    out = tmp_path / "out"
    proc = _start_busy_build(tiny_cnn_path, out, tmp_path)
    try:
        (running,) = _build_folders(out)
        build(tiny_cnn_path, fast_recipe, out_dir=out)
        assert running.exists()
    finally:
        proc.kill()
        proc.communicate(timeout=60)


@pytest.mark.slow
def test_two_identical_builds_at_once_both_succeed_into_one_complete_folder(tiny_cnn_path, tmp_path):
    out = tmp_path / "out"
    recipe = _recipe_file(tmp_path, FAST_BENCH)
    procs = [subprocess.Popen(_cli(tiny_cnn_path, "--recipe", recipe, "--out", out, "--json"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [r[1] for r in results]
    dirs = {json.loads(stdout)["artifact_dir"] for stdout, _ in results}
    (folder,) = [p for p in out.iterdir() if not p.name.startswith(".")]
    assert dirs == {str(folder)}
    manifest = json.loads((folder / MANIFEST).read_text())
    assert {p.name for p in folder.iterdir()} == set(manifest["artifacts"]) | {MANIFEST}
    assert all(sha256_file(folder / name) == digest for name, digest in manifest["artifacts"].items())
    assert not _build_folders(out)


def test_out_below_a_file_is_a_usage_error(tmp_path):
    model = save(matmul_model(), tmp_path / "m.onnx")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UsageError, match="is a file, not a folder"):
        build(model, out_dir=blocker / "out")
    done = subprocess.run(_cli(model, "--out", blocker / "out"), capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--out" in done.stderr


@pytest.fixture()
def small_mount(tmp_path):
    """A tmpfs mount (root only): read-only or 1 MiB, for write faults under --out."""
    mounted = []

    def mount(options: str) -> Path:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
        mounted.append(point)
        return point

    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root and mount(8)")
    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_read_only_out_is_a_usage_error(small_mount, tmp_path):
    model = save(matmul_model(), tmp_path / "m.onnx")
    read_only = small_mount("ro,size=1m")
    done = subprocess.run(_cli(model, "--out", read_only / "out"), capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("accel-opt: error: --out") and done.stderr.count("\n") == 1


@pytest.mark.parametrize("size", ["1m", "6m"])  # refused before the build starts / a write fails during it
def test_full_disk_is_exit_5_and_nothing_is_complete(small_mount, tmp_path, size):
    model = save(matmul_model(in_shape=("batch", 1024), out_dim=1024), tmp_path / "big.onnx")  # 4 MiB of weights
    full = small_mount(f"size={size}")
    with pytest.raises(ResourceExhausted, match="no space left"):
        build(model, out_dir=full / "out")
    done = subprocess.run(_cli(model, "--out", full / "out"), capture_output=True, text=True)
    assert done.returncode == 5, done.stderr
    assert "no space left" in done.stderr and done.stderr.count("\n") == 1
    assert not list((full / "out").rglob(MANIFEST)) and not _build_folders(full / "out")
    np.testing.assert_equal(sorted(p.name for p in (full / "out").iterdir() if not p.name.startswith(".")), [])


def test_a_full_disk_mid_run_leaves_whole_lines_and_resume_finishes(small_mount, classifier, tmp_path):
    """`accel-opt run` into a 16 KiB tmpfs: the disk fills after a few batches (exit 5); the file is cut back
    to its last whole line, so every line parses; after space is freed, --resume answers the rest once each."""
    from click.testing import CliRunner

    from accel_opt.cli import main

    feeds = tmp_path / "feeds"
    feeds.mkdir()
    rng = np.random.default_rng(0)
    for i in range(120):  # ~300-byte lines: about 36 KiB of predictions in all
        np.savez(feeds / f"{i:03d}-{'x' * 180}.npz", image=rng.standard_normal((1, 3, 32, 32)).astype(np.float32))
    full = small_mount("size=16k")
    out = full / "preds.jsonl"
    result = CliRunner().invoke(main, ["run", str(classifier), str(feeds), "--out", str(out)])
    assert result.exit_code == 5, result.stderr
    assert "no space left" in result.stderr and result.stderr.count("\n") == 1
    text = out.read_text()
    assert text.endswith("\n")
    lines = [json.loads(line) for line in text.splitlines()]  # every line whole
    assert 0 < len(lines) < 120
    subprocess.run(["mount", "-o", "remount,size=1m", "tmpfs", str(full)], check=True, capture_output=True)
    result = CliRunner().invoke(main, ["run", str(classifier), str(feeds), "--out", str(out), "--resume", "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["skipped"] == len(lines)
    answers = [json.loads(line)["input"] for line in out.read_text().splitlines()]
    assert answers == [str(feeds / p.name) for p in sorted(feeds.iterdir())]


@pytest.mark.slow
def test_sigterm_ends_a_run_within_seconds_even_when_the_folder_asks_for_every_thread(classifier, photos, tmp_path):
    """A folder may ask for up to 1,024 compute threads (more is refused at load); the run takes the CPUs it may use,
    and SIGTERM mid-job ends it (exit 143, every line whole) as Ctrl-C would. Issue 74: a forged 20,000 ran 14,000
    threads on 2 CPUs and outlived SIGTERM for 10 minutes."""
    from accel_opt.artifact.folder import file_hashes

    folder = Path(shutil.copytree(classifier, tmp_path / classifier.name))
    config = json.loads((folder / "resource_config.json").read_text())
    (folder / "resource_config.json").write_text(json.dumps({**config, "threads": 1024}))
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**manifest, "artifacts": file_hashes(folder)}))
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    for i in range(400):  # far more than a run answers in the moments before the signal
        shutil.copy(sorted(photos.iterdir())[i % 12], inputs / f"{i:04d}.jpg")
    out = tmp_path / "p.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "accel_opt.cli", "run", str(folder), str(inputs), "--out", str(out),
                             "--trust-unsigned"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _wait_for(lambda: out.exists() and out.stat().st_size > 0 or proc.poll() is not None)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "terminated" in stderr and "Traceback" not in stderr, stderr
    lines = out.read_text().splitlines()
    assert 0 < len(lines) < 400 and all(json.loads(line)["input"] for line in lines)
