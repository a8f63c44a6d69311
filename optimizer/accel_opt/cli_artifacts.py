"""`accel-opt run | bench | verify | sign | compare | doctor`: the commands that work on built artifact folders.

Plain click commands, listed in COMMANDS, which cli.py adds to the `accel-opt` group (this module does not import
cli.py); thin like it: parse, call the API, render, map errors to exit codes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from accel_opt.cli_common import EXIT_CODES_HELP, fail, interrupted, progress, say_scope, setup_logging, write_junit
from accel_opt.cli_ray import RAY_EXIT_CODES, ray_options, refuse_ray_options, run_on_ray
from accel_opt.errors import AccelOptError, UsageError
from accel_opt.signing import PUBLIC_KEY_ENV

RUN_EXIT_CODES = """\b
Exit codes:
  0  every input predicted
  1  signed off on another CPU class, and its re-check on this one failed (nothing was predicted)
  2  usage error: PREDICTIONS exists without --resume/--overwrite; another run is writing it (its pid named);
     --resume over another artifact's answers, or over a file without PREDICTIONS.meta.json; --out among the
     inputs; images without preprocessing; a key file missing or not an EC public key
  3  some inputs rejected (listed with the reason in PREDICTIONS.errors.jsonl); the artifact altered/incomplete;
     with --public-key, unsigned or not signed by that key
  4  the artifact cannot run here (another runtime version or CPU); --public-key without model-signing installed
  5  no space left for the predictions (the file keeps whole lines: free space, then --resume)
  70 internal error"""


def _trust_options(command):
    """--public-key / --certificate-chain: require a signature by that key or CA before the folder is read."""
    command = click.option("--certificate-chain", "certificate_chain", multiple=True, type=click.Path(path_type=Path),
                           help="Require a signature whose signing certificate chains to these CA certificates (PEM).")(command)
    return click.option("--public-key", type=click.Path(path_type=Path), envvar=PUBLIC_KEY_ENV, show_envvar=True,
                        help="Require a signature (model.sig) by this elliptic-curve public key (PEM), checked before "
                             "anything in the folder is read.")(command)


def _trust(public_key, certificate_chain):
    from accel_opt.signing import trust_of

    return trust_of(public_key, certificate_chain)


@click.command("run", epilog=RUN_EXIT_CODES + "\n\n" + RAY_EXIT_CODES)
@click.argument("artifact", type=click.Path(path_type=Path))
@click.argument("inputs", nargs=-1, required=True)
@click.option("--out", "predictions", type=click.Path(path_type=Path), required=True,
              help="Predictions, JSON Lines (--engine ray: a folder of part files and _SUMMARY.json).")
@click.option("--resume", is_flag=True, help="Skip the inputs PREDICTIONS already answers; append the rest.")
@click.option("--overwrite", is_flag=True, help="Replace an existing PREDICTIONS file.")
@click.option("--workers", type=click.IntRange(min=1), help="Reader threads decoding and preprocessing inputs (default: CPUs available).")
@click.option("--json", "as_json", is_flag=True, help="Print the job summary as one JSON object on stdout.")
@click.option("--no-recheck", is_flag=True, help="On another CPU class than the sign-off's, run without re-checking "
              "the folder's probe set here first (the default re-checks, once, and refuses a failed re-check).")
@_trust_options
@ray_options
@click.option("-v", "--verbose", is_flag=True)
def run_command(artifact, inputs, predictions, resume, overwrite, workers, as_json, no_recheck, public_key,
                certificate_chain, verbose, engine, **ray_args):
    """Run a built ARTIFACT folder on INPUTS (image files, .npz feed dicts, or folders of them).

    Writes one JSON line per input, in input order: {"input": PATH, "top1": ..., "topk": [[class, score], ...]}
    for classifier recipes (postprocess: topk), else {"input": PATH, "outputs": NPZ}. The artifact is verified
    (manifest, hashes, environment; with --public-key its signature first) before anything runs, and runs as
    the build checked it.

    Nothing lost or mixed: one run at a time per PREDICTIONS (a lock beside it); PREDICTIONS.meta.json names
    the artifact that answered, and --resume with another one is refused; no output file may be an input or in
    an input folder; every line is whole, even after a full disk. A path given twice is answered once, at its
    first place (the summary counts the duplicates), by a fresh run and a resumed one alike.
    """
    import time

    setup_logging(verbose)
    started = time.perf_counter()
    if engine == "ray":
        return run_on_ray(artifact, inputs, predictions, resume, overwrite, as_json, no_recheck,
                          lambda: _trust(public_key, certificate_chain), verbose, workers, started, **ray_args)
    try:
        refuse_ray_options(**ray_args)
        from accel_opt import runtime
        from accel_opt.runtime.job import run_job
        from accel_opt.runtime.probe import signed_off_here

        deployment = runtime.load(artifact, trust=_trust(public_key, certificate_chain))
        say_scope(signed_off_here(deployment, recheck_allowed=not no_recheck))
        show_progress = not as_json and sys.stderr.isatty()
        with progress(show_progress) as on_progress:
            summary = run_job(deployment, inputs, predictions, resume=resume, overwrite=overwrite, workers=workers,
                              on_progress=on_progress, started=started)
    except (AccelOptError, MemoryError, Exception) as exc:  # noqa: BLE001 - every error maps to an exit code
        fail(exc, verbose, as_json)
        return
    except KeyboardInterrupt as exc:
        interrupted(exc, what="the predictions written so far are whole lines; --resume continues")
    if as_json:
        click.echo(summary.model_dump_json())
    else:
        skipped = f", {summary.skipped} already answered" if summary.skipped else ""
        skipped += f", {summary.duplicates} given twice (answered once)" if summary.duplicates else ""
        rejected = f", {summary.rejected} rejected (see {summary.errors})" if summary.rejected else ""
        click.echo(f"predicted {summary.predicted} of {summary.inputs} inputs{skipped}{rejected} in "
                   f"{summary.seconds:.1f} s ({summary.inputs_per_s:.1f} inputs/s) -> {summary.predictions}", err=True)
    sys.exit(summary.exit_code)


@click.command("bench", epilog=EXIT_CODES_HELP)
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--data", "data_dir", type=click.Path(path_type=Path), help="Folder of .npz feeds or images (default: synthetic).")
@click.option("--batch-sizes", help="Comma-separated batch sizes (default: the build's).")
@click.option("--out", "out_file", type=click.Path(path_type=Path), help="Also write the report as JSON here.")
@click.option("--junit", "junit_file", type=click.Path(path_type=Path), help="Write one JUnit test case per batch size measured.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object on stdout.")
@_trust_options
@click.option("-v", "--verbose", is_flag=True)
def bench_command(artifact, data_dir, batch_sizes, out_file, junit_file, as_json, public_key, certificate_chain, verbose):
    """Benchmark a built ARTIFACT folder again, loaded and run as deployed, without rebuilding it."""
    setup_logging(verbose)
    try:
        from accel_opt import artifacts, report, runtime
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
        deployment = runtime.load(artifact, trust=_trust(public_key, certificate_chain))
        say_scope(signed_off_here(deployment, recheck_allowed=False))
        result, data = benchmark_artifact(deployment, data_dir, sizes)
        if out_file:
            artifacts.write_json(out_file, result)
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
        click.echo(report.benchmark_markdown(Path(artifact).name, result))
    sys.exit(0)


VERIFY_EXIT_CODES = """\b
Exit codes:
  0  complete, unaltered, and runnable here as it was checked (and, with --public-key, signed by that key)
  1  --accuracy: the re-check of the build's gate on this CPU failed
  2  a --public-key or --certificate-chain file missing or not a usable key
  3  incomplete or altered (no manifest, a file missing, changed or not part of it); with --public-key,
     unsigned, signed by another key, or a file changed, added or removed after signing
  4  this machine cannot run it as it was checked (backend missing, another runtime version or CPU);
     --public-key without model-signing installed (pip install 'accel-opt[sign]')"""


@click.command("verify", epilog=VERIFY_EXIT_CODES)
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--accuracy", is_flag=True, help="Also re-run the build's accuracy gate here, on the probe set the "
              "folder carries (seconds): the sign-off's verdict for this CPU's kernels. Exit 1 when it fails.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@_trust_options
def verify_command(artifact, accuracy, as_json, public_key, certificate_chain):
    """Check a built ARTIFACT folder before running it: its signature (with --public-key), manifest, every
    file's sha256, the environment, and which CPU class its sign-off holds for (--accuracy re-checks it here)."""
    from accel_opt import runtime

    recheck = scope = None
    try:
        trust = _trust(public_key, certificate_chain)
        problems = runtime.check(artifact, trust=trust)
        if not problems:
            scope = runtime.sign_off_scope(artifact)
            if accuracy:
                from accel_opt.runtime.probe import recheck as run_recheck

                recheck = run_recheck(runtime.load(artifact, trust=trust))
    except AccelOptError as exc:
        fail(exc, False, as_json)
        return
    exit_code = 3 if any(p.exit_code == 3 for p in problems) else 4 if problems else 0
    if recheck is not None and not recheck.passed:
        exit_code = 1
    if as_json:
        click.echo(json.dumps({"artifact_dir": str(artifact), "ok": exit_code == 0, "exit_code": exit_code,
                               "signature_checked": trust is not None, "problems": [p.model_dump() for p in problems],
                               "cpu_class": scope.model_dump() if scope else None,
                               "recheck": recheck.model_dump(mode="json", include={"sample_count", "failures", "checks"})
                               if recheck else None}))
    elif problems:
        for problem in problems:
            click.echo(f"accel-opt: {artifact}: {problem.line}", err=True)
    else:
        from accel_opt.artifacts import SIGNATURE

        manifest = runtime.read_manifest(artifact)
        signature = (f"signed by {trust.describe()}" if trust is not None else
                     f"{SIGNATURE} not checked (give --public-key)" if (artifact / SIGNATURE).is_file() else "unsigned")
        click.echo(f"ok: {artifact}: {signature}; {len(manifest.artifacts)} files match manifest.json; {manifest.backend} "
                   f"{manifest.precision} runs here as built; {'signed off' if manifest.signed_off else 'NOT signed off'}"
                   f"; {scope.line(artifact)}")
        if recheck is not None:
            verdict = "passed" if recheck.passed else "FAILED: " + "; ".join(recheck.failures)
            click.echo(f"accuracy re-checked here ({scope.here}) on {recheck.sample_count} probe samples, worst cosine "
                       f"{recheck.worst_cosine:.6f}: {verdict}", err=not recheck.passed)
    sys.exit(exit_code)


