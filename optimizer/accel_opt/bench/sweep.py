"""Throughput sweep over batch size x concurrency, the recommendation within budgets, and capacity.

Each point runs `concurrency` workers, each with its own runner (session / compiled model) since not
every runtime shares one safely between threads, sending requests back to back. Throughput is
measured, not derived from a latency: completed samples over wall time, in windows, until the last
three windows agree within `stability_pct` (perf_analyzer's stability criterion; the first window
is warm-up and discarded). Peak process memory is read per point, so the capacity point (the largest
batch at the highest concurrency) shows memory that runs out only at peak load.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np
from polygraphy.backend.base import BaseRunner
from pydantic import BaseModel

from accel_opt.bench.memory import peak_rss_mib, reset_peak_rss_mib
from accel_opt.data import BatchAxes, Sample, batch_of
from accel_opt.errors import first_line
from accel_opt.recipe.stages import BenchmarkConfig

log = logging.getLogger(__name__)

STABLE_WINDOWS = 3


class SweepPoint(BaseModel):
    batch_size: int
    concurrency: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    throughput_per_s: float  # samples completed per second over the measured windows
    peak_memory_mib: float  # process high-water mark during this point
    windows: int
    stable: bool  # the last 3 windows agreed within stability_pct (else max_windows ran out)
    device_peak_memory_mib: float | None = None  # GPU runners: torch.cuda.max_memory_allocated over the point
    out_of_memory: str | None = None  # the point ran out of memory (the error's line): a measured limit, no timings


class Recommendation(BaseModel):
    batch_size: int
    concurrency: int
    throughput_per_s: float
    p99_ms: float
    peak_memory_mib: float
    reason: str


class Capacity(BaseModel):
    batch_size: int
    concurrency: int
    shapes: dict[str, list[int]] = {}  # --max-shapes, when the capacity point ran at them (else the swept ones)
    p99_ms: float | None = None
    peak_memory_mib: float
    memory_budget_mib: float | None
    passed: bool
    line: str
    device_peak_memory_mib: float | None = None
    out_of_memory: str | None = None  # where the deployment's memory ran out: its limit, recorded (not a failure)


def sweep(make_runner: Callable[[], BaseRunner], samples: list[Sample], batch_sizes: list[int], config: BenchmarkConfig,
          batch_axes: BatchAxes | None = None, synchronize: Callable[[], None] = lambda: None) -> list[SweepPoint]:
    """Every batch size x concurrency level of `config`; `make_runner()` gives a fresh, inactive runner."""
    return [_point(make_runner, batch_of(samples, batch, batch_axes), batch, workers, config, synchronize)
            for batch in batch_sizes for workers in config.concurrency]


def out_of_memory(exc: BaseException) -> bool:
    """An allocation failure of the host or a device (torch.cuda.OutOfMemoryError, ONNX Runtime's and TensorRT's
    'out of memory' / 'Failed to allocate'), as opposed to any other error."""
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or "out of memory" in text \
        or "failed to allocate" in text


def _point(make_runner, feed: Sample, batch: int, concurrency: int, config: BenchmarkConfig, synchronize) -> SweepPoint:
    """One batch size x concurrency, measured; running out of memory there is recorded as the point's limit."""
    try:
        return _measure_point(make_runner, feed, batch, concurrency, config, synchronize)
    except Exception as exc:
        if not out_of_memory(exc):
            raise
        log.warning("batch %d x %d ran out of memory: %s", batch, concurrency, first_line(exc))
        _release_device_memory()
        return SweepPoint(batch_size=batch, concurrency=concurrency, p50_ms=0.0, p90_ms=0.0, p99_ms=0.0,
                          throughput_per_s=0.0, peak_memory_mib=peak_rss_mib(), windows=0, stable=False,
                          out_of_memory=first_line(exc))


