"""`accel-opt bench`: time a built artifact again, through the runtime, without rebuilding it.

The same harness as the build's benchmark stage, on the deployment loaded from the folder (verified
first), with the build's benchmark settings from its manifest unless given; samples from `--data`
(read with the artifact's preprocessing) or seeded synthetic ones at the deployed shapes.
"""

from __future__ import annotations

from pathlib import Path

from accel_opt.bench import BenchmarkReport, deployment_target, run_benchmark
from accel_opt.data import DataSummary
from accel_opt.errors import UsageError
from accel_opt.machine.cpu import available_cpus
from accel_opt.recipe import BenchmarkConfig, Recipe
from accel_opt.runtime import Deployment, read_manifest

SYNTHETIC_SAMPLES = 8


def benchmark_artifact(
    deployment: Deployment, data_dir: str | Path | None = None, batch_sizes: list[int] | None = None,
    config: BenchmarkConfig | None = None,
) -> tuple[BenchmarkReport, DataSummary]:
    """Benchmark `deployment` at `batch_sizes` (default: the build's, or the fixed batch)."""
    resource = deployment.config
    built = Recipe.model_validate(read_manifest(deployment.folder).recipe["resolved"])
    config = config or built.benchmark
    samples, data = deployment.samples(data_dir, SYNTHETIC_SAMPLES, built.accuracy.seed)
    if batch_sizes is None:
        batch_sizes = config.batch_sizes if resource.batch_dynamic else [resource.batch_size]
    elif not resource.batch_dynamic and batch_sizes != [resource.batch_size]:
        raise UsageError(f"{deployment.folder.name} runs at batch {resource.batch_size} only (its model fixes the batch)")
    threads = resource.threads or available_cpus()
    target = deployment_target(deployment, {name: array.dtype for name, array in samples[0].items()})
    return run_benchmark([target], samples, batch_sizes, config, threads, resource.batch_axes), data
