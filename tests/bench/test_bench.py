import numpy as np

from accel_opt.backends.onnxruntime.backend import reference_runner
from accel_opt.bench import Target, latency_stats, run_benchmark, timed_calls
from accel_opt.recipe.stages import BenchmarkConfig

from ..conftest import matmul_model, save


def test_latency_stats_percentiles():
    stats = latency_stats([0.001 * i for i in range(1, 101)])
    assert stats.iterations == 100
    assert stats.p50_ms == np.percentile(np.arange(1, 101), 50)
    assert stats.min_ms == 1 and stats.max_ms == 100 and stats.p99_ms > stats.p90_ms > stats.p50_ms


def test_timed_calls_respects_bounds():
    assert len(timed_calls(lambda: None, min_iterations=7, min_seconds=0, max_iterations=100)) == 7
    assert len(timed_calls(lambda: None, min_iterations=1, min_seconds=10, max_iterations=20)) == 20


def test_run_benchmark_measures_each_batch_and_ratio(tmp_path):
    path = save(matmul_model(in_shape=("batch", 64), out_dim=64), tmp_path / "m.onnx")
    config = BenchmarkConfig(warmup_iterations=2, min_iterations=10, min_seconds=0.01, max_iterations=40)
    samples = [{"x": np.ones((1, 64), np.float32)}]
    synced = []
    targets = [Target("a", reference_runner(path, 1), lambda: synced.append(1)), Target("b", reference_runner(path, 1))]
    report = run_benchmark(targets, samples, [1, 4], config, threads=1)
    assert [m.label for m in report.models] == ["a", "b"]
    candidate = report.models[0]
    assert [b.batch_size for b in candidate.batches] == [1, 4]
    assert all(b.latency.iterations >= 10 for b in candidate.batches)
    assert candidate.batches[1].throughput_per_s > 0 and candidate.peak_rss_mib > 0
    assert set(report.speedup_vs_baseline["b"]) == {1, 4}
    assert len(synced) >= 20  # synchronize runs after every timed call
    assert not any(t.runner.is_active for t in targets)
