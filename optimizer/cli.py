"""`accel-opt` command line: parse, call the API, render, map errors to exit codes. Thin on purpose."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import traceback
from pathlib import Path

import click

from accel_opt import __version__
from accel_opt.errors import (
    AccelOptError,
    InternalError,
    ResourceExhausted,
    Terminated,
    UsageError,
    no_space_error,
    write_crash_log,
)

log = logging.getLogger("accel_opt")

EXIT_CODES_HELP = """\b
Exit codes:
  0  built and signed off
  1  built, but a gate failed (reports written, not signed off)
  2  usage or recipe error
  3  input rejected (model or data invalid or unsafe)
  4  unsupported here (backend, device, precision or op)
  5  resource exhausted (memory, disk, time)
  70 internal error (a bug; the log path is printed)"""


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.INFO if verbose else G_LOGGER.CRITICAL
    G_LOGGER.colors = False  # else Polygraphy prints a hint about the `colored` module on stdout


def _fail(exc: BaseException, verbose: bool, as_json: bool) -> None:
    """Print one line on stderr (a traceback only with --verbose) and exit with the mapped code."""
    if isinstance(exc, MemoryError):
        exc = ResourceExhausted("out of memory")
    exc = no_space_error(exc) or exc
    if not isinstance(exc, AccelOptError):
        exc = InternalError(f"internal error (a bug, please report it): {type(exc).__name__}: {exc}; "
                            f"log: {write_crash_log(exc)}")
    if verbose:
        traceback.print_exception(exc.__cause__ or exc, file=sys.stderr)
    click.echo(f"accel-opt: error: {exc}", err=True)
    if as_json:
        click.echo(json.dumps({"exit_code": exc.exit_code, "signed_off": False, "error": str(exc), "artifact_dir": None}))
    sys.exit(exc.exit_code)


def _terminate(signum, _frame) -> None:
    raise Terminated(signum)


def _interrupted(exc: KeyboardInterrupt, what: str = "no artifact was written") -> None:
    """Ctrl-C (exit 130) or SIGTERM (exit 143): the cleanup has run; say so and exit."""
    signum = getattr(exc, "signum", signal.SIGINT)
    click.echo(f"accel-opt: {'terminated' if signum == signal.SIGTERM else 'interrupted'}; {what}", err=True)
    sys.exit(128 + signum)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="accel-opt")
def main() -> None:
    """accel-opt: build a model into a deployable, signed-off artifact (precision, backend, accuracy, benchmark)."""
    # SIGTERM (a CI job cancelled, a container stopped) cleans up like Ctrl-C: staging removed, exit 143.
    signal.signal(signal.SIGTERM, _terminate)


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("model", type=click.Path(path_type=Path, dir_okay=True, exists=False))
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16", "int8", "auto"]),
              help="Target precision (recipe default: fp32). auto: build the precisions that make sense here, keep the fastest that signs off.")
@click.option("--backend", type=click.Choice(["onnxruntime", "openvino", "tensorrt", "auto"]),
              help="Backend (recipe default: onnxruntime). auto: OpenVINO on x86 CPUs with AVX-512/AMX when installed, else ONNX Runtime.")
@click.option("--recipe", "recipe_path", help="Recipe YAML file or bundled name (recipes/NAME.yaml). Default: default.")
@click.option("--data", "data_dir", type=click.Path(path_type=Path), help="Folder of .npz feed dicts (or images with a preprocessing recipe).")
@click.option("--shapes", help="Fix dynamic dims, trtexec-style: NAME:1x3x224x224[,NAME:...].")
@click.option("--batch-axes", help="Batch axis of inputs whose dims do not tell: NAME:AXIS or NAME:none (not batched)[,...].")
@click.option("--require-data", is_flag=True, help="Refuse synthetic inputs: without --data, exit 2 (for CI sign-offs).")
@click.option("--keep-io-types/--no-keep-io-types", default=None, help="fp16/bf16: keep inputs/outputs in fp32 (default: keep).")
@click.option("--calibration", type=click.Choice(["minmax", "entropy", "percentile"]), help="int8 calibration method.")
@click.option("--threads", type=int, help="Intra-op threads (default: CPUs available).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("artifacts"), show_default=True, help="Where build folders go.")
@click.option("--force", is_flag=True, help="Rebuild even when an identical, verified build is already under --out.")
@click.option("--junit", "junit_file", type=click.Path(path_type=Path), help="Write the gate's checks as JUnit XML here (for CI).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout (for CI).")
@click.option("-v", "--verbose", is_flag=True, help="Log progress and show tracebacks.")
def build(model, precision, backend, recipe_path, data_dir, shapes, batch_axes, require_data, keep_io_types, calibration,
          threads, out_dir, force, junit_file, as_json, verbose):
    """Build MODEL (.onnx) through cleanup, precision, compile, accuracy gate and benchmark."""
    _setup_logging(verbose)
    try:
        from accel_opt.pipeline import build as run_build
        from accel_opt.recipe import load_recipe, parse_batch_axes, parse_shapes

        if require_data and data_dir is None:
            raise UsageError("--require-data: give --data DIR; a sign-off on synthetic inputs says nothing about real ones")
        auto = "auto" in (precision, backend)
        recipe = load_recipe(recipe_path).with_overrides(
            precision=None if precision == "auto" else precision,
            backend=None if backend == "auto" else backend,
            shapes=parse_shapes(shapes) if shapes else None,
            batch_axes=parse_batch_axes(batch_axes) if batch_axes else None,
            **{
                "precision_options.keep_io_types": keep_io_types,
                "precision_options.calibration.method": calibration,
                "benchmark.threads": threads,
            },
        )
        show_progress = not as_json and (verbose or sys.stderr.isatty())  # quiet in CI logs
        on_stage = _print_stage if show_progress else None
        selection = None
        if auto:
            from accel_opt.auto import build_auto

            result, selection = build_auto(
                model, recipe, backend or recipe.backend.value, precision or recipe.precision.value, data_dir, out_dir,
                on_candidate=_print_candidate if show_progress else None, on_stage=on_stage, force=force,
            )
        else:
            result = run_build(model, recipe, data_dir=data_dir, out_dir=out_dir, on_stage=on_stage, force=force)
    except (AccelOptError, MemoryError, Exception) as exc:  # noqa: BLE001 - every error maps to an exit code
        if junit_file:
            _write_junit(junit_file, [(Path(str(model)).stem, [], f"build failed: {exc}")])
        _fail(exc, verbose, as_json)
        return
    except KeyboardInterrupt as exc:
        _interrupted(exc)
    if junit_file:
        _write_junit(junit_file, _junit_suites(model, result, selection))
    exit_code = result.exit_code if result else 1
    if as_json:
        payload = result.model_dump(mode="json") if result else {"signed_off": False, "exit_code": 1, "artifact_dir": None}
        if selection is not None:
            payload["selection"] = selection.model_dump(mode="json")
        click.echo(json.dumps(payload))
    else:
        if selection is not None:
            from accel_opt.report import selection_markdown

            click.echo(selection_markdown(Path(model).stem, selection))
        if result:
            _print_result(result)
    sys.exit(exit_code)


def _junit_suites(model, result, selection) -> list:
    """One suite per build: the winner's (or the only) build, and with --precision auto every candidate."""
    from accel_opt.accuracy import AccuracyReport

    def checks_of(artifact_dir: str) -> list:
        from accel_opt.bench import BenchmarkReport

        folder = Path(artifact_dir)
        return (AccuracyReport.model_validate_json((folder / "accuracy.json").read_text()).checks
                + BenchmarkReport.model_validate_json((folder / "benchmark.json").read_text()).checks)

    stem = Path(str(model)).stem
    if selection is None:
        return [(f"{stem} {result.backend} {result.precision}", checks_of(result.artifact_dir), None)]
    return [(f"{stem} {c.backend} {c.precision}", checks_of(c.artifact_dir) if c.artifact_dir else [],
             None if c.artifact_dir else c.verdict) for c in selection.candidates]


