"""`accel-opt run --engine ray`: real Ray (a local instance, and a three-node cluster on loopback), real sessions.

Every node, the GCS and the driver stay on 127.0.0.1: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (read when `ray`
is imported) in this process, which starts the cluster's nodes, and in the CLI's, with node_ip_address set.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from accel_opt.runtime.ray.cluster import LOOPBACK_ENV, pin_loopback

pin_loopback()  # before ray is imported below
ray = pytest.importorskip("ray", reason="Ray Data is the `ray` extra: pip install '.[ray]'")

from accel_opt import runtime  # noqa: E402
from accel_opt.cli import main  # noqa: E402
from accel_opt.files import install_line  # noqa: E402
from accel_opt.runtime.local.job import run_job  # noqa: E402
from accel_opt.runtime.output import Outputs  # noqa: E402
from accel_opt.runtime.ray.job import SUMMARY, OutFolder  # noqa: E402

NODE = {"node_ip_address": "127.0.0.1", "object_store_memory": 100 << 20}
# A killed node is marked dead after 3 missed health checks 0.5 s apart (Ray's default: 5 x 3 s).
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                   "health_check_failure_threshold": 3}
JOB_TIMEOUT_S = 150  # the job's own --timeout-s: a stall ends as exit 5, never a hung test


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "accel_opt.cli", "run", *map(str, args)]


def _env() -> dict[str, str]:
    return {**os.environ, **LOOPBACK_ENV}


def _local_top1(classifier: Path, inputs: list[Path], tmp: Path) -> dict[str, int]:
    """The local engine's answers, the reference every Ray run must match."""
    out = tmp / "local.jsonl"
    run_job(runtime.load(classifier), inputs, out, workers=2)
    return {line["input"]: line["top1"] for line in map(json.loads, out.read_text().splitlines())}


def _answers(folder: Path) -> tuple[list[dict], list[dict]]:
    """Every record and rejection of the published parts, as rows."""
    import pyarrow.parquet as pq

    records, rejections = [], []
    for part in sorted(folder.glob("part-*")):
        records += (pq.read_table(part).to_pylist() if part.suffix == ".parquet"
                    else [json.loads(x) for x in part.read_text().splitlines()])
    for part in sorted(folder.glob("rejected-*")):
        rejections += [json.loads(x) for x in part.read_text().splitlines()]
    return records, rejections


def _exactly_once(folder: Path, listed: list[str]) -> list[dict]:
    records, rejections = _answers(folder)
    answered = [r["input"] for r in records + rejections]
    assert sorted(answered) == sorted(listed), "an input lost or answered twice"
    return records


