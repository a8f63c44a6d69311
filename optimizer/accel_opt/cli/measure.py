"""`accel-opt bench` and `accel-opt compare`: a built folder timed again, and two builds against each other."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from accel_opt.cli.common import (
    EXIT_CODES_HELP,
    fail,
    interrupted,
    say_scope,
    setup_logging,
    trust_from,
    trust_options,
    write_junit,
)
from accel_opt.errors import AccelOptError, UsageError


@click.command("bench", epilog=EXIT_CODES_HELP)
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--data", "data_dir", type=click.Path(path_type=Path), help="Folder of .npz feeds or images (default: synthetic).")
@click.option("--batch-sizes", help="Comma-separated batch sizes (default: the build's).")
@click.option("--out", "out_file", type=click.Path(path_type=Path), help="Also write the report as JSON here.")
@click.option("--junit", "junit_file", type=click.Path(path_type=Path), help="Write one JUnit test case per batch size measured.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object on stdout.")
@trust_options
@click.option("-v", "--verbose", is_flag=True)
def bench_command(artifact, data_dir, batch_sizes, out_file, junit_file, as_json, public_key, certificate_chain, verbose):
    """Benchmark a built ARTIFACT folder again, loaded and run as deployed, without rebuilding it."""
    setup_logging(verbose)
    try:
        from accel_opt import runtime
        from accel_opt.artifact.folder import write_json
        from accel_opt.report.markdown import benchmark_markdown
        from accel_opt.runtime.measure import benchmark_artifact
        from accel_opt.runtime.probe import signed_off_here

        sizes = None
        if batch_sizes:
            try:
                sizes = [int(b) for b in batch_sizes.split(",") if b.strip()]
            except ValueError:
                sizes = []
            if not sizes or min(sizes) < 1:
                raise UsageError(f"--batch-sizes: expected positive integers like 1,8, got {batch_sizes!r}")
        deployment = runtime.load(artifact, trust=trust_from(public_key, certificate_chain))
        say_scope(signed_off_here(deployment, recheck_allowed=False))
        result, data = benchmark_artifact(deployment, data_dir, sizes)
        if out_file:
            write_json(out_file, result)
    except (AccelOptError, MemoryError, Exception) as exc:  # noqa: BLE001
        if junit_file:
            write_junit(junit_file, [(f"bench {Path(artifact).name}", [], f"bench failed: {exc}")])
        fail(exc, verbose, as_json)
        return
    except KeyboardInterrupt as exc:
        interrupted(exc, what="nothing was written")
    if junit_file:
        from accel_opt.accuracy import Check

        measured = [Check(name=f"batch {b.batch_size}", passed=True,
                          line=f"p50 {b.latency.p50_ms:.2f} ms, p99 {b.latency.p99_ms:.2f} ms, {b.throughput_per_s:.1f} samples/s")
                    for b in result.models[0].batches]
        write_junit(junit_file, [(f"bench {Path(artifact).name}", measured, None)])
    if as_json:
        click.echo(json.dumps({"exit_code": 0, "artifact_dir": str(artifact), "data": data.model_dump(mode="json", exclude={"names"}),
                               "benchmark": result.model_dump(mode="json")}))
    else:
        click.echo(benchmark_markdown(Path(artifact).name, result))
    sys.exit(0)


@click.command("compare", epilog=EXIT_CODES_HELP)
@click.argument("baseline", type=click.Path(path_type=Path))
@click.argument("candidate", type=click.Path(path_type=Path))
@click.option("--data", "data_dir", type=click.Path(path_type=Path), help="Folder of .npz feeds or images (default: synthetic).")
@click.option("--reference", type=click.Path(path_type=Path), help="The fp32 model (default: the candidate's input model, sha256-checked).")
@click.option("--max-latency-regression", type=float, help="Fail (exit 1) when the candidate is more than PCT %% slower per sample.")
@click.option("--max-accuracy-drop", type=float, help="Fail (exit 1) when the task metric (or worst cosine) drops more than this.")
@click.option("--junit", "junit_file", type=click.Path(path_type=Path), help="Write the checks as JUnit XML here.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@trust_options
@click.option("-v", "--verbose", is_flag=True)
def compare_command(baseline, candidate, data_dir, reference, max_latency_regression, max_accuracy_drop, junit_file, as_json,
                    public_key, certificate_chain, verbose):
    """Compare two built artifacts of one model family (the deployed build and a new one): speed interleaved
    in one run, accuracy of each against the same reference, and regression gates."""
    setup_logging(verbose)
    try:
        from accel_opt import runtime
        from accel_opt.accuracy.compare import comparison_markdown, reference_of, run_comparison
        from accel_opt.runtime.probe import signed_off_here

        trust = trust_from(public_key, certificate_chain)  # both folders must carry it
        base, cand = runtime.load(baseline, trust=trust), runtime.load(candidate, trust=trust)
        for side in (base, cand):
            say_scope(signed_off_here(side, recheck_allowed=False))
        result = run_comparison(base, cand, reference_of(cand, reference), data_dir, max_latency_regression, max_accuracy_drop)
    except (AccelOptError, MemoryError, Exception) as exc:  # noqa: BLE001
        if junit_file:
            write_junit(junit_file, [("compare", [], f"compare failed: {exc}")])
        fail(exc, verbose, as_json)
        return
    except KeyboardInterrupt as exc:
        interrupted(exc, what="nothing was written")
    exit_code = 0 if result.passed else 1
    if junit_file:
        write_junit(junit_file, [(f"compare {baseline.name} vs {candidate.name}", result.checks, None)])
    if as_json:
        click.echo(json.dumps({"exit_code": exit_code, **result.model_dump(mode="json")}))
    else:
        click.echo(comparison_markdown(result))
    sys.exit(exit_code)
