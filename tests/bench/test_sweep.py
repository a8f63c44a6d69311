"""The batch size x concurrency sweep, the recommendation within budgets, and the capacity check."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from accel_opt.backends.onnxruntime.backend import reference_runner
from accel_opt.bench.sweep import SweepPoint, capacity, recommend, sweep
from accel_opt.builder.pipeline import build
from accel_opt.recipe.stages import BenchmarkConfig

from ..conftest import FAST_BENCH, matmul_model, save

QUICK = BenchmarkConfig(concurrency=[1, 2], window_seconds=0.02, max_windows=6)


def _point(batch, workers, p99, throughput, memory=100.0):
    return SweepPoint(batch_size=batch, concurrency=workers, p50_ms=p99 / 2, p90_ms=p99 * 0.8, p99_ms=p99,
                      throughput_per_s=throughput, peak_memory_mib=memory, windows=4, stable=True)


def test_sweep_measures_every_point_with_real_sessions(tmp_path):
    path = save(matmul_model(in_shape=("batch", 64), out_dim=64), tmp_path / "m.onnx")
    samples = [{"x": np.ones((1, 64), np.float32)}]
    points = sweep(lambda: reference_runner(path, 1), samples, [1, 2, 4], QUICK)
    assert [(p.batch_size, p.concurrency) for p in points] == [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2)]
    assert all(p.throughput_per_s > 0 and p.p50_ms <= p.p99_ms and p.peak_memory_mib > 0 for p in points)
    assert all(4 <= p.windows <= QUICK.max_windows for p in points)


def test_recommendation_is_the_best_throughput_within_the_budgets():
    points = [_point(1, 1, 2.0, 500), _point(8, 1, 12.0, 900), _point(8, 2, 30.0, 1000, memory=900)]
    best, why = recommend(points, BenchmarkConfig())
    assert (best.batch_size, best.concurrency) == (8, 2) and "no budget set" in why
    best, why = recommend(points, BenchmarkConfig(p99_budget_ms=20))
    assert (best.batch_size, best.concurrency) == (8, 1) and "p99 <= 20 ms" in why
    best, _ = recommend(points, BenchmarkConfig(memory_budget_mib=500, p99_budget_ms=5))
    assert (best.batch_size, best.concurrency) == (1, 1)
    none, why = recommend(points, BenchmarkConfig(p99_budget_ms=1))
    assert none is None and "no batch size x concurrency meets the budgets" in why and "2.00 ms" in why


def test_capacity_is_the_largest_batch_at_the_highest_concurrency():
    points = [_point(1, 1, 2.0, 500, memory=100), _point(8, 2, 30.0, 1000, memory=900)]
    assert capacity(points, BenchmarkConfig()).passed
    tight = capacity(points, BenchmarkConfig(memory_budget_mib=500))
    assert not tight.passed and (tight.batch_size,
                                 tight.concurrency) == (8, 2) and "900 MiB > the 500 MiB budget" in tight.line


def test_a_memory_budget_too_small_fails_the_build_with_the_numbers(tiny_cnn_path, fast_recipe, tmp_path):
    recipe = fast_recipe.with_overrides(benchmark={**FAST_BENCH, "concurrency": [1, 2], "memory_budget_mib": 1})
    result = build(tiny_cnn_path, recipe, out_dir=tmp_path)
    assert not result.signed_off and result.exit_code == 1
    assert any("no batch size x concurrency meets the budgets" in f for f in result.failures)
    assert any("the 1 MiB budget" in f for f in result.failures)  # capacity
    folder = Path(result.artifact_dir)
    bench = json.loads((folder / "benchmark.json").read_text())
    assert len(bench["sweep"]) == 4 and bench["recommended"] is None and bench["capacity"]["passed"] is False
    assert "NOT SIGNED OFF" in (folder / "signoff.html").read_text()
    config = json.loads((folder / "resource_config.json").read_text())
    assert config["recommended"]["batch_size"] is None and config["recommended"]["budgets"]["memory_mib"] == 1
    roomy = build(tiny_cnn_path, fast_recipe.with_overrides(benchmark={**FAST_BENCH, "memory_budget_mib": 100000}),
                  out_dir=tmp_path)
    assert roomy.signed_off
    assert json.loads((Path(roomy.artifact_dir)
                       / "resource_config.json").read_text())["recommended"]["batch_size"] in (1, 2)


def test_a_worker_that_fails_stops_the_point_with_its_error(tmp_path):
    import pytest

    path = save(matmul_model(in_shape=("batch", 4), out_dim=4), tmp_path / "m.onnx")
    wrong = [{"x": np.ones((1, 5), np.float32)}]  # the model takes 4 columns: every call fails
    with pytest.raises(Exception, match="(?i)invalid|dimension|shape"):
        sweep(lambda: reference_runner(path, 1), wrong, [1], QUICK)


def test_capacity_runs_at_the_max_shapes(tmp_path, fast_recipe):
    from onnx import TensorProto, helper

    from ..conftest import make_model

    # y = x * 2 on [batch, n]: memory grows with both dims; n is dynamic, so only --max-shapes reaches its peak.
    model = save(make_model([helper.make_node("Add", ["x", "x"], ["y"])],
                            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "n"])]),
                 tmp_path / "add.onnx")
    bench = {**FAST_BENCH, "max_shapes": {"x": [4, 4_000_000]}, "memory_budget_mib": 100000}
    result = build(model, fast_recipe.with_overrides(shapes={"x": [1, 16]}, benchmark=bench), out_dir=tmp_path / "out")
    cap = json.loads((Path(result.artifact_dir) / "benchmark.json").read_text())["capacity"]
    assert cap["shapes"] == {"x": [4, 4_000_000]} and cap["passed"]
    assert cap["peak_memory_mib"] > 100  # 4 x 4M floats in and out: 2 x 61 MiB at least
    tight = {**bench, "memory_budget_mib": 50 + cap["peak_memory_mib"] / 2}
    failed = build(model, fast_recipe.with_overrides(shapes={"x": [1, 16]}, benchmark=tight), out_dir=tmp_path / "out")
    assert not failed.signed_off and any("shapes x:4x4000000" in f and "MiB budget" in f for f in failed.failures)


@pytest.mark.slow
def test_running_out_of_memory_at_the_largest_shapes_is_a_measured_limit_not_a_crash(tmp_path, fast_recipe):
    """Each row expands to 2^26 floats (256 MiB): batch 1 and 2 run; --max-shapes at batch 1024 asks ONNX Runtime's
    arena for 256 GiB, a real allocation failure. The build signs off with the limit recorded where it was found."""
    from onnx import TensorProto, helper, numpy_helper

    from ..conftest import make_model

    model = save(make_model(
        [helper.make_node("Expand", ["x", "wide"], ["big"]),
         helper.make_node("ReduceSum", ["big", "axis"], ["y"], keepdims=0)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch"])],
        [numpy_helper.from_array(np.array([1, 1 << 26], np.int64), "wide"),
         numpy_helper.from_array(np.array([1]), "axis")]),
        tmp_path / "wide.onnx")
    bench = {**FAST_BENCH, "max_shapes": {"x": [1024, 1]}}
    recipe = fast_recipe.with_overrides(shapes={"x": [1, 1]}, benchmark=bench, **{"selection.target_batch_size": 2,
                                                                                    "cleanup.enabled": False})
    result = build(model, recipe, out_dir=tmp_path / "out")
    assert result.signed_off, result.failures
    report = json.loads((Path(result.artifact_dir) / "benchmark.json").read_text())
    cap = report["capacity"]
    assert cap["out_of_memory"] and "Failed to allocate" in cap["out_of_memory"] and cap["shapes"] == {"x": [1024, 1]}
    assert "ran out of memory (the measured limit)" in cap["line"]
    assert "ran out of memory (the measured limit)" in (Path(result.artifact_dir) / "benchmark.md").read_text()


def test_max_shapes_are_checked_before_any_work(tmp_path, fast_recipe):
    import pytest

    from accel_opt.errors import UsageError

    model = save(matmul_model(), tmp_path / "m.onnx")
    with pytest.raises(UsageError, match="rank 3 given"):
        build(model, fast_recipe.with_overrides(benchmark={**FAST_BENCH, "max_shapes": {"x": [1, 2, 3]}}),
              out_dir=tmp_path)


def test_flops_are_counted_from_the_graph(tmp_path, tiny_cnn_path, fast_recipe):
    from accel_opt.bench.efficiency import count_flops

    model = save(matmul_model(in_shape=("batch", 64), out_dim=32), tmp_path / "mm.onnx")
    flops, weight_bytes, io_bytes = count_flops(model, {"x": [3, 64]})
    assert flops == 2 * 3 * 64 * 32 and weight_bytes == 64 * 32 * 4 and io_bytes == (3 * 64 + 3 * 32) * 4
    result = build(tiny_cnn_path, fast_recipe, out_dir=tmp_path / "out")
    eff = json.loads((Path(result.artifact_dir) / "benchmark.json").read_text())["efficiency"]
    assert eff["gflop_per_sample"] > 0 and eff["fp32_ceiling_gflops"] > 0 and eff["memory_gib_per_s"] > 0
    assert [b["batch_size"] for b in eff["batches"]] == [1, 2]
    assert all(b["bound"] in ("compute", "memory") and b["achieved_gflops"] > 0 for b in eff["batches"])
