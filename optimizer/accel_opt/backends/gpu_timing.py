"""Stage timing for one inference call: host-to-device, compute, device-to-host, each ended by a synchronization.

A GPU runtime returns from an enqueue before the work is done, so a clock read right after a copy or a
launch measures the enqueue, not the work. `StageClock` therefore reads a stage's end only after that
stage was synchronized:

- `StageClock.host(sync)`: perf_counter readings, each taken after `sync()` (or after the runtime's own
  synchronizing call, such as ONNX Runtime's `IOBinding.synchronize_outputs()`, made by the caller just
  before `lap`). Used by the ONNX Runtime I/O-binding runner and on CPUs, where every call is synchronous.
- `StageClock.cuda_events(torch, stream)`: one `torch.cuda.Event(enable_timing=True)` recorded on `stream`
  per boundary; `finish()` synchronizes the last event before any `elapsed_time` is read (trtexec's and
  perf_analyzer's bracketing: the device's own clock, no host gaps after the last event).

Both give the keys of the benchmark's stage table (bench/application.py StageTimes): `h2d_ms`,
`compute_ms`, `d2h_ms`. Nothing here imports torch or onnxruntime.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

STAGES = ("h2d", "compute", "d2h")
STAGE_KEYS = tuple(f"{stage}_ms" for stage in STAGES)  # ("h2d_ms", "compute_ms", "d2h_ms")


class StageClock:
    """Consecutive stages of one call. `start()`, then `lap(stage)` at the end of each stage in STAGES
    order, then `finish()` -> {"h2d_ms": ..., "compute_ms": ..., "d2h_ms": ...}.

    A stage that was not lapped is an error, not a zero: a runner that forgets one would otherwise
    report a transfer as free. A clock is reused call after call (start() resets it).
    """

    def __init__(self, mark: Callable[[], Any], elapsed_ms: Callable[[Any, Any], float],
                 settle: Callable[[Any], None] = lambda _mark: None, kind: str = "host"):
        self._mark, self._elapsed_ms, self._settle, self.kind = mark, elapsed_ms, settle, kind
        self._marks: list[tuple[str, Any]] = []

    @classmethod
    def host(cls, sync: Callable[[], None] | None = None) -> StageClock:
        """perf_counter readings; `sync` (if given) runs before each reading, so queued work is inside the stage."""
        sync = sync or (lambda: None)

        def mark() -> float:
            sync()
            return time.perf_counter()

        return cls(mark, lambda a, b: (b - a) * 1e3, kind="host")

    @classmethod
    def cuda_events(cls, torch: Any, stream: Any = None) -> StageClock:
        """CUDA events recorded on `stream` (default: the current stream); read after the last one completes."""

        def mark() -> Any:
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream if stream is not None else torch.cuda.current_stream())
            return event

        def settle(last: Any) -> None:
            last.synchronize()  # every earlier event on the stream has completed too

        return cls(mark, lambda a, b: float(a.elapsed_time(b)), settle=settle, kind="cuda-events")

    def start(self) -> None:
        self._marks = [("start", self._mark())]

    def lap(self, stage: str) -> None:
        """End `stage` (one of STAGES, in order) now."""
        expected = STAGES[len(self._marks) - 1] if 0 < len(self._marks) <= len(STAGES) else None
        if stage != expected:
            raise ValueError(f"stage {stage!r} lapped out of order (expected {expected!r}; call start() first)")
        self._marks.append((stage, self._mark()))

    def finish(self) -> dict[str, float]:
        """{h2d_ms, compute_ms, d2h_ms} of the call, after the last stage's work has completed."""
        if len(self._marks) != len(STAGES) + 1:
            done = [name for name, _ in self._marks[1:]]
            raise ValueError(f"StageClock.finish() after stages {done}; every call must lap {list(STAGES)}")
        self._settle(self._marks[-1][1])
        return {f"{name}_ms": max(0.0, self._elapsed_ms(self._marks[i][1], mark))
                for i, (name, mark) in enumerate(self._marks[1:])}


def last_stage_ms(runner: Any) -> dict[str, float] | None:
    """The stage times of `runner`'s last call, looking through wrappers that keep the timed runner as
    `.inner` (base.CastInputsRunner); None for runners that do not split their calls into stages."""
    seen = 0
    while runner is not None and seen < 8:
        stages = getattr(runner, "last_stage_ms", None)
        if stages:
            return dict(stages)
        runner, seen = getattr(runner, "inner", None), seen + 1
    return None


def median_stage_ms(calls: Iterable[dict[str, float]]) -> dict[str, float]:
    """The per-key median of several calls' `last_stage_ms` (what the benchmark's stage table reports)."""
    calls = [c for c in calls if c]
    if not calls:
        raise ValueError("no stage times to summarize")
    return {key: statistics.median(c[key] for c in calls) for key in STAGE_KEYS}