def _release_device_memory() -> None:
    import sys

    torch = sys.modules.get("torch")  # only where a runner imported it
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _measure_point(make_runner, feed: Sample, batch: int, concurrency: int, config: BenchmarkConfig,
                   synchronize) -> SweepPoint:
    runners = [make_runner() for _ in range(concurrency)]
    reset_peak_rss_mib()
    try:
        for runner in runners:
            runner.activate()
            runner.infer(feed, check_inputs=False)  # warm-up, compile on first use
    except BaseException:
        for runner in runners:
            if runner.is_active:
                runner.deactivate()
        raise
    stop = threading.Event()
    done: list[list[tuple[float, float]]] = [[] for _ in runners]  # (finish time, latency) per worker
    errors: list[BaseException] = []

    def work(runner: BaseRunner, log: list[tuple[float, float]]) -> None:
        clock = time.perf_counter
        try:
            while not stop.is_set():
                start = clock()
                runner.infer(feed, check_inputs=False)
                synchronize()
                end = clock()
                log.append((end, end - start))
        except BaseException as exc:  # re-raised by the measuring thread: a dead worker must not look idle
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=work, args=(r, log), daemon=True) for r, log in zip(runners, done)]
    try:
        for thread in threads:
            thread.start()
        edges = [time.perf_counter()]
        rates: list[float] = []
        while len(rates) < config.max_windows and not errors:
            time.sleep(config.window_seconds)
            edges.append(time.perf_counter())
            finished = sum(1 for log in done for end, _ in log if edges[-2] <= end < edges[-1])
            rates.append(finished * batch / (edges[-1] - edges[-2]))
            last = rates[1:][-STABLE_WINDOWS:]  # the first window is warm-up
            if len(last) == STABLE_WINDOWS and _spread_pct(last) <= config.stability_pct:
                break
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        peak = peak_rss_mib()
        device_peaks = [m for r in runners if (m := getattr(_timed(r), "peak_memory_mib", None)) is not None]
        for runner in runners:
            runner.deactivate()
    if errors:
        raise errors[0]
    measured_from, measured_to = edges[1], edges[-1]
    latencies = np.asarray([lat for log in done for end, lat in log if measured_from <= end < measured_to] or
                           [lat for log in done for _, lat in log]) * 1e3
    completed = sum(1 for log in done for end, _ in log if measured_from <= end < measured_to)
    p50, p90, p99 = np.percentile(latencies, [50, 90, 99])
    stable_windows = rates[1:][-STABLE_WINDOWS:]
    return SweepPoint(batch_size=batch, concurrency=concurrency, p50_ms=float(p50), p90_ms=float(p90),
                      p99_ms=float(p99),
                      throughput_per_s=completed * batch / max(measured_to - measured_from, 1e-9), peak_memory_mib=peak,
                      windows=len(rates), device_peak_memory_mib=max(device_peaks) if device_peaks else None,
                      stable=len(stable_windows) == STABLE_WINDOWS
                      and _spread_pct(stable_windows) <= config.stability_pct)


def _timed(runner: BaseRunner) -> BaseRunner:
    """The runner that does the work, through wrappers that keep it as `.inner` (base.CastInputsRunner)."""
    while getattr(runner, "inner", None) is not None:
        runner = runner.inner
    return runner


def _spread_pct(rates: list[float]) -> float:
    mean = statistics.fmean(rates)
    return (max(rates) - min(rates)) / mean * 100 if mean > 0 else float("inf")


