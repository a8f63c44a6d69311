"""Whole-path timing harness: session load, input preparation and compute, timed separately.

Each timed call is `runner.infer()` followed by the backend's synchronize(), measured around the
whole call with perf_counter: what an application sees, not a device-side kernel time. Several
models (the candidate and its fp32 baseline) are measured in interleaved rounds in one run, so a
noisy neighbour hurts both alike and their ratio stays honest.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from polygraphy.backend.base import BaseRunner
from pydantic import BaseModel

from accel_opt.accuracy import Check
from accel_opt.bench.application import JobTiming, StageTimes
from accel_opt.bench.efficiency import Efficiency
from accel_opt.bench.memory import peak_rss_mib, reset_peak_rss_mib
from accel_opt.bench.sweep import Capacity, Recommendation, SweepPoint
from accel_opt.bench.text_capacity import LengthBucket
from accel_opt.data import BatchAxes, Sample, batch_of
from accel_opt.errors import termination_requested
from accel_opt.files import progress
from accel_opt.recipe.stages import BenchmarkConfig

log = logging.getLogger(__name__)
ROUNDS = 5  # interleaved rounds per batch size


class LatencyStats(BaseModel):
    iterations: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    std_ms: float


class BatchResult(BaseModel):
    batch_size: int
    input_prep_ms: float  # building the feed dict from samples (the application's preprocessing share)
    latency: LatencyStats
    throughput_per_s: float  # samples (batch rows) per second at p50
    # p50 of each interleaved round: a round times every target back to back, so a round's ratio between two targets
    # is what a noisy neighbour spares (report.verdict bounds the speed-up over them).
    round_p50_ms: list[float] = []


class ModelBenchmark(BaseModel):
    label: str
    session_load_ms: float
    rss_before_load_mib: float
    peak_rss_mib: float  # process high-water mark after load and a run at the largest batch
    model_memory_mib: float  # peak minus what the process held before loading this model
    batches: list[BatchResult]

    def at(self, batch_size: int) -> BatchResult | None:
        return next((b for b in self.batches if b.batch_size == batch_size), None)


class BenchmarkReport(BaseModel):
    threads: int
    synchronized: bool
    models: list[ModelBenchmark]  # candidate first, then baselines
    speedup_vs_baseline: dict[str, dict[int, float]]  # baseline label -> batch -> baseline p50 / candidate p50
    # Backends with async requests (OpenVINO): samples/s per stream count at the target batch.
    concurrency: list[dict[str, Any]] = []
    # The candidate's batch size x concurrency sweep, the best point within the budgets, and capacity.
    sweep: list[SweepPoint] = []
    recommended: Recommendation | None = None
    recommendation: str = ""  # why that point, or why no point meets the budgets
    capacity: Capacity | None = None
    checks: list[Check] = []  # the budgets and capacity, as gate checks (a failed one fails the build, exit 1)
    # The application around the model (builds with --data): a batch's time per stage, and the whole job.
    stages_ms: list[StageTimes] = []
    stage_note: str = ""
    jobs: list[JobTiming] = []
    efficiency: Efficiency | None = None  # FLOPs and bytes from the graph against host probes of this run
    length_buckets: list[LengthBucket] = []  # text builds: memory per text length and the batch that fits the budget

    @property
    def failures(self) -> list[str]:
        return [c.line for c in self.checks if not c.passed]


@dataclass
class Target:
    label: str
    runner: BaseRunner
    synchronize: Callable[[], None] = lambda: None
    samples: list[Sample] | None = None  # this target's own inputs (fused preprocessing), else the run's


def deployment_target(deployment, feed_dtypes: dict[str, Any] | None = None, label: str | None = None,
                      samples: list[Sample] | None = None) -> Target:
    """A benchmark target of a runtime.Deployment (labels must differ between the targets of one run), fed
    `samples` if given."""
    config = deployment.config
    return Target(label or f"{config.backend}-{config.precision.value}", deployment.runner(feed_dtypes),
                  deployment.backend.synchronize, samples)


def latency_stats(seconds: list[float]) -> LatencyStats:
    ms = np.asarray(seconds) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return LatencyStats(
        iterations=len(ms),
        p50_ms=float(p50),
        p90_ms=float(p90),
        p99_ms=float(p99),
        mean_ms=float(ms.mean()),
        min_ms=float(ms.min()),
        max_ms=float(ms.max()),
        std_ms=float(ms.std()),
    )


def timed_calls(call: Callable[[], object], min_iterations: int, min_seconds: float,
                max_iterations: int) -> list[float]:
    """Per-call wall seconds: at least `min_iterations` and `min_seconds`, at most `max_iterations`. A SIGTERM that a
    runtime swallowed while a call ran ends the benchmark after this window (errors.termination_requested: checked
    once per window, not between the timed calls)."""
    times: list[float] = []
    clock = time.perf_counter
    deadline = clock() + min_seconds
    while len(times) < max_iterations and (len(times) < min_iterations or clock() < deadline):
        start = clock()
        call()
        times.append(clock() - start)
    if (asked := termination_requested()) is not None:
        raise asked
    return times


def run_benchmark(
    targets: list[Target], samples: list[Sample], batch_sizes: list[int], config: BenchmarkConfig, threads: int,
    batch_axes: BatchAxes | None = None, rounds: int = ROUNDS,
) -> BenchmarkReport:
    """Load each target (memory measured), then time every batch size in `rounds` interleaved rounds (at least
    ROUNDS). Only inputs with a batch axis (`batch_axes`; default: axis 0 of every input that has one) are batched."""
    labels = [t.label for t in targets]
    if len(set(labels)) != len(labels):
        raise ValueError(f"benchmark targets need distinct labels, got {labels}")
    loads: dict[str, tuple[float, float, float]] = {}
    try:
        for target in targets:
            biggest = batch_of(target.samples or samples, max(batch_sizes), batch_axes)
            rss_before = reset_peak_rss_mib()
            start = time.perf_counter()
            target.runner.activate()
            load_ms = (time.perf_counter() - start) * 1e3
            target.runner.infer(biggest, check_inputs=True)
            target.synchronize()
            loads[target.label] = (load_ms, rss_before, peak_rss_mib())

        rounds = max(rounds, ROUNDS)
        per_batch: dict[str, list[BatchResult]] = {t.label: [] for t in targets}
        for batch in batch_sizes:
            start = time.perf_counter()
            feeds = {t.label: batch_of(t.samples or samples, batch, batch_axes) for t in targets}
            prep_ms = (time.perf_counter() - start) * 1e3 / len(targets)
            for target in targets:
                for _ in range(config.warmup_iterations):
                    target.runner.infer(feeds[target.label], check_inputs=False)
                target.synchronize()
            times: dict[str, list[list[float]]] = {t.label: [] for t in targets}
            per_round = dict(
                min_iterations=math.ceil(config.min_iterations / rounds),
                min_seconds=config.min_seconds / rounds,
                max_iterations=math.ceil(config.max_iterations / rounds),
            )
            for done in range(rounds):
                progress.info("batch %d, round %d of %d (%s)", batch, done + 1, rounds, ", ".join(labels))
                for target in targets:
                    times[target.label].append(timed_calls(infer_and_sync(target, feeds[target.label]), **per_round))
            for target in targets:
                stats = latency_stats([t for one in times[target.label] for t in one])
                per_batch[target.label].append(
                    BatchResult(
                        batch_size=batch,
                        input_prep_ms=prep_ms,
                        latency=stats,
                        throughput_per_s=batch / (stats.p50_ms / 1e3),
                        round_p50_ms=[float(np.median(one)) * 1e3 for one in times[target.label]],
                    )
                )
    finally:
        for target in targets:
            if target.runner.is_active:
                target.runner.deactivate()

    models = [
        ModelBenchmark(
            label=t.label,
            session_load_ms=loads[t.label][0],
            rss_before_load_mib=loads[t.label][1],
            peak_rss_mib=loads[t.label][2],
            model_memory_mib=max(0.0, loads[t.label][2] - loads[t.label][1]),
            batches=per_batch[t.label],
        )
        for t in targets
    ]
    candidate, baselines = models[0], models[1:]
    speedups = {
        base.label: {b.batch_size: base.at(b.batch_size).latency.p50_ms / b.latency.p50_ms for b in candidate.batches}
        for base in baselines
    }
    return BenchmarkReport(threads=threads, synchronized=True, models=models, speedup_vs_baseline=speedups)


def infer_and_sync(target: Target, feed: Sample) -> Callable[[], object]:
    """The timed unit: one inference on `feed`, then the backend's synchronize."""
    infer, sync = target.runner.infer, target.synchronize

    def call():
        infer(feed, check_inputs=False)
        sync()

    return call
