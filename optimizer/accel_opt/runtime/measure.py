"""`accel-opt bench`: time a built artifact again, through the runtime, without rebuilding it.

The same harness as the build's benchmark stage, on the deployment loaded from the folder (verified
first), with the build's benchmark settings from its manifest unless given; samples from `--data`
(read with the artifact's preprocessing) or seeded synthetic ones at the deployed shapes.
"""

from __future__ import annotations

from pathlib import Path

from accel_opt.accuracy import Check
from accel_opt.bench import BenchmarkReport, deployment_target, run_benchmark
from accel_opt.data import DataSummary
from accel_opt.errors import GateFailed, UsageError
from accel_opt.machine.cpu import available_cpus
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.stages import BenchmarkConfig
from accel_opt.runtime import Deployment, read_manifest

SYNTHETIC_SAMPLES = 8


def benchmark_artifact(
    deployment: Deployment, data_dir: str | Path | None = None, batch_sizes: list[int] | None = None,
    config: BenchmarkConfig | None = None,
) -> tuple[BenchmarkReport, DataSummary]:
    """Benchmark `deployment` at `batch_sizes` (default: the build's, or the fixed batch)."""
    resource = deployment.config
    built = Recipe.model_validate(read_manifest(deployment.files).recipe["resolved"])
    config = config or built.benchmark
    samples, data = deployment.samples(data_dir, SYNTHETIC_SAMPLES, built.accuracy.seed)
    if batch_sizes is None:
        batch_sizes = config.batch_sizes if resource.batch_dynamic else [resource.batch_size]
    elif not resource.batch_dynamic and batch_sizes != [resource.batch_size]:
        raise UsageError(f"{deployment.folder.name} runs at batch {resource.batch_size} only (its model fixes the "
                         "batch)")
    threads = resource.threads or available_cpus()
    target = deployment_target(deployment, {name: array.dtype for name, array in samples[0].items()})
    return run_benchmark([target], samples, batch_sizes, config, threads, resource.batch_axes), data


def verified_check(deployment: Deployment) -> Check:
    """The folder was verified when it loaded (runtime.load refuses otherwise): say what that covered."""
    manifest = read_manifest(deployment.files)
    return Check(name="verified", passed=True,
                 line=f"{deployment.signature}; {len(manifest.artifacts)} files match manifest.json; "
                      f"{manifest.backend} "
                      f"{manifest.precision} runs here as built")


def sign_off_check(deployment: Deployment, recheck_allowed: bool = True) -> Check:
    """Whether the folder's sign-off holds for this machine's kernels: the same class, or a passing re-check on the
    probe set (run here unless `recheck_allowed` is False, remembered like `run`'s)."""
    from accel_opt.runtime.probe import signed_off_here

    try:
        line = signed_off_here(deployment, recheck_allowed=recheck_allowed)
    except GateFailed as exc:
        return Check(name="signed off here", passed=False, line=str(exc))
    where = deployment.scope()
    passed = where.same_class or bool(where.remembered)
    return Check(name="signed off here", passed=passed, line=line or where.line(deployment.folder))


def limit_checks(report: BenchmarkReport, max_p99_ms: float | None, min_throughput: float | None) -> list[Check]:
    """The limits a caller gave, on what was just measured: p99 at every batch size, the best throughput."""
    batches = report.models[0].batches
    checks = [Check(name=f"p99 at batch {b.batch_size}", passed=b.latency.p99_ms <= max_p99_ms,
                    line=f"p99 {b.latency.p99_ms:.2f} ms {'<=' if b.latency.p99_ms <= max_p99_ms else '>'} "
                         f"{max_p99_ms:g} ms")
              for b in batches] if max_p99_ms is not None else []
    if min_throughput is not None:
        best = max(batches, key=lambda b: b.throughput_per_s)
        checks.append(Check(name="throughput", passed=best.throughput_per_s >= min_throughput,
                            line=f"{best.throughput_per_s:.1f} samples/s at batch {best.batch_size} "
                                 f"{'>=' if best.throughput_per_s >= min_throughput else '<'} {min_throughput:g}"))
    return checks