def recommend(points: list[SweepPoint], config: BenchmarkConfig) -> tuple[Recommendation | None, str]:
    """The point with the best throughput within the budgets, and why (or why none qualifies)."""
    def fits(p: SweepPoint) -> bool:
        return ((config.p99_budget_ms is None or p.p99_ms <= config.p99_budget_ms)
                and (config.memory_budget_mib is None or p.peak_memory_mib <= config.memory_budget_mib))

    budgets = []
    if config.p99_budget_ms is not None:
        budgets.append(f"p99 <= {config.p99_budget_ms:g} ms")
    if config.memory_budget_mib is not None:
        budgets.append(f"peak memory <= {config.memory_budget_mib:g} MiB")
    ran = [p for p in points if p.out_of_memory is None]
    within = [p for p in ran if fits(p)]
    if not ran:
        return None, "every point ran out of memory: " + points[0].out_of_memory
    if not within:
        best = min(ran, key=lambda p: p.p99_ms)
        return None, (f"no batch size x concurrency meets the budgets ({', '.join(budgets)}): the lowest p99 is "
                      f"{best.p99_ms:.2f} ms at batch {best.batch_size} x {best.concurrency}, "
                      f"peak memory {min(p.peak_memory_mib for p in ran):.0f} MiB at best")
    best = max(within, key=lambda p: p.throughput_per_s)
    reason = (f"the highest measured throughput of {len(points)} points"
              + (f" within {', '.join(budgets)}" if budgets else " (no budget set)"))
    return Recommendation(batch_size=best.batch_size, concurrency=best.concurrency,
                          throughput_per_s=best.throughput_per_s,
                          p99_ms=best.p99_ms, peak_memory_mib=best.peak_memory_mib, reason=reason), reason


def capacity(points: list[SweepPoint], config: BenchmarkConfig, make_runner: Callable[[], BaseRunner] | None = None,
             max_feed: Sample | None = None, synchronize: Callable[[], None] = lambda: None) -> Capacity:
    """Memory at the peak load, against the memory budget: the largest batch at the highest concurrency
    swept, or, given `max_feed` (the largest declared shapes, --max-shapes), a point run at those shapes
    with the highest concurrency, since memory that runs out only at peak shapes must show up here."""
    peak = max(points, key=lambda p: (p.batch_size, p.concurrency))
    shapes: dict[str, list[int]] = {}
    if max_feed is not None and make_runner is not None:
        batch = peak.batch_size
        peak = _point(make_runner, max_feed, batch, max(config.concurrency), config, synchronize)
        shapes = {name: list(np.shape(array)) for name, array in max_feed.items()}
    budget = config.memory_budget_mib
    at = "shapes " + ", ".join(f"{n}:{'x'.join(map(str, d))}" for n,
                               d in shapes.items()) if shapes else f"batch {peak.batch_size}"
    if peak.out_of_memory is not None:  # the deployment's measured limit: recorded, the build goes on
        return Capacity(batch_size=peak.batch_size, concurrency=peak.concurrency, shapes=shapes,
                        peak_memory_mib=peak.peak_memory_mib, memory_budget_mib=budget, passed=True,
                        out_of_memory=peak.out_of_memory,
                        line=f"{at} x {peak.concurrency} concurrent ran out of memory (the measured limit): "
                             f"{peak.out_of_memory}")
    passed = budget is None or peak.peak_memory_mib <= budget
    device = f"; device {peak.device_peak_memory_mib:.0f} MiB" if peak.device_peak_memory_mib is not None else ""
    line = (f"{at} x {peak.concurrency} concurrent: peak memory {peak.peak_memory_mib:.0f} MiB{device}"
            + (f" {'<=' if passed else '>'} the {budget:g} MiB budget" if budget is not None
               else " (no memory budget set)"))
    return Capacity(batch_size=peak.batch_size, concurrency=peak.concurrency, shapes=shapes, p99_ms=peak.p99_ms,
                    peak_memory_mib=peak.peak_memory_mib, memory_budget_mib=budget, passed=passed, line=line,
                    device_peak_memory_mib=peak.device_peak_memory_mib)


def sweep_checks(recommended: Recommendation | None, why: str, cap: Capacity, config: BenchmarkConfig) -> list:
    """The budgets (when any is set) and capacity as gate checks."""
    from accel_opt.accuracy import Check

    checks = []
    if config.p99_budget_ms is not None or config.memory_budget_mib is not None:
        line = (f"recommended batch {recommended.batch_size} x {recommended.concurrency}: {why}"
                if recommended else why)
        checks.append(Check(name="budgets", passed=recommended is not None, line=line))
    checks.append(Check(name="capacity", passed=cap.passed, line=cap.line))
    return checks
