"""`accel-opt bench` and `accel-opt compare`: a built folder timed again, and two builds against each other."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from accel_opt.cli.common import (
    allow_not_signed_off_option,
    fail,
    interrupted,
    not_signed_off_note,
    say_scope,
    setup_logging,
    trust_from,
    trust_options,
    write_junit,
)
from accel_opt.errors import AccelOptError, UsageError

BENCH_EXIT_CODES = """\b
Exit codes:
  0  measured, and every check passed (verified; signed off for this machine; --max-p99-ms / --min-throughput)
  1  a check failed: the re-check on this machine class, or a limit (the report and --junit say which)
  2  usage error (bad --batch-sizes, a key file missing)
  3  the folder is altered or incomplete; with --public-key, unsigned or not signed by that key
  4  this machine cannot run it as it was checked (backend missing, another runtime version)
  5  out of memory
  6  not signed off by its build: too few held-out samples (--allow-not-signed-off times it anyway)
  7  not signed off by its build: no measured benefit over fp32 (--allow-not-signed-off times it anyway)
  70 internal error (a bug; the log path is printed)
A folder whose gate failed is refused with exit 1 (--allow-not-signed-off times it anyway)."""


@click.command("bench", epilog=BENCH_EXIT_CODES)
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--data", "data_dir", type=click.Path(path_type=Path),
              help="Folder of .npz feeds or images (default: synthetic).")
@click.option("--batch-sizes", help="Comma-separated batch sizes (default: the build's).")
@click.option("--max-p99-ms", type=click.FloatRange(min=0, min_open=True),
              help="Fail (exit 1) when p99 latency at any measured batch size exceeds this.")
@click.option("--min-throughput", type=click.FloatRange(min=0, min_open=True),
              help="Fail (exit 1) when the best samples/s is below this.")
@click.option("--no-recheck", is_flag=True,
              help="On another CPU class or GPU than the sign-off's, time without re-checking "
              "the probe set first (the sign-off check then fails: what is timed was not checked here).")
@click.option("--out", "out_file", type=click.Path(path_type=Path), help="Also write the report as JSON here.")
@click.option("--junit", "junit_file", type=click.Path(path_type=Path),
              help="Write the checks as JUnit XML (one case per check).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object on stdout.")
@allow_not_signed_off_option
@trust_options
@click.option("-v", "--verbose", is_flag=True)
def bench_command(artifact, data_dir, batch_sizes, max_p99_ms, min_throughput, no_recheck, out_file,
                  junit_file, as_json,
                  public_key, certificate_chain, trust_unsigned, allow_not_signed_off, verbose):
    """Benchmark a built ARTIFACT folder again, loaded and run as deployed, without rebuilding it. The folder is
    verified and its sign-off re-checked on this machine class first (as `run` does), and limits can be given."""
    setup_logging(verbose)
    suite = f"bench {Path(artifact).name}"
    try:
        from accel_opt import runtime
        from accel_opt.files import write_json
        from accel_opt.report.markdown import benchmark_markdown
        from accel_opt.runtime.measure import benchmark_artifact, limit_checks, sign_off_check, verified_check

        sizes = None
        if batch_sizes:
            try:
                sizes = [int(b) for b in batch_sizes.split(",") if b.strip()]
            except ValueError:
                sizes = []
            if not sizes or min(sizes) < 1:
                raise UsageError(f"--batch-sizes: expected positive integers like 1,8, got {batch_sizes!r}")
        deployment = runtime.load(artifact, trust=trust_from(public_key, certificate_chain, trust_unsigned),
                                  allow_not_signed_off=allow_not_signed_off)
        checks = [verified_check(deployment), sign_off_check(deployment, recheck_allowed=not no_recheck)]
        say_scope(checks[-1].line if checks[-1].passed and "re-checked" in checks[-1].line else None)
        result = data = None
        if checks[-1].passed or no_recheck:  # a failed re-check: nothing worth timing (run refuses it too)
            result, data = benchmark_artifact(deployment, data_dir, sizes)
            result.checks = checks + limit_checks(result, max_p99_ms, min_throughput)
            checks = result.checks
            if out_file:
                write_json(out_file, result)
    except (AccelOptError, MemoryError, Exception) as exc:  # noqa: BLE001
        if junit_file:
            write_junit(junit_file, [(suite, [], f"bench failed: {exc}")])
        fail(exc, verbose, as_json)
        return
    except KeyboardInterrupt as exc:
        interrupted(exc, what="nothing was written")
    failed = [c for c in checks if not c.passed]
    exit_code = 1 if failed else 0
    if junit_file:
        write_junit(junit_file, [(suite, checks, None)])
    if as_json:
        click.echo(json.dumps({"exit_code": exit_code, "artifact_dir": str(artifact), "signature": deployment.signature,
                               "verdict": deployment.verdict.model_dump(mode="json"),
                               "not_signed_off": deployment.not_signed_off, "checks": [c.model_dump() for c in checks],
                               "data": data.model_dump(mode="json", exclude={"names"}) if data else None,
                               "benchmark": result.model_dump(mode="json") if result else None}))
    else:
        if result is not None:
            click.echo(benchmark_markdown(Path(artifact).name, result))
        for check in failed:
            click.echo(f"accel-opt: {check.name} FAILED: {check.line}", err=True)
        if note := not_signed_off_note(deployment):
            click.echo(f"accel-opt: {artifact}{note}", err=True)
    sys.exit(exit_code)


COMPARE_EXIT_CODES = """\b
Exit codes:
  0  every check passed (the candidate signs off against the reference; the limits given hold)
  1  a check failed: the candidate fails the gate, --max-latency-regression or --max-accuracy-drop
  2  usage error (the two folders take different inputs, the reference is missing, a key file missing)
  3  a folder altered or incomplete, or every --data sample one a build has seen; with --public-key, unsigned
  4  this machine cannot run a folder as it was checked
  6  too few samples: the candidate's rates, or --max-accuracy-drop's bound, cannot be certified on them; or a
     folder whose build had too few held-out samples (--allow-not-signed-off compares it anyway)
  7  a folder whose build measured no benefit over fp32 (--allow-not-signed-off compares it anyway)
  70 internal error (a bug; the log path is printed)