def _write_junit(path: Path, suites: list) -> None:
    from accel_opt import artifacts
    from accel_opt.report import junit_xml

    path.parent.mkdir(parents=True, exist_ok=True)
    artifacts.write_text(path, junit_xml(suites))


def _print_candidate(candidate) -> None:
    click.echo(f"candidate {candidate.backend} {candidate.precision}: {candidate.verdict or 'built'}", err=True)


RUN_EXIT_CODES = """\b
Exit codes:
  0  every input predicted
  2  usage error (the predictions file exists without --resume/--overwrite, images without preprocessing)
  3  some inputs rejected (listed with the reason in PREDICTIONS.errors.jsonl), or the artifact altered/incomplete
  4  the artifact cannot run here (another runtime version or CPU)
  70 internal error"""


@main.command("run", epilog=RUN_EXIT_CODES)
@click.argument("artifact", type=click.Path(path_type=Path))
@click.argument("inputs", nargs=-1, required=True)
@click.option("--out", "predictions", type=click.Path(path_type=Path), required=True, help="Predictions, JSON Lines.")
@click.option("--resume", is_flag=True, help="Skip the inputs PREDICTIONS already answers; append the rest.")
@click.option("--overwrite", is_flag=True, help="Replace an existing PREDICTIONS file.")
@click.option("--workers", type=int, help="Reader threads decoding and preprocessing inputs (default: CPUs available).")
@click.option("--json", "as_json", is_flag=True, help="Print the job summary as one JSON object on stdout.")
@click.option("-v", "--verbose", is_flag=True)
def run_command(artifact, inputs, predictions, resume, overwrite, workers, as_json, verbose):
    """Run a built ARTIFACT folder on INPUTS (image files, .npz feed dicts, or folders of them).

    Writes one JSON line per input, in input order: {"input": PATH, "top1": ..., "topk": [[class, score], ...]}
    for classifier recipes (postprocess: topk), else {"input": PATH, "outputs": NPZ}. The artifact is verified
    (manifest, hashes, environment) before anything runs, and runs as the build checked it.
    """
    import time

    _setup_logging(verbose)
    started = time.perf_counter()
    try:
        from accel_opt import runtime
        from accel_opt.runtime.job import run_job

        deployment = runtime.load(artifact)
        show_progress = not as_json and sys.stderr.isatty()
        with _progress(show_progress) as on_progress:
            summary = run_job(deployment, inputs, predictions, resume=resume, overwrite=overwrite, workers=workers,
                              on_progress=on_progress, started=started)
    except (AccelOptError, MemoryError, Exception) as exc:  # noqa: BLE001 - every error maps to an exit code
        _fail(exc, verbose, as_json)
        return
    except KeyboardInterrupt as exc:
        _interrupted(exc, what="the predictions written so far are whole lines; --resume continues")
    if as_json:
        click.echo(summary.model_dump_json())
    else:
        skipped = f", {summary.skipped} already answered" if summary.skipped else ""
        rejected = f", {summary.rejected} rejected (see {summary.errors})" if summary.rejected else ""
        click.echo(f"predicted {summary.predicted} of {summary.inputs} inputs{skipped}{rejected} in "
                   f"{summary.seconds:.1f} s ({summary.inputs_per_s:.1f} inputs/s) -> {summary.predictions}", err=True)
    sys.exit(summary.exit_code)