@pytest.fixture(scope="module")
def big_inputs(tmp_path_factory, photos) -> Path:
    """480 inputs of 3000x2000 JPEGs (hard links to 4 files): ~40 ms to decode each, so a two-actor job runs
    for seconds and a node or the driver can be killed while it does."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("big")
    sources = []
    for i, photo in enumerate(sorted(photos.iterdir())[:4]):
        with Image.open(photo) as img:
            source = folder / f"src{i}.jpg"
            img.convert("RGB").resize((3000, 2000)).save(source, quality=90)
            sources.append(source)
    inputs = folder / "inputs" / "nested"  # listed recursively
    inputs.mkdir(parents=True)
    for n in range(480):
        os.link(sources[n % 4], inputs / f"{n:03d}_src{n % 4}.jpg")
    return folder


def _wait_for_part(folder: Path, process: subprocess.Popen, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        if folder.is_dir() and any(p.name.startswith("part-") for p in folder.iterdir()):
            return
        time.sleep(0.1)
    out, err = process.communicate(timeout=5) if process.poll() is not None else ("", "")
    pytest.fail(f"no part file published (rc {process.returncode}): {err[-2000:]}")


def test_local_ray_gives_the_local_engines_answers_and_rejects_bad_inputs(classifier, photos, tmp_path):
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 not really a jpeg")
    nested = tmp_path / "inputs" / "deeper"
    nested.mkdir(parents=True)
    for photo in sorted(photos.iterdir())[:4]:
        shutil.copy(photo, nested / photo.name)
    uri = f"file://{sorted(photos.iterdir())[5]}"
    inputs = [str(tmp_path / "inputs"), f"{photos}/0[1-3]_*.jpg", uri, broken, tmp_path / "missing.png"]
    out = tmp_path / "preds"
    done = subprocess.run(_cli(classifier, *inputs, "--engine", "ray", "--out", out, "--actors", "2", "--json",
                               "--timeout-s", JOB_TIMEOUT_S), capture_output=True, text=True, env=_env(), timeout=240)
    assert done.returncode == 3, done.stderr  # some inputs rejected
    assert all(line.startswith("accel-opt") for line in done.stderr.splitlines()), done.stderr  # no Ray C++ chatter
    summary = json.loads(done.stdout)
    assert summary == json.loads((out / SUMMARY).read_text())
    listed = [*map(str, sorted(nested.iterdir())), *sorted(str(p) for p in photos.glob("0[1-3]_*.jpg")), uri,
              str(broken),
              str(tmp_path / "missing.png")]
    assert summary["status"] == "complete" and summary["inputs"] == len(listed) == 13
    assert summary["ray_authentication"] == "token"  # the local cluster accel-opt started took tokens only
    assert (summary["predicted"], summary["rejected"], summary["missing"]) == (11, 2, 0)
    records = _exactly_once(out, listed)
    _, rejections = _answers(out)
    reasons = {r["input"]: r["error"] for r in rejections}
    assert "not a readable image" in reasons[str(broken)] and reasons[str(tmp_path / "missing.png")] == "not found"
    # The local engine, given the very same arguments, lists the same inputs (folders recursively, the glob, the
    # file:// URI), answers them with the same top-1, rejects the same two, under the same artifact identity.
    local = run_job(runtime.load(classifier), inputs, tmp_path / "local.jsonl", workers=2)
    assert (local.inputs, local.predicted, local.rejected) == (13, 11, 2)
    reference = {line["input"]: line["top1"] for line in map(json.loads,
                                                             (tmp_path / "local.jsonl").read_text().splitlines())}
    local_rejected = {json.loads(line)["input"] for line in (tmp_path / "local.errors.jsonl").read_text().splitlines()}
    assert set(reference) == {r["input"] for r in records} and local_rejected == set(reasons)
    assert summary["artifact_identity"] == json.loads(Outputs(tmp_path
                                                              / "local.jsonl").meta.read_text())["artifact_identity"]
    for record in records:
        assert record["top1"] == reference[record["input"]], record
        assert len(record["topk"]) == 3 and set(record) == {"input", "top1", "topk"}


@pytest.mark.slow
def test_predictor_in_a_users_own_ray_pipeline(classifier, photos, tmp_path):
    """The Python API: users' own map_batches with our actor class; an artifact missing on a node is an error
    naming that node (exit code 3's error), not a hang or a silent retry."""
    from ray.data import ActorPoolStrategy

    from accel_opt.runtime.ray.cluster import as_accel_opt_error
    from accel_opt.runtime.ray.predictor import Predictor, predict

    temp_dir = tempfile.mkdtemp(prefix="aoray-", dir="/tmp")
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 << 20, _temp_dir=temp_dir,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        ray.data.DataContext.get_current().max_errored_blocks = 0
        paths = [str(p) for p in sorted(photos.iterdir())]
        ds = ray.data.from_items([{"input": p} for p in paths])
        rows = ds.map_batches(Predictor, fn_constructor_kwargs={"artifact": str(classifier), "threads": 1},
                              compute=ActorPoolStrategy(min_size=1, max_size=2), num_cpus=1, batch_size=4).take_all()
        reference = _local_top1(classifier, [Path(p) for p in paths], tmp_path)
        assert sorted(r["input"] for r in rows) == sorted(paths)
        assert {r["input"]: r["top1"] for r in rows} == reference
        assert all(json.loads(r["record"])["top1"] == r["top1"] and r["error"] is None for r in rows)
        as_bytes = predict(ray.data.read_binary_files(paths, include_paths=True), classifier, actors=(1, 1)).take_all()
        assert {r["input"]: r["top1"] for r in as_bytes} == reference  # read by Ray, decoded by the actor alike
        # A second answer of one input (what a batch Ray runs twice yields) is dropped by key before publishing,
        # and the check over the published parts catches an input answered twice or not at all.
        from accel_opt.runtime.ray.job import _stream

        folder = OutFolder(tmp_path / "dedup")
        folder.folder.mkdir()
        with folder.outputs.exclusive():  # the job's folder, locked and pinned, as run_ray_job holds it
            run = _stream(runtime.load(classifier), [paths[0], paths[1], paths[0]], folder, (1, 1), 1, None,
                          time.perf_counter(), None)
            assert run["dropped"] == 1 and folder.check(paths[:2]) == (2, 0, [], [])
            folder.publish([json.dumps({"input": paths[1], "top1": 0, "topk": []})], [])
            assert folder.check(paths[:3]) == (3, 0, [paths[2]], [paths[1]])
        with pytest.raises(Exception) as failed:
            predict(ds, tmp_path / "not-on-this-node", actors=(1, 1)).take_all()
        error = as_accel_opt_error(failed.value)
        assert error.exit_code == 3 and "on node 127.0.0.1" in str(error) and "artifact folder not found" in str(error)
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def raw_outputs(tiny_cnn_path, photos, tmp_path_factory) -> Path:
    """The `classifier` without a postprocess: every answer is an .npz of the outputs, not a JSON top-k."""
    from accel_opt.builder.pipeline import build
    from accel_opt.recipe.load import load_recipe
    from tests.conftest import CLASSIFIER_PRE, FAST_BENCH

    recipe = load_recipe().with_overrides(benchmark=FAST_BENCH, preprocessing=CLASSIFIER_PRE,
                                          **{"selection.target_batch_size": 4})
    result = build(tiny_cnn_path, recipe, data_dir=photos, out_dir=tmp_path_factory.mktemp("raw"))
    assert result.signed_off, result.failures
    return Path(result.artifact_dir)


@pytest.mark.slow
def test_a_node_removed_mid_job_leaves_every_input_answered_once(classifier, raw_outputs, big_inputs, tmp_path,
                                                                 monkeypatch):
    """Head of 0 CPUs and two 1-CPU workers; one worker is killed while the job runs: the pool (1-2 actors)
    goes on with the other, retried batches are answered once, and the top-1s are the local engine's. The artifact
    has no postprocess, so every answer is an .npz of its outputs: each is in the job's folder, named by one record
    (written by the driver from the bytes the actors return: a removed node takes none with it)."""
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix="aocl-", dir="/tmp")
    # Cluster writes `ray_current_cluster` to $RAY_TMPDIR/ray (default /tmp/ray) whatever the head's temp_dir:
    # left there, it would make a later plain ray.init() join this dead cluster.
    monkeypatch.setenv("RAY_TMPDIR", temp_dir)
    (Path(temp_dir) / "ray").mkdir()  # Ray does not create it
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 0, "include_dashboard": False, "temp_dir": temp_dir,
                                      "_system_config": FAST_NODE_DEATH, **NODE})
    try:
        cluster.add_node(num_cpus=1, **NODE)
        doomed = cluster.add_node(num_cpus=1, **NODE)
        out = tmp_path / "preds"
        job = subprocess.Popen(_cli(raw_outputs, big_inputs / "inputs", "--engine", "ray", "--address", cluster.address,
                                    "--actors", "1-2", "--format", "parquet", "--out", out, "--json", "--timeout-s",
                                    JOB_TIMEOUT_S), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=_env())
        _wait_for_part(out, job)
        cluster.remove_node(doomed, allow_graceful=False)
        stdout, stderr = job.communicate(timeout=JOB_TIMEOUT_S + 30)
    finally:
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert job.returncode == 0, stderr[-3000:]
    summary = json.loads(stdout)
    assert summary["status"] == "complete" and summary["predicted"] == 480 and summary["missing"] == 0
    assert summary["steady_inputs_per_s"] > 0 and len(summary["parts"]) >= 2  # answers came before and after the kill
    listed = [str(p) for p in sorted((big_inputs / "inputs").rglob("*.jpg"))]
    records = _exactly_once(out, listed)
    reference = _local_top1(classifier, sorted(big_inputs.glob("src*.jpg")), tmp_path)
    named = [Path(record["outputs"]) for record in records]
    assert len(set(named)) == 480 and sorted(named) == sorted((out / "predictions.outputs").iterdir())
    for record, file in zip(records, named):
        source = str(big_inputs / f"{record['input'].rsplit('_', 1)[1]}")
        with np.load(file, allow_pickle=False) as arrays:
            assert int(np.argmax(arrays["logits"])) == reference[source], record


