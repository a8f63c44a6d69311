"""`accel-opt doctor`: what this machine can build and run."""

from __future__ import annotations

import sys

import click


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--no-measure", "--no-probe", "no_measure", is_flag=True,
              help="Say which precisions are faster from CPU flags alone, without timing them (--no-probe: its "
                   "earlier name).")
@click.option("--refresh", is_flag=True, help="Time the CPU's precisions again instead of using the cached result.")
def doctor_command(as_json, no_measure, refresh):
    """What this machine can build and run: CPU features and class, GPUs, backends, which precisions are faster
    than fp32 here (measured once per CPU on a small model, then cached), what is missing."""
    from accel_opt.builder.doctor import diagnose

    report = diagnose(measure=not no_measure, refresh=refresh)
    if as_json:
        click.echo(report.model_dump_json())
        sys.exit(0)
    cpu, features = report.cpu, report.cpu_features
    have = ", ".join(f"{name} {'yes' if on else 'no'}" for name, on in features.items())
    click.echo(f"CPU         {cpu['model']} ({cpu['machine']}), {cpu['available_cpus']} CPUs available; {have}; "
               f"class {report.cpu_class}")
    if report.gpus:
        for gpu in report.gpus:
            click.echo(f"GPU         {gpu.name}, compute {gpu.compute_capability}, {gpu.memory_mib} MiB, driver "
                       f"{gpu.driver}")
    else:
        click.echo(f"GPU         none: {report.gpu_detail}")
    for b in report.backends:
        state = f"{b.version}" if b.installed and b.version else ("installed" if b.installed else "not installed")
        faster = ", ".join(p for p in b.fast_precisions if p != "fp32") or "none"
        fast = f"; faster than fp32 here: {faster}" if b.fast_precisions else ""
        click.echo(f"{b.name:<12}{state}: {b.detail}{fast}")
        if b.install:
            click.echo(f"{'':<12}to add: {b.install}")
    sys.exit(0)
