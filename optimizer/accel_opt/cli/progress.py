"""What `accel-opt build` shows while it works. On a terminal: a live line with the stage running, its elapsed
seconds and what it is doing now (the search's step and its budget, the benchmark's round: the `accel_opt.progress`
log), and a line per stage as it ends. Off a terminal (CI logs): a line per stage that did its work, as it ends, on
stdout before the result (a log shows where a build is, without a live line's control codes; stderr holds only a
failed build's one error line). `--quiet` and `--json` show neither."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from accel_opt.files import progress as progress_log

STAGE_START = "stage"  # the extra field of the progress record that says a stage begins


def stage_line(stage: Any) -> str:
    mark = {"passed": "ok", "failed": "FAILED", "skipped": "skipped"}[stage.status]
    detail = "" if stage.status == "failed" and stage.name != "accuracy" else stage.detail  # the error line follows
    return f"  {stage.name:<10} {mark:<8} {stage.seconds:6.1f} s  {detail}"


@contextmanager
def build_progress(mode: str) -> Iterator[Callable[[Any], None] | None]:
    """The on_stage callback for `mode` ("live": a terminal, "lines": a log, "none"); the live line is removed when
    the block ends."""
    if mode == "none":
        yield None
        return
    if mode == "lines":  # on stdout, before the result: stderr keeps a failed build's one error line alone
        yield lambda stage: click.echo(stage_line(stage)) if stage.status == "passed" else None
        return
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    console = Console(stderr=True)
    now = {"stage": "starting", "since": time.perf_counter(), "doing": ""}

    class Line:
        def __rich__(self) -> Text:
            elapsed = time.perf_counter() - now["since"]
            return Text(f"  {now['stage']:<10} {elapsed:6.0f} s  {now['doing']}"[: console.width - 1], style="dim")

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if (stage := getattr(record, STAGE_START, None)) is not None:
                now.update(stage=stage, since=time.perf_counter(), doing="")
            else:
                now["doing"] = record.getMessage()

    handler = Handler(logging.INFO)
    level, propagate = progress_log.level, progress_log.propagate
    progress_log.setLevel(logging.INFO)
    progress_log.propagate = False  # the live line shows it; --verbose's log does not repeat it
    progress_log.addHandler(handler)
    try:
        with Live(Line(), console=console, transient=True, refresh_per_second=4):
            yield lambda stage: console.print(stage_line(stage), markup=False, highlight=False)
    finally:
        progress_log.removeHandler(handler)
        progress_log.setLevel(level)
        progress_log.propagate = propagate