A folder whose build's gate failed is refused with exit 1 (--allow-not-signed-off compares it anyway)."""


@click.command("compare", epilog=COMPARE_EXIT_CODES)
@click.argument("baseline", type=click.Path(path_type=Path))
@click.argument("candidate", type=click.Path(path_type=Path))
@click.option("--data", "data_dir", type=click.Path(path_type=Path),
              help="Folder of .npz feeds or images (default: synthetic).")
@click.option("--reference", type=click.Path(path_type=Path),
              help="The fp32 model (default: the candidate's input model, sha256-checked).")
@click.option("--max-latency-regression", type=float,
              help="Fail (exit 1) when the candidate is more than PCT percent slower per sample.")
@click.option("--max-accuracy-drop", type=float, help="Fail (exit 1) unless the candidate's drop in agreement with the "
              "reference under the first task metric is at most this, by the paired upper bound at the recipe's "
              "confidence (as the build bounds a drop on labels; exit 6 when the samples are too few to show it). "
              "Without a task metric: the worst cosine's point difference.")
@click.option("--junit", "junit_file", type=click.Path(path_type=Path), help="Write the checks as JUnit XML here.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@allow_not_signed_off_option
@trust_options
@click.option("-v", "--verbose", is_flag=True)
def compare_command(baseline, candidate, data_dir, reference, max_latency_regression, max_accuracy_drop,
                    junit_file, as_json,
                    public_key, certificate_chain, trust_unsigned, allow_not_signed_off, verbose):
    """Compare two built artifacts of one model family (the deployed build and a new one): speed interleaved
    in one run, accuracy of each against the same reference, and regression gates."""
    setup_logging(verbose)
    try:
        from accel_opt import runtime
        from accel_opt.builder.regression import comparison_markdown, reference_of, run_comparison
        from accel_opt.machine.cpu import CpuProfile
        from accel_opt.runtime.probe import signed_off_here

        # both folders carry it
        trust, cpu = trust_from(public_key, certificate_chain, trust_unsigned), CpuProfile.here()
        base, cand = (runtime.load(folder, trust=trust, cpu=cpu, allow_not_signed_off=allow_not_signed_off)
                      for folder in (baseline, candidate))
        for side in (base, cand):
            say_scope(signed_off_here(side, recheck_allowed=False))
        result = run_comparison(base, cand, reference_of(cand, reference), data_dir, max_latency_regression,
                                max_accuracy_drop)
    except (AccelOptError, MemoryError, Exception) as exc:  # noqa: BLE001
        if junit_file:
            write_junit(junit_file, [("compare", [], f"compare failed: {exc}")])
        fail(exc, verbose, as_json)
        return
    except KeyboardInterrupt as exc:
        interrupted(exc, what="nothing was written")
    exit_code = result.exit_code
    if junit_file:
        write_junit(junit_file, [(f"compare {baseline.name} vs {candidate.name}", result.checks, None)])
    if as_json:
        click.echo(json.dumps({"exit_code": exit_code, "signatures": [base.signature, cand.signature],
                               "not_signed_off": [base.not_signed_off, cand.not_signed_off],
                               **result.model_dump(mode="json")}))
    else:
        click.echo(comparison_markdown(result))
        click.echo(f"signatures: {baseline.name}: {base.signature}; {candidate.name}: {cand.signature}")
    for folder, side in ((baseline, base), (candidate, cand)):
        if note := not_signed_off_note(side):
            click.echo(f"accel-opt: {folder}{note}", err=True)
    sys.exit(exit_code)