@pytest.mark.slow
def test_driver_killed_then_resume_answers_each_input_once(classifier, big_inputs, tmp_path):
    out = tmp_path / "preds"
    args = [classifier, big_inputs / "inputs", "--engine", "ray", "--actors", "2", "--out", out, "--timeout-s",
            JOB_TIMEOUT_S]
    ray_folders_before = set(Path("/tmp").glob("aoray-*"))
    job = subprocess.Popen(_cli(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                           start_new_session=True)
    _wait_for_part(out, job)
    os.killpg(job.pid, signal.SIGKILL)  # the driver and the local Ray it started
    job.communicate(timeout=30)
    for left in set(Path("/tmp").glob("aoray-*")) - ray_folders_before:  # a killed driver removes nothing of its own
        shutil.rmtree(left, ignore_errors=True)
    published = OutFolder(out)
    answered_before = sum(len(published.read_keys(p)) for p in out.glob("part-*"))
    assert 0 < answered_before < 480
    in_process = CliRunner()  # refused before Ray starts
    fresh = in_process.invoke(main, ["run", *map(str, args)])
    assert fresh.exit_code == 2 and "--resume" in fresh.stderr  # the folder holds answers
    summary_file = out / SUMMARY
    honest = summary_file.read_text()
    summary_file.write_text(honest.replace(json.loads(honest)["artifact_identity"], "0" * 64))  # "another artifact"
    other = in_process.invoke(main, ["run", *map(str, args), "--resume"])
    assert other.exit_code == 2 and "holds answers of 000000000000" in other.stderr
    summary_file.write_text(honest)
    resumed = subprocess.run(_cli(*args, "--resume", "--json", "--sorted"), capture_output=True, text=True, env=_env(),
                             timeout=JOB_TIMEOUT_S + 30)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout)
    assert summary["skipped"] == answered_before and summary["predicted"] == 480 and summary["status"] == "complete"
    listed = [str(p) for p in sorted((big_inputs / "inputs").rglob("*.jpg"))]
    _exactly_once(out, listed)
    in_order = [json.loads(line)["input"] for line in (out / "predictions.sorted.jsonl").read_text().splitlines()]
    assert in_order == listed


