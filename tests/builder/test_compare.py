"""`accel-opt compare`: two real builds of different speed, interleaved, gated on regression."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from accel_opt import zoo
from accel_opt.builder.pipeline import build
from accel_opt.cli import main


@pytest.fixture(scope="module")
def fast_and_slow(tiny_cnn_path, tmp_path_factory):
    """The tiny CNN and a 16x wider one with the same input: one model family, two speeds."""
    from accel_opt.recipe.load import load_recipe

    from ..conftest import FAST_BENCH

    out = tmp_path_factory.mktemp("out")
    wide = zoo.save(zoo.resnet(layout=(1, 1), width=32, num_classes=10, image_size=32, seed=1),
                    tmp_path_factory.mktemp("models") / "wide_cnn.onnx")
    recipe = load_recipe().with_overrides(benchmark={**FAST_BENCH, "min_seconds": 0.3},
                                          **{"accuracy.synthetic_samples": 4})
    fast = build(tiny_cnn_path, recipe, out_dir=out)
    slow = build(wide, recipe, out_dir=out)
    return Path(fast.artifact_dir), Path(slow.artifact_dir)


def _compare(*args):
    return CliRunner().invoke(main, ["compare", *map(str, args), "--json"])


def test_a_slower_candidate_fails_the_latency_gate(fast_and_slow, tmp_path):
    fast, slow = fast_and_slow
    junit = tmp_path / "compare.xml"
    result = _compare(fast, slow, "--max-latency-regression", "10", "--junit", junit)
    assert result.exit_code == 1, result.stderr
    payload = json.loads(result.stdout)
    assert payload["throughput_ratio"] < 0.9 and payload["latency_regression_pct"] > 10
    failed = [c for c in payload["checks"] if not c["passed"]]
    assert [c["name"] for c in failed] == ["latency regression"] and "slower per sample" in failed[0]["line"]
    assert "<failure" in junit.read_text()


def test_a_faster_candidate_passes_and_reports_both_sides(fast_and_slow):
    fast, slow = fast_and_slow
    result = _compare(slow, fast, "--max-latency-regression", "10", "--max-accuracy-drop", "0.01")
    assert result.exit_code == 0, result.stdout
    payload = json.loads(result.stdout)
    assert payload["throughput_ratio"] > 1.1 and payload["candidate"]["accuracy"]["failures"] == []
    assert payload["quality_metric"] == "worst output cosine" and payload["accuracy_drop"] <= 0
    human = CliRunner().invoke(main, ["compare", str(slow), str(fast)])
    assert human.exit_code == 0 and "| candidate |" in human.stdout and "Throughput ratio" in human.stdout


def test_the_reference_must_still_be_the_one_built_from(fast_and_slow, tmp_path):
    fast, slow = fast_and_slow
    result = _compare(fast, slow, "--reference", tmp_path / "missing.onnx")
    assert result.exit_code == 2 and "--reference" in result.stderr