SIGN_EXIT_CODES = """\b
Exit codes:
  0  signed: ARTIFACT/model.sig covers every file of the folder, manifest.json included
  2  a key or certificate file missing or unusable
  3  the folder is incomplete or altered (it is verified before it is signed)
  4  model-signing is not installed (pip install 'accel-opt[sign]')"""


@click.command("sign", epilog=SIGN_EXIT_CODES)
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--key", "private_key", type=click.Path(path_type=Path), required=True, help="Elliptic-curve private key (PEM).")
@click.option("--signing-certificate", type=click.Path(path_type=Path),
              help="The certificate of --key: the signature carries it, and verifiers trust its CA instead of one key.")
@click.option("--certificate-chain", "certificate_chain", multiple=True, type=click.Path(path_type=Path),
              help="Certificates from the signing certificate up to the CA (PEM; repeatable).")
def sign_command(artifact, private_key, signing_certificate, certificate_chain):
    """Sign a built ARTIFACT folder: model.sig, written inside it, proves who built it (the manifest's hashes only
    prove it intact). The folder is verified first. Check it with `accel-opt verify ARTIFACT --public-key PUB.pem`,
    or give --public-key to run, bench and compare."""
    try:
        from accel_opt import runtime
        from accel_opt.errors import InputRejected
        from accel_opt.signing import sign_folder

        altered = [p for p in runtime.check(artifact) if p.exit_code == 3]
        if altered:
            raise InputRejected(f"{artifact}: not signed: {altered[0].line}")
        signature = sign_folder(artifact, private_key, signing_certificate, certificate_chain)
        manifest = runtime.read_manifest(artifact)
    except (AccelOptError, Exception) as exc:  # noqa: BLE001 - every error maps to an exit code
        fail(exc, False, False)
        return
    by = f"the certificate {signing_certificate.name}" if signing_certificate else f"the key {private_key.name}"
    click.echo(f"signed: {signature}: {len(manifest.artifacts) + 1} files (manifest.json included) signed with {by}; "
               f"{'signed off' if manifest.signed_off else 'NOT signed off'}")
    sys.exit(0)


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--no-probe", is_flag=True, help="Say which precisions are faster from CPU flags alone, without timing them.")
@click.option("--refresh", is_flag=True, help="Time the CPU probe again instead of using its cached result.")
def doctor_command(as_json, no_probe, refresh):
    """What this machine can build and run: CPU features and class, GPUs, backends, which precisions are faster
    than fp32 here (measured once per CPU by a short probe, then cached), what is missing."""
    from accel_opt.doctor import diagnose

    report = diagnose(probe=not no_probe, refresh=refresh)
    if as_json:
        click.echo(report.model_dump_json())
        sys.exit(0)
    cpu, features = report.cpu, report.cpu_features
    have = ", ".join(f"{name} {'yes' if on else 'no'}" for name, on in features.items())
    click.echo(f"CPU         {cpu['model']} ({cpu['machine']}), {cpu['available_cpus']} CPUs available; {have}; "
               f"class {report.cpu_class}")
    if report.gpus:
        for gpu in report.gpus:
            click.echo(f"GPU         {gpu.name}, compute {gpu.compute_capability}, {gpu.memory_mib} MiB, driver {gpu.driver}")
    else:
        click.echo(f"GPU         none: {report.gpu_detail}")
    for b in report.backends:
        state = f"{b.version}" if b.installed and b.version else ("installed" if b.installed else "not installed")
        fast = f"; faster than fp32 here: {', '.join(p for p in b.fast_precisions if p != 'fp32') or 'none'}" if b.fast_precisions else ""
        click.echo(f"{b.name:<12}{state}: {b.detail}{fast}")
        if b.install:
            click.echo(f"{'':<12}to add: {b.install}")
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
@_trust_options
@click.option("-v", "--verbose", is_flag=True)
def compare_command(baseline, candidate, data_dir, reference, max_latency_regression, max_accuracy_drop, junit_file, as_json,
                    public_key, certificate_chain, verbose):
    """Compare two built artifacts of one model family (the deployed build and a new one): speed interleaved
    in one run, accuracy of each against the same reference, and regression gates."""
    setup_logging(verbose)
    try:
        from accel_opt import runtime
        from accel_opt.comparison import comparison_markdown, reference_of, run_comparison
        from accel_opt.runtime.probe import signed_off_here

        trust = _trust(public_key, certificate_chain)  # both folders must carry it
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


COMMANDS = [run_command, bench_command, verify_command, sign_command, doctor_command, compare_command]  # registered on `accel-opt` by cli.py