def test_bad_cluster_address_output_and_missing_ray_are_one_line_each(classifier, photos, tmp_path):
    runner = CliRunner()

    def run(*args):
        return runner.invoke(main, ["run", str(classifier), str(photos), "--engine", "ray", *map(str, args)])

    silent = run("--out", tmp_path / "a", "--address", "127.0.0.1:1")
    assert silent.exit_code == 4 and "no Ray cluster answers" in silent.stderr and silent.stderr.count("\n") == 1
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert run("--out", a_file).exit_code == 2
    assert "is a file" in run("--out", a_file).stderr
    assert run("--out", tmp_path / "b", "--actors", "3-1").exit_code == 2
    local = runner.invoke(main, ["run", str(classifier), str(photos), "--out", str(tmp_path / "c.jsonl"),
                                 "--address", "x:1"])
    assert local.exit_code == 2 and "only with --engine ray" in local.stderr
    code = ("import sys; sys.modules['ray'] = None\nfrom accel_opt.cli import main\nmain()")
    no_ray = subprocess.run([sys.executable, "-c", code, "run", str(classifier), str(photos), "--engine",
                             "ray", "--out",
                             str(tmp_path / "d")], capture_output=True, text=True)
    assert no_ray.returncode == 4 and install_line("ray") in no_ray.stderr and no_ray.stderr.count("\n") == 1
    light = subprocess.run([sys.executable, "-c", "import sys, accel_opt.cli; assert 'ray' not in sys.modules"],
                           capture_output=True)
    assert light.returncode == 0  # `accel-opt --help` never imports Ray


def test_read_only_out_folder_is_a_usage_error(classifier, photos, tmp_path):
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("a read-only file system needs root and mount(8) here (root ignores file modes)")
    point = tmp_path / "ro"
    point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        done = CliRunner().invoke(main, ["run", str(classifier), str(photos), "--engine", "ray", "--out",
                                         str(point / "out")])
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)
    assert done.exit_code == 2 and "cannot write there" in done.stderr and done.stderr.count("\n") == 1


@pytest.mark.slow
def test_a_job_past_its_timeout_ends_with_exit_5_not_a_hang(classifier, big_inputs, tmp_path):
    out = tmp_path / "preds"
    started = time.monotonic()
    done = subprocess.run(_cli(classifier, big_inputs / "inputs", "--engine", "ray", "--actors", "1", "--out", out,
                               "--timeout-s", 12), capture_output=True, text=True, env=_env(), timeout=90)
    assert done.returncode == 5, done.stderr[-2000:]
    assert "--timeout-s 12 reached" in done.stderr and "--resume continues" in done.stderr
    assert time.monotonic() - started < 60
    summary = json.loads((out / SUMMARY).read_text())
    assert summary["status"] == "incomplete"
    records, _ = _answers(out)
    assert len({r["input"] for r in records}) == len(records) < 480  # what was published is whole and once


@pytest.mark.slow
def test_the_local_ray_temp_folder_is_this_users_alone():
    """Issue 74: Ray makes its temp folder and its sockets/, logs/ and runtime_resources/ world-writable (0777); they
    live inside a 0700 folder of this user's, which no other user can enter."""
    import glob

    from accel_opt.runtime.ray.cluster import ray_session

    before = set(glob.glob("/tmp/aoray-*"))
    with ray_session(None, num_cpus=1):
        (mine,) = set(glob.glob("/tmp/aoray-*")) - before
        assert os.stat(mine).st_mode & 0o777 == 0o700 and os.stat(mine).st_uid == os.getuid()
        assert os.listdir(mine) == ["r"]
    assert not os.path.exists(mine)
