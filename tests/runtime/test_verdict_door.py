"""One verdict, made once by the build, recorded in the manifest and enforced where a folder is opened: the Python API
(`runtime.load`), Ray's `Predictor`, `run`, `bench`, `verify --accuracy` and `compare` refuse a folder its build did not
sign off unless the caller allows it, and say so when they run it. The benefit rule (a reduced precision must be
measured faster than its fp32 build) is tested with injected timings, and end to end with a minimum no build can reach.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from accel_opt import runtime
from accel_opt.bench import BatchResult, BenchmarkReport, LatencyStats, ModelBenchmark
from accel_opt.builder.pipeline import build
from accel_opt.cli import main
from accel_opt.errors import NotSignedOff
from accel_opt.recipe.load import load_recipe
from accel_opt.report.verdict import Verdict, benefit_of, decide, rounds_needed, speedup_lower_bound

from ..conftest import FAST_BENCH, image_npz_folder

UNREACHABLE = 1000.0  # a minimum speed-up no build reaches on any host: the end-to-end outcome does not depend on speed


@pytest.fixture(scope="module")
def no_benefit(tiny_cnn_path, tmp_path_factory) -> tuple[Path, Path]:
    """(folder, data): the tiny CNN at fp16, correct on 100 samples, with benchmark.min_speedup 1000x: exit 7."""
    root = tmp_path_factory.mktemp("no-benefit")
    data = image_npz_folder(root / "data", 100)
    recipe = load_recipe().with_overrides(precision="fp16", benchmark={**FAST_BENCH, "min_speedup": UNREACHABLE})
    result = build(tiny_cnn_path, recipe, data_dir=data, out_dir=root / "out")
    assert result.exit_code == 7 and result.verdict.outcome == "no measured benefit", result.failures
    return Path(result.artifact_dir), data


# ---- the rule, on injected timings ---------------------------------------------------------------------------------


def _bench(candidate_rounds_ms: list[float], fp32_rounds_ms: list[float], batch: int = 8) -> BenchmarkReport:
    def model(label, rounds):
        p50 = sorted(rounds)[len(rounds) // 2]
        stats = LatencyStats(iterations=len(rounds), p50_ms=p50, p90_ms=p50, p99_ms=p50, mean_ms=p50, min_ms=p50,
                             max_ms=p50, std_ms=0.0)
        return ModelBenchmark(label=label, session_load_ms=1, rss_before_load_mib=1, peak_rss_mib=1, model_memory_mib=0,
                              batches=[BatchResult(batch_size=batch, input_prep_ms=0, latency=stats,
                                                   throughput_per_s=batch / p50 * 1e3, round_p50_ms=rounds)])

    return BenchmarkReport(threads=2, synchronized=True, speedup_vs_baseline={},
                           models=[model("onnxruntime-int8", candidate_rounds_ms),
                                   model("onnxruntime-fp32", fp32_rounds_ms)])


def test_the_lower_bound_is_a_low_round_and_needs_enough_rounds_for_the_level():
    assert rounds_needed(0.95) == 5 and rounds_needed(0.99) == 7
    assert speedup_lower_bound([1.5, 1.2, 1.9, 1.4, 1.6], 0.95) == 1.2  # 5 rounds: the smallest (96.9% >= 95%)
    assert speedup_lower_bound([1.5, 1.2, 1.9, 1.4, 1.6], 0.99) is None  # 5 rounds cannot bound at 99%
    assert speedup_lower_bound([1.0 + i / 100 for i in range(20)], 0.95) == pytest.approx(1.05)  # 20 rounds: the 6th


def test_a_build_measured_no_faster_than_fp32_is_not_signed_off_and_says_why():
    accuracy_passes = _Accuracy()
    same_speed = benefit_of(_bench([10.0, 10.2, 9.9, 10.1, 10.0], [10.1, 10.0, 10.2, 9.9, 10.0]), 8, 1.05, 0.95)
    verdict = decide(accuracy_passes, [], same_speed)
    assert verdict.outcome == "no measured benefit" and verdict.exit_code == 7 and not verdict.signed_off
    assert same_speed.batch == 8 and same_speed.lower_bound < 1.05 and "minimum 1.05x" in verdict.line()
    # One lucky round does not carry it: the bound is read over every round.
    lucky = benefit_of(_bench([10.0, 5.0, 10.0, 10.0, 10.0], [10.0, 10.0, 10.0, 10.0, 10.0]), 8, 1.05, 0.95)
    assert lucky.speedup == pytest.approx(1.0) and not lucky.passed
    faster = benefit_of(_bench([5.0, 5.1, 4.9, 5.0, 5.2], [10.0, 10.1, 9.8, 10.2, 10.0]), 8, 1.05, 0.95)
    assert decide(accuracy_passes, [], faster).outcome == "signed off" and faster.lower_bound > 1.8
    # A recipe can opt out (minimum 0): reported, not gated. An fp32 build has no benefit to show (None): exempt.
    assert decide(accuracy_passes, [], same_speed.model_copy(update={"min_speedup": 0})).signed_off
    assert decide(accuracy_passes, [], None).signed_off


def test_a_failed_check_decides_before_the_benefit_and_too_few_samples_is_its_own_outcome():
    slow = benefit_of(_bench([20.0] * 5, [10.0] * 5), 8, 1.05, 0.95)
    assert decide(_Accuracy(failures=["logits: cosine"]), [], slow).outcome == "gate failed"
    too_few = decide(_Accuracy(failures=["top-1"], verdict="insufficient", samples_needed=59), [], slow)
    assert too_few.outcome == "too few samples" and too_few.exit_code == 6 and too_few.samples_needed == 59
    assert decide(_Accuracy(), ["p99 over budget"], None).outcome == "gate failed"


class _Accuracy:
    """What decide() reads of an AccuracyReport."""

    def __init__(self, failures=(), verdict="pass", samples_needed=None):
        self.failures, self.verdict, self.samples_needed = list(failures), verdict, samples_needed
        self.checks, self.confidence = [], 0.95


def test_a_folder_from_before_verdicts_were_recorded_reads_its_manifest_as_one(no_benefit, tmp_path):
    from accel_opt.artifact.folder import Manifest

    manifest = json.loads((no_benefit[0] / "manifest.json").read_text())
    old = {k: v for k, v in manifest.items() if k != "verdict"} | {"format": 1, "signed_off": False, "exit_code": 6}
    assert Manifest.model_validate(old).verdict.outcome == "too few samples"
    assert Manifest.model_validate(old | {"signed_off": True, "exit_code": 0}).verdict.signed_off
    with pytest.raises(ValueError):  # a format-2 manifest without its verdict is not read as an old one
        Manifest.model_validate(old | {"format": 2})


# ---- end to end: exit 7, the folder kept and marked ---------------------------------------------------------------


def test_no_measured_benefit_is_exit_7_with_the_ratio_its_bound_and_the_batch(tiny_cnn_path, tmp_path):
    data = image_npz_folder(tmp_path / "data", 100)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({"name": "r", "benchmark": {**FAST_BENCH, "min_speedup": UNREACHABLE}}))
    done = CliRunner().invoke(main, ["build", str(tiny_cnn_path), "--precision", "fp16", "--data", str(data),
                                     "--recipe", str(recipe), "--out", str(tmp_path / "out"), "--json"])
    assert done.exit_code == 7, done.output
    payload = json.loads(done.stdout)
    benefit = payload["verdict"]["benefit"]
    assert payload["verdict"]["outcome"] == "no measured benefit" and payload["signed_off"] is False
    assert set(benefit) >= {"speedup", "lower_bound", "min_speedup", "batch"} and benefit["min_speedup"] == UNREACHABLE
    assert benefit["batch"] == 8  # the deployed batch (selection.target_batch_size), timed although not in batch_sizes
    folder = Path(payload["artifact_dir"])
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["verdict"]["outcome"] == "no measured benefit" and manifest["exit_code"] == 7
    assert "NOT SIGNED OFF: no measured benefit" in (folder / "signoff.md").read_text()
    assert "NOT SIGNED OFF: no measured benefit" in (folder / "signoff.html").read_text()
    people = CliRunner().invoke(main, ["build", str(tiny_cnn_path), "--precision", "fp16", "--data", str(data),
                                       "--recipe", str(recipe), "--out", str(tmp_path / "out")])
    assert people.exit_code == 7 and "no measured benefit" in people.stdout and "benefit: " in people.stdout


# ---- the door ------------------------------------------------------------------------------------------------------


def test_the_python_api_refuses_a_folder_that_is_not_signed_off_unless_allowed(no_benefit):
    folder, _ = no_benefit
    with pytest.raises(NotSignedOff) as refused:
        runtime.load(folder)
    assert refused.value.exit_code == 7 and "allow_not_signed_off=True" in str(refused.value)
    deployment = runtime.load(folder, allow_not_signed_off=True)
    assert deployment.not_signed_off and deployment.verdict.outcome == "no measured benefit"


def test_the_verdict_is_read_from_the_verified_copy_not_the_original(no_benefit, tmp_path, monkeypatch):
    """The race of issue 73: the original's manifest is flipped to "signed off" the moment the private copy is made.
    The door reads the copy, so the flip is never seen (the copy's check would refuse a changed copy anyway)."""
    import accel_opt.runtime as rt

    folder = tmp_path / "f"
    shutil.copytree(no_benefit[0], folder)
    real_copy = rt.private_copy

    def copy_then_flip(path):
        copy = real_copy(path)
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["verdict"] = Verdict(outcome="signed off").model_dump(mode="json")
        (folder / "manifest.json").write_text(json.dumps(manifest))
        return copy

    monkeypatch.setattr(rt, "private_copy", copy_then_flip)
    with pytest.raises(NotSignedOff):
        runtime.load(folder)


def test_the_ray_predictor_refuses_it_on_every_actor_unless_allowed(no_benefit):
    import numpy as np

    from accel_opt.runtime.ray.predictor import Predictor

    folder, data = no_benefit
    with pytest.raises(NotSignedOff):
        Predictor(folder)
    answered = Predictor(folder, allow_not_signed_off=True)({"input": np.array([str(next(data.iterdir()))])})
    assert answered.column("error").to_pylist() == [None]


@pytest.mark.parametrize("command", [["bench", "{F}"], ["compare", "{F}", "{F}", "--data", "{D}"],
                                     ["verify", "{F}", "--accuracy"],
                                     ["run", "{F}", "{D}", "--out", "{P}"]])
def test_every_command_refuses_it_with_the_verdicts_code_and_says_so_when_allowed(no_benefit, tmp_path, command):
    folder, data = no_benefit
    args = [a.format(F=folder, D=data, P=tmp_path / "p.jsonl") for a in command]
    refused = CliRunner().invoke(main, args)
    assert refused.exit_code == 7 and "NOT signed off: no measured benefit" in refused.stderr, refused.output
    assert "--allow-not-signed-off" in refused.stderr and not (tmp_path / "p.jsonl").exists()
    allowed = CliRunner().invoke(main, [*args, "--allow-not-signed-off"])
    said = allowed.stdout + allowed.stderr
    # verify's exit is the verdict's: the re-check ran, and the verdict is still not a sign-off
    if command[0] == "verify":
        assert allowed.exit_code == 7 and "accuracy re-checked here" in said, allowed.output
    else:
        assert allowed.exit_code == 0, allowed.output
        assert "ran a folder that is NOT signed off (--allow-not-signed-off)" in said


def test_verify_reports_the_verdict_without_running_the_folder(no_benefit):
    folder, _ = no_benefit
    done = CliRunner().invoke(main, ["verify", str(folder), "--json"])
    payload = json.loads(done.stdout)
    assert done.exit_code == 7 and payload["verdict"]["outcome"] == "no measured benefit" and not payload["signed_off"]
