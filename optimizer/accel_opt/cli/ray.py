"""`accel-opt run --engine ray`: the options and the rendering of the Ray Data engine for `accel-opt run` (cli/run.py).

Light at import (click only): `accel-opt --help` never imports Ray.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import click

from accel_opt.errors import AccelOptError, UsageError

RAY_EXIT_CODES = """\b
With --engine ray (--out is a folder):
  2  --out is a file or cannot be written; it holds answers without --resume/--overwrite; --resume over
     another artifact's folder; --address not HOST:PORT; ray-only options without --engine ray
  3  some inputs rejected (DIR/rejected-*.jsonl); the artifact altered/incomplete, on the driver or a node
  4  Ray Data not installed (accel-opt's `ray` extra); no cluster answers at --address; a node cannot
     run the artifact (named in the line)
  5  --timeout-s reached (the published parts stay: --resume continues)
  70 the exactly-once check failed (an input not answered or answered twice)"""


def parse_actors(text: str | None) -> tuple[int, int] | None:
    """"N": a pool of up to N actors (at least 1); "MIN-MAX": the bounds. A pool with MIN < MAX never waits
    on a dead node's actor; MIN = MAX can (ray #62746)."""
    if text is None:
        return None
    low, _, high = text.partition("-")
    try:
        bounds = (1, int(low)) if not high else (int(low), int(high))
    except ValueError:
        bounds = (0, 0)
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise UsageError(f"--actors {text}: expected N or MIN-MAX with 1 <= MIN <= MAX, such as 4 or 2-8")
    return bounds


def ray_options(command):
    """The run command's --engine option and the options only --engine ray takes (all default to unset)."""
    options = [
        click.option("--engine", type=click.Choice(["local", "ray"]), default="local", show_default=True,
                     help="local: this process; ray: a Ray Data actor pool, on a local Ray or the cluster at --address "
                          "(then --out is a folder of part files)."),
        click.option("--address",
                     help="--engine ray: the cluster's head, HOST:PORT (default: a local Ray of this machine's CPUs)."),
        click.option("--actors", help="--engine ray: N (up to N actors) or MIN-MAX (default: 1 to the cluster's CPUs / "
                                      "--cpus-per-actor)."),
        click.option("--cpus-per-actor", type=click.IntRange(min=1),
                     help="--engine ray: CPUs per actor, and its compute threads (default 1)."),
        click.option("--format", "output_format", type=click.Choice(["jsonl", "parquet"]),
                     help="--engine ray: part files' format (default jsonl)."),
        click.option("--sorted", "sort", is_flag=True, default=None,
                     help="--engine ray: also write DIR/predictions.sorted.jsonl in input order."),
        click.option("--timeout-s", type=click.FloatRange(min=0, min_open=True),
                     help="--engine ray: end the job (exit 5) after this many seconds; what is published stays for "
                          "--resume."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def run_on_ray(artifact, inputs, out_dir, resume, overwrite, as_json, no_recheck, trust_of, verbose, workers, started,
               allow_not_signed_off, address, actors, cpus_per_actor, output_format, sort, timeout_s) -> None:
    """The run command with --engine ray: exits with the job's code."""
    from accel_opt.cli.common import fail, interrupted, not_signed_off_note, progress, say_scope

    try:
        if workers is not None:
            raise UsageError("--workers is for --engine local: with --engine ray, give --actors and --cpus-per-actor")
        from accel_opt import runtime
        from accel_opt.runtime.probe import signed_off_here
        from accel_opt.runtime.ray.cluster import as_accel_opt_error
        from accel_opt.runtime.ray.job import run_ray_job

        pool = parse_actors(actors)
        deployment = runtime.load(artifact, trust=trust_of(), allow_not_signed_off=allow_not_signed_off)
        say_scope(signed_off_here(deployment, recheck_allowed=not no_recheck))
        # Ray prints the cluster's error messages (a node marked dead...) on stdout: they go to stderr, so
        # stdout holds only the summary.
        with progress(not as_json and sys.stderr.isatty()) as on_progress, contextlib.redirect_stdout(sys.stderr):
            try:
                summary = run_ray_job(deployment, inputs, out_dir, address=address, actors=pool,
                                      cpus_per_actor=cpus_per_actor or 1,
                                      resume=resume, overwrite=overwrite, output_format=output_format or "jsonl",
                                      sort=bool(sort), timeout_s=timeout_s, on_progress=on_progress, started=started,
                                      verbose=verbose)
            except AccelOptError:
                raise
            except Exception as exc:  # noqa: BLE001 - Ray's wrappers around our own errors
                raise as_accel_opt_error(exc) from exc
    except (AccelOptError, MemoryError, Exception) as exc:  # noqa: BLE001 - every error maps to an exit code
        fail(exc, verbose, as_json)
        return
    except KeyboardInterrupt as exc:
        interrupted(exc, what="the published part files are whole; --resume continues")
    if as_json:
        click.echo(summary.model_dump_json())
    else:
        skipped = f", {summary.skipped} already answered" if summary.skipped else ""
        rejected = (f", {summary.rejected} rejected (see {Path(out_dir) / 'rejected-*.jsonl'})" if summary.rejected
                    else "")
        click.echo(f"predicted {summary.predicted} of {summary.inputs} inputs{skipped}{rejected}, each exactly once, "
                   "in "
                   f"{summary.seconds:.1f} s ({summary.inputs_per_s:.1f} inputs/s; Ray start "
                   f"{summary.ray_start_seconds:.1f} s, "
                   f"first answers {summary.first_answer_seconds:.1f} s later, then {summary.steady_inputs_per_s:.1f} "
                   "inputs/s) "
                   f"on {summary.actors[0]}-{summary.actors[1]} actors -> {out_dir}"
                   + not_signed_off_note(deployment) + f"; {summary.signature}", err=True)
    sys.exit(summary.exit_code)


FLAG_OF = {"output_format": "--format", "sort": "--sorted"}


def refuse_ray_options(**given) -> None:
    """UsageError when an --engine ray option is given to the local engine."""
    named = [FLAG_OF.get(name, f"--{name.replace('_', '-')}") for name, value in given.items() if value is not None]
    if named:
        raise UsageError(f"{', '.join(named)}: only with --engine ray")