@contextlib.contextmanager
def _progress(enabled: bool):
    """A progress callback: a bar with inputs/s on a terminal, nothing in CI logs."""
    if not enabled:
        yield None
        return
    import time

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("run"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                  TimeRemainingColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("run", total=None, rate="")
        start = time.perf_counter()

        def update(done: int, total: int) -> None:
            rate = done / max(time.perf_counter() - start, 1e-9)
            bar.update(task, completed=done, total=total, rate=f"{rate:.1f} inputs/s")

        yield update


@main.command("bench", epilog=EXIT_CODES_HELP)
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--data", "data_dir", type=click.Path(path_type=Path), help="Folder of .npz feeds or images (default: synthetic).")
@click.option("--batch-sizes", help="Comma-separated batch sizes (default: the build's).")
@click.option("--out", "out_file", type=click.Path(path_type=Path), help="Also write the report as JSON here.")
@click.option("--junit", "junit_file", type=click.Path(path_type=Path), help="Write one JUnit test case per batch size measured.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object on stdout.")
@click.option("-v", "--verbose", is_flag=True)
def bench_command(artifact, data_dir, batch_sizes, out_file, junit_file, as_json, verbose):
    """Benchmark a built ARTIFACT folder again, loaded and run as deployed, without rebuilding it."""
    _setup_logging(verbose)
    try:
        from accel_opt import artifacts, report, runtime
        from accel_opt.runtime.measure import benchmark_artifact

        sizes = None
        if batch_sizes:
            try:
                sizes = [int(b) for b in batch_sizes.split(",") if b.strip()]
            except ValueError:
                raise UsageError(f"--batch-sizes: expected integers like 1,8, got {batch_sizes!r}") from None
        deployment = runtime.load(artifact)
        result, data = benchmark_artifact(deployment, data_dir, sizes)
        if out_file:
            artifacts.write_json(out_file, result)
    except (AccelOptError, MemoryError, Exception) as exc:  # noqa: BLE001
        if junit_file:
            _write_junit(junit_file, [(f"bench {Path(artifact).name}", [], f"bench failed: {exc}")])
        _fail(exc, verbose, as_json)
        return
    except KeyboardInterrupt as exc:
        _interrupted(exc, what="nothing was written")
    if junit_file:
        from accel_opt.accuracy import Check

        measured = [Check(name=f"batch {b.batch_size}", passed=True,
                          line=f"p50 {b.latency.p50_ms:.2f} ms, p99 {b.latency.p99_ms:.2f} ms, {b.throughput_per_s:.1f} samples/s")
                    for b in result.models[0].batches]
        _write_junit(junit_file, [(f"bench {Path(artifact).name}", measured, None)])
    if as_json:
        click.echo(json.dumps({"exit_code": 0, "artifact_dir": str(artifact), "data": data.model_dump(mode="json", exclude={"names"}),
                               "benchmark": result.model_dump(mode="json")}))
    else:
        click.echo(report.benchmark_markdown(Path(artifact).name, result))
    sys.exit(0)


VERIFY_EXIT_CODES = """\b
Exit codes:
  0  complete, unaltered, and runnable here as it was checked
  3  incomplete or altered (no manifest, a file missing, changed or not part of it)
  4  this machine cannot run it as it was checked (backend missing, another runtime version or CPU)"""


@main.command("verify", epilog=VERIFY_EXIT_CODES)
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def verify_command(artifact, as_json):
    """Check a built ARTIFACT folder before running it: manifest, every file's sha256, the environment."""
    from accel_opt import runtime

    problems = runtime.check(artifact)
    exit_code = 3 if any(p.exit_code == 3 for p in problems) else 4 if problems else 0
    if as_json:
        click.echo(json.dumps({"artifact_dir": str(artifact), "ok": not problems, "exit_code": exit_code,
                               "problems": [p.model_dump() for p in problems]}))
    elif problems:
        for problem in problems:
            click.echo(f"accel-opt: {artifact}: {problem.line}", err=True)
    else:
        manifest = runtime.read_manifest(artifact)
        click.echo(f"ok: {artifact}: {len(manifest.artifacts)} files match manifest.json; {manifest.backend} "
                   f"{manifest.precision} runs here as built; {'signed off' if manifest.signed_off else 'NOT signed off'}")
    sys.exit(exit_code)


@main.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def doctor_command(as_json):
    """What this machine can build and run: CPU features, GPUs, backends, fast precisions, what is missing."""
    from accel_opt.doctor import diagnose

    report = diagnose()
    if as_json:
        click.echo(report.model_dump_json())
        sys.exit(0)
    cpu, features = report.cpu, report.cpu_features
    have = ", ".join(f"{name} {'yes' if on else 'no'}" for name, on in features.items())
    click.echo(f"CPU         {cpu['model']} ({cpu['machine']}), {cpu['available_cpus']} CPUs available; {have}")
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


@main.command("compare", epilog=EXIT_CODES_HELP)
@click.argument("baseline", type=click.Path(path_type=Path))
@click.argument("candidate", type=click.Path(path_type=Path))
@click.option("--data", "data_dir", type=click.Path(path_type=Path), help="Folder of .npz feeds or images (default: synthetic).")
@click.option("--reference", type=click.Path(path_type=Path), help="The fp32 model (default: the candidate's input model, sha256-checked).")
@click.option("--max-latency-regression", type=float, help="Fail (exit 1) when the candidate is more than PCT %% slower per sample.")
@click.option("--max-accuracy-drop", type=float, help="Fail (exit 1) when the task metric (or worst cosine) drops more than this.")
@click.option("--junit", "junit_file", type=click.Path(path_type=Path), help="Write the checks as JUnit XML here.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("-v", "--verbose", is_flag=True)
def compare_command(baseline, candidate, data_dir, reference, max_latency_regression, max_accuracy_drop, junit_file, as_json,
                    verbose):
    """Compare two built artifacts of one model family (the deployed build and a new one): speed interleaved
    in one run, accuracy of each against the same reference, and regression gates."""
    _setup_logging(verbose)
    try:
        from accel_opt import runtime
        from accel_opt.comparison import comparison_markdown, reference_of, run_comparison

        base, cand = runtime.load(baseline), runtime.load(candidate)
        result = run_comparison(base, cand, reference_of(cand, reference), data_dir, max_latency_regression, max_accuracy_drop)
    except (AccelOptError, MemoryError, Exception) as exc:  # noqa: BLE001
        if junit_file:
            _write_junit(junit_file, [("compare", [], f"compare failed: {exc}")])
        _fail(exc, verbose, as_json)
        return
    except KeyboardInterrupt as exc:
        _interrupted(exc, what="nothing was written")
    exit_code = 0 if result.passed else 1
    if junit_file:
        _write_junit(junit_file, [(f"compare {baseline.name} vs {candidate.name}", result.checks, None)])
    if as_json:
        click.echo(json.dumps({"exit_code": exit_code, **result.model_dump(mode="json")}))
    else:
        click.echo(comparison_markdown(result))
    sys.exit(exit_code)


@main.command("export", epilog="Loading a factory imports and runs its Python file: only export code you trust.\n\n" + EXIT_CODES_HELP)
@click.argument("factory")
@click.option("--shapes", required=True, help="Example input shapes, in forward()'s argument order: x:2x3x224x224[,NAME:...].")
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Output .onnx (default: FACTORY.onnx).")
@click.option("--dynamic", help="More dynamic axes besides the batch: NAME:AXIS[,NAME:AXIS...], e.g. input_ids:1.")
@click.option("--opset", type=int, help="ONNX opset (torch's exporter emits 18 or newer).")
@click.option("--json", "as_json", is_flag=True, help="Print the export and verification reports as JSON.")
@click.option("-v", "--verbose", is_flag=True)
def export_command(factory, shapes, output, dynamic, opset, as_json, verbose):
    """Export a PyTorch model factory (FILE.py:FACTORY or package.module:FACTORY) to ONNX and verify it.

    The factory is a callable returning an nn.Module. The leading dimension of every input is
    dynamic; verification runs ONNX Runtime against PyTorch on fresh inputs at two batch sizes,
    and a mismatch beyond tolerance exits 1.
    """
    _setup_logging(verbose)
    try:
        from accel_opt.export import export, load_factory, verify
        from accel_opt.recipe import parse_shapes

        example_shapes = parse_shapes(shapes)
        loaded = load_factory(factory)
        hints = loaded.export_hints
        if dynamic:
            hints["dynamic"] = {**hints.get("dynamic", {}), **_parse_dynamic(dynamic)}
        module = loaded()
        out = output or Path(factory.rpartition(":")[2] + ".onnx")
        exported = export(module, example_shapes, out, opset=opset, **hints)
        verification = verify(module, out, example_shapes)
    except (AccelOptError, MemoryError, Exception) as exc:  # noqa: BLE001
        _fail(exc, verbose, as_json)
        return
    if as_json:
        click.echo(json.dumps({"exit_code": 0, "export": exported.model_dump(mode="json"),
                               "verification": verification.model_dump(mode="json")}))
    else:
        click.echo(f"exported {factory} -> {exported.path} ({exported.exporter} exporter, opset {exported.opset}, "
                   f"{exported.size_bytes / 2**20:.1f} MiB, {exported.export_seconds:.1f} s)")
        for note in exported.notes:
            click.echo(f"  note: {note}")
        worst = max((c.max_abs_error for c in verification.checks), default=0.0)
        click.echo(f"verified against PyTorch at batch sizes {verification.batch_sizes}: max abs error {worst:.3g}")
    sys.exit(0)


def _parse_dynamic(text: str) -> dict[str, list[int]]:

    axes: dict[str, list[int]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, axis = item.rpartition(":")
        if not sep or not name or not axis.isdigit():
            raise UsageError(f"--dynamic: expected NAME:AXIS, got {item!r}")
        axes.setdefault(name, []).append(int(axis))
    return axes


def _print_stage(stage) -> None:
    mark = {"passed": "ok", "failed": "FAILED", "skipped": "skipped"}[stage.status]
    detail = "" if stage.status == "failed" and stage.name != "accuracy" else stage.detail  # the error line follows
    click.echo(f"  {stage.name:<10} {mark:<8} {stage.seconds:6.1f} s  {detail}", err=True)


def _print_result(result) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"{Path(result.model).name}: {result.precision} on {result.backend}")
    with_torch = any(h.speedup_vs_pytorch is not None for h in result.headline)
    for col in ("batch", "p50 ms", "samples/s", "speedup vs fp32") + (("speedup vs PyTorch eager",) if with_torch else ()):
        table.add_column(col, justify="right")
    for h in result.headline:
        ratios = [h.speedup_vs_fp32] + ([h.speedup_vs_pytorch] if with_torch else [])
        table.add_row(str(h.batch_size), f"{h.latency_p50_ms:.2f}", f"{h.throughput_per_s:.1f}",
                      *(f"{r:.2f}x" if r is not None else "-" for r in ratios))
    console.print(table)
    verdict = "[green]SIGNED OFF[/green]" if result.signed_off else "[red]NOT SIGNED OFF[/red]"
    console.print(f"accuracy: {verdict}")
    for failure in result.failures:
        console.print(f"  - {failure}")
    console.print(f"artifacts: {result.artifact_dir}" + (" (reused: an identical build verified; --force rebuilds)" if result.reused else ""))


if __name__ == "__main__":  # pragma: no cover
    main()
