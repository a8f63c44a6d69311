"""The `accel-opt` command line: the click group and one module per family of sub-commands (build and export; run;
verify and sign; bench and compare; doctor), each thin on purpose: parse, call the API, render, map errors to exit
codes. `common` holds what they share, so the command modules import it, not each other."""

from __future__ import annotations

import signal

import click

from accel_opt import __version__
from accel_opt.errors import request_termination


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="accel-opt")
def main() -> None:
    """accel-opt: build a model into a deployable, signed-off artifact (precision, backend, accuracy, benchmark)."""
    # SIGTERM (a CI job cancelled, a container stopped) cleans up like Ctrl-C: staging removed, exit 143.
    signal.signal(signal.SIGTERM, request_termination)


from accel_opt.cli.build import build, export_command  # noqa: E402
from accel_opt.cli.doctor import doctor_command  # noqa: E402
from accel_opt.cli.folder import sign_command, verify_command  # noqa: E402
from accel_opt.cli.measure import bench_command, compare_command  # noqa: E402
from accel_opt.cli.run import run_command  # noqa: E402

for command in (build, export_command, run_command, bench_command, verify_command, sign_command, compare_command,
                doctor_command):
    main.add_command(command)
