"""`accel-opt build` and `accel-opt export`: a model in, a signed-off artifact folder (or an ONNX file) out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from accel_opt.cli.common import EXIT_CODES_HELP, fail, interrupted, setup_logging, write_junit
from accel_opt.cli.progress import build_progress
from accel_opt.errors import (
    AccelOptError,
    InputRejected,
    UsageError,
)


@click.command(epilog=EXIT_CODES_HELP)
@click.argument("model", type=click.Path(path_type=Path, dir_okay=True, exists=False))
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16", "int8", "auto"]),
              help="Target precision (default: the recipe's: fp32 in default, int8 in image-classifier and "
                   "text-classifier, bf16 in text-encoder). auto: build the precisions that make sense here, keep the "
                   "fastest that signs off.")
@click.option("--backend", type=click.Choice(["onnxruntime", "openvino", "tensorrt", "torch", "auto"]),
              help="Backend (default: the recipe's: onnxruntime, openvino in text-encoder). torch: torch.export + "
                   "AOTInductor, for PyTorch factories and Hugging Face folders. auto: OpenVINO on x86 CPUs with "
                   "AVX-512/AMX when installed, else ONNX Runtime (and torch for a factory).")
@click.option("--task", type=click.Choice(["text-classification", "feature-extraction", "image-classification"]),
              help="A Hugging Face folder's task (default: read from its config.json's architecture).")
@click.option("--input-dtypes", help="A factory's input dtypes, NAME:DTYPE[,...] (default float32; token ids: "
              "input_ids:int64). Over the factory's input_dtypes attribute.")
@click.option("--dynamic", help="A factory's dynamic axes besides the batch, NAME:AXIS[,...] (input_ids:1).")
@click.option("--device", help="--backend torch: cpu or cuda[:N] (default: the GPU when torch sees one, else the CPU).")
@click.option("--recipe", "recipe_path", help="Recipe YAML file or bundled name (recipes/NAME.yaml). Default: default; "
              "for a Hugging Face folder, its task's (text-classifier, text-encoder, image-classifier).")
@click.option("--data", "data_dir", type=click.Path(path_type=Path), help="Folder of .npz feed dicts (or images with a "
              "preprocessing recipe; a text file, or a folder of them, with a text recipe).")
@click.option("--eval-data", "eval_data_dir", type=click.Path(path_type=Path), help="Held-out samples (as --data takes "
              "them) that judge the verdict and nothing else; --data then only calibrates and steers. Default: a share "
              "of --data (recipe accuracy.split).")
@click.option("--groups", "groups_file", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="A CSV (columns file,group) naming the source of every sample (crops of one photo, frames of one "
                   "video): whole groups are dealt into roles, and the verdict's rates count held-out groups.")
@click.option("--group-pattern", help="The same by a regex over each sample's name: its first capture group (or the "
              "match) names the group, e.g. '^(.+)_frame\\d+'.")
@click.option("--labels", help="Labels of --data: 'folders' (ImageFolder: one sub-folder per class, numbered in sorted "
              "order) or a CSV of file,label. Top-1 (and top-5) accuracy under fp32 and the build is reported on the "
              "held-out samples, and gated with --max-accuracy-drop / --min-relative-accuracy.")
@click.option("--classes", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="Class names, one per line (index = line): --labels CSV rows may name classes.")
@click.option("--max-accuracy-drop", type=click.FloatRange(0, 1), help="With --labels: the largest top-1 drop from "
              "fp32 allowed, absolute (0.01: one point), judged by its paired one-sided bound at accuracy.confidence.")
@click.option("--min-relative-accuracy", type=click.FloatRange(0, 1, min_open=True), help="With --labels: top-1 "
              "accuracy at least this share of fp32's (0.99: MLPerf's 99%), judged by the same bound.")
@click.option("--tokenizer", type=click.Path(path_type=Path), help="A text recipe's tokenizer.json (default: the "
              "recipe's text.tokenizer, the factory's hint, or tokenizer.json beside the model).")
@click.option("--shapes", help="Fix dynamic dims, trtexec-style: NAME:1x3x224x224[,NAME:...].")
@click.option("--batch-axes",
              help="Batch axis of inputs whose dims do not tell: NAME:AXIS or NAME:none (not batched)[,...].")
@click.option("--max-shapes",
              help="Largest shapes to take, trtexec-style (NAME:16x3x640x640,...): the capacity check runs at them.")
@click.option("--require-data", is_flag=True,
              help="Refuse synthetic inputs: without --data, exit 2 (for CI sign-offs).")
@click.option("--keep-io-types/--no-keep-io-types", default=None,
              help="fp16/bf16: keep inputs/outputs in fp32 (default: keep).")
@click.option("--providers", help="ONNX Runtime execution provider: CUDAExecutionProvider or TensorrtExecutionProvider "
                                  "(onnxruntime-gpu, a GPU); default CPU.")
@click.option("--calibration", type=click.Choice(["minmax", "entropy", "percentile"]), help="int8 calibration method.")
@click.option("--target-cpu", type=click.Choice(["host", "avx2", "avx512", "avx_vnni", "avx512_vnni", "amx", "arm64"]),
              help="int8: the CPU class to build for (default: this one); avx2/avx512 without VNNI get 7-bit weights.")
@click.option("--time-budget", "time_budget_s", type=float, help="--precision/--backend auto: seconds for every "
              "candidate's build together (recipe selection.time_budget_s, default 900); what it leaves untried is "
              "said.")
@click.option("--no-fallback", is_flag=True, help="int8/fp16/bf16: ship the naive build even when it fails (no "
                                                  "measured search for a calibration or layers kept in float).")
@click.option("--threads", type=int, help="Intra-op threads (default: CPUs available).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("artifacts"), show_default=True,
              help="Where build folders go.")
@click.option("--force", is_flag=True, help="Rebuild even when an identical, verified build is already under --out.")
@click.option("--sign-key", type=click.Path(path_type=Path),
              help="Sign the folder with this elliptic-curve private key "
              "(PEM) as the build's last step, before it is published: model.sig proves who built it (checked before "
              "any "
              "build starts). Verify with --public-key on run, bench, verify and compare.")
@click.option("--signing-certificate", type=click.Path(path_type=Path),
              help="With --sign-key: the key's certificate, which the signature carries (verifiers trust its CA).")
@click.option("--junit", "junit_file", type=click.Path(path_type=Path),
              help="Write the gate's checks as JUnit XML here (for CI).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout (for CI).")
@click.option("-q", "--quiet", is_flag=True, help="Print only the verdict (and the error line of a failed build).")
@click.option("-v", "--verbose", is_flag=True, help="Log progress and show tracebacks.")
def build(model, precision, backend, device, task, input_dtypes, dynamic, recipe_path, data_dir, eval_data_dir,
          groups_file, group_pattern, labels,
          classes, max_accuracy_drop, min_relative_accuracy, tokenizer, shapes,
          batch_axes, max_shapes, require_data,
          keep_io_types, providers, calibration, target_cpu, time_budget_s, no_fallback, threads, out_dir,
          force, sign_key,
          signing_certificate, junit_file, as_json, quiet, verbose):
    """Build MODEL (.onnx, a Hugging Face model folder, or a PyTorch factory FILE.py:FACTORY) through cleanup,
    precision, compile, accuracy gate, benchmark and verdict. A factory is Python: building it imports and runs
    FILE.py, so build only factories you trust (an .onnx file is data: it is checked, never executed; a Hugging Face
    folder's weights are loaded by transformers, never its own code)."""
    setup_logging(verbose)
    try:
        from accel_opt.builder.pipeline import build as run_build
        from accel_opt.builder.sources import default_recipe, model_route_problem
        from accel_opt.recipe.load import load_recipe, parse_batch_axes, parse_shapes

        if problem := model_route_problem(str(model)):
            raise InputRejected(problem)
        if require_data and data_dir is None:
            raise UsageError("--require-data: give --data DIR; a sign-off on synthetic inputs says nothing about real "
                             "ones")
        if junit_file is not None and not _writable_file(junit_file):
            raise UsageError(f"--junit {junit_file}: cannot be written (a folder, or a path below a file)")
        signer = None
        if sign_key is not None or signing_certificate is not None:
            from accel_opt.artifact.signing import signer_of

            if sign_key is None:
                raise UsageError("--signing-certificate needs --sign-key (the certificate's private key)")
            signer = signer_of(sign_key, signing_certificate, option="--sign-key")
        task_recipe = None if recipe_path else default_recipe(model, task)
        if task_recipe is not None and precision is None and backend is None:
            # A Hugging Face folder and no choice made: the candidates its task's recipe allows here, the fastest
            # that signs off (fp32 when nothing reduced is faster and passes).
            precision = backend = "auto"
            click.echo(f"note: {Path(model).name}: no --precision or --backend given: building the candidates that run "
                       "here and keeping the fastest that signs off (--precision auto --backend auto)", err=True)
        auto = "auto" in (precision, backend)
        recipe = load_recipe(recipe_path or task_recipe).with_overrides(
            precision=None if precision == "auto" else precision,
            backend=None if backend == "auto" else backend,
            shapes=parse_shapes(shapes) if shapes else None,
            batch_axes=parse_batch_axes(batch_axes) if batch_axes else None,
            **{
                "precision_options.keep_io_types": keep_io_types,
                "precision_options.calibration.method": calibration,
                "precision_options.calibration.target_cpu": target_cpu,
                "precision_options.fallback.enabled": False if no_fallback else None,
                "selection.time_budget_s": time_budget_s,
                "onnxruntime.providers": providers.split(",") if providers else None,
                "torch.device": device,
                "benchmark.threads": threads,
                "benchmark.max_shapes": parse_shapes(max_shapes) if max_shapes else None,
                "accuracy.split.groups_file": str(groups_file.resolve()) if groups_file else None,
                "accuracy.split.group_pattern": group_pattern,
                **_label_overrides(labels, classes, max_accuracy_drop, min_relative_accuracy,
                                   data_dir or eval_data_dir),
            },
        )
        if tokenizer is not None:
            if recipe.text is None:
                raise UsageError(f"--tokenizer: the recipe {recipe.name!r} has no text stage (try --recipe "
                                 "text-encoder)")
            recipe = recipe.with_overrides(**{"text.tokenizer": str(tokenizer.resolve())})
        mode = "none" if as_json or quiet else "live" if sys.stderr.isatty() and not verbose else "lines"
        selection = None
        if auto:
            from accel_opt.builder.auto import build_auto

            result, selection = build_auto(
                model, recipe, backend or recipe.backend.value, precision or recipe.precision.value, data_dir, out_dir,
                on_progress=_print_progress if mode != "none" else None, force=force, eval_data_dir=eval_data_dir,
                signer=signer, task=task, export_hints=_export_hints(input_dtypes, dynamic),
            )
        else:
            with build_progress(mode) as on_stage:
                result = run_build(model, recipe, data_dir=data_dir, out_dir=out_dir, on_stage=on_stage, force=force,
                                   eval_data_dir=eval_data_dir, signer=signer, task=task,
                                   export_hints=_export_hints(input_dtypes, dynamic))
    except (AccelOptError, MemoryError, Exception) as exc:  # noqa: BLE001 - every error maps to an exit code
        if junit_file and _writable_file(junit_file):
            write_junit(junit_file, [(Path(str(model)).stem, [], f"build failed: {exc}")])
        fail(exc, verbose, as_json)
        return
    except KeyboardInterrupt as exc:
        interrupted(exc)
    if junit_file:
        write_junit(junit_file, _junit_suites(model, result, selection))
    exit_code = result.exit_code if result else 6 if selection is not None and selection.too_few_for_all else 1
    no_winner = None
    if result is None and selection is not None:
        from accel_opt.builder.auto import selection_report_path

        no_winner = (f"no winner: {selection.no_winner_reason()}; every candidate's verdict is in "
                     f"{selection_report_path(out_dir, model)}")
    if as_json:
        payload = result.model_dump(mode="json") if result else {"signed_off": False, "exit_code": exit_code,
                                                                 "artifact_dir": None,
                                                                 "failures": [no_winner] if no_winner else None}
        if selection is not None:
            payload["selection"] = selection.model_dump(mode="json")
        payload["signature"] = str(Path(result.artifact_dir) / "model.sig") if result and signer else None
        payload["labeled"] = _labeled(result.artifact_dir) if result else []
        click.echo(json.dumps(payload))
    elif quiet:
        click.echo(f"verdict: {result.verdict.line()}" if result else f"verdict: {no_winner}")
    else:
        if selection is not None:
            from accel_opt.report.markdown import selection_markdown

            click.echo(selection_markdown(Path(model).stem, selection))
        if result:
            _print_result(result)
            if signer is not None:
                click.echo(f"signed: {Path(result.artifact_dir) / 'model.sig'} by {sign_key.name} (every file, "
                           "manifest "
                           "included, as built)")
        if result and selection is not None and selection.too_few_line():  # what --precision auto could not certify
            click.echo(f"not certified: {selection.too_few_line()}")
    if no_winner:
        click.echo(f"accel-opt: {no_winner}", err=True)
    sys.exit(exit_code)


def _labeled(artifact_dir: str) -> list[dict]:
    """The labeled-accuracy figures of a build (accuracy.json's checks on --labels): [] without labels."""
    checks = json.loads((Path(artifact_dir) / "accuracy.json").read_text())["checks"]
    return [c["labeled"] for c in checks if c.get("labeled")]


def _label_overrides(labels, classes, max_drop, min_relative, data) -> dict:
    """The recipe keys (accuracy.labels.*) the label options set; checked here (exit 2)."""
    if labels is None:
        if any(v is not None for v in (classes, max_drop, min_relative)):
            raise UsageError("--classes, --max-accuracy-drop and --min-relative-accuracy need --labels")
        return {}
    if data is None:
        raise UsageError("--labels labels the samples of --data (or --eval-data): give it")
    if labels != "folders" and not Path(labels).is_file():
        raise UsageError(f"--labels {labels}: not 'folders' and not a CSV file")
    if max_drop is not None and min_relative is not None:
        raise UsageError("--max-accuracy-drop (absolute) or --min-relative-accuracy (of fp32's): give one")
    return {"accuracy.labels.source": labels if labels == "folders" else str(Path(labels).resolve()),
            "accuracy.labels.classes": str(classes.resolve()) if classes else None,
            "accuracy.labels.max_drop": max_drop, "accuracy.labels.min_relative": min_relative}


def _writable_file(path: Path) -> bool:
    """Not a folder, and not below a file: a path --junit can write."""
    return not path.is_dir() and not any(p.exists() and not p.is_dir() for p in path.parents)


def _junit_suites(model, result, selection) -> list:
    """One suite per build: the winner's (or the only) build, and with --precision auto every candidate."""
    from accel_opt.accuracy import AccuracyReport

    def checks_of(artifact_dir: str) -> list:
        from accel_opt.accuracy import Check
        from accel_opt.artifact.folder import MANIFEST, Manifest
        from accel_opt.bench import BenchmarkReport

        folder = Path(artifact_dir)
        benefit = Manifest.model_validate_json((folder / MANIFEST).read_text()).verdict.benefit
        return (AccuracyReport.model_validate_json((folder / "accuracy.json").read_text()).checks
                + BenchmarkReport.model_validate_json((folder / "benchmark.json").read_text()).checks
                + ([Check(name="benefit", passed=benefit.passed, line=benefit.line())] if benefit else []))

    stem = Path(str(model)).stem
    if selection is None:
        return [(f"{stem} {result.backend} {result.precision}", checks_of(result.artifact_dir), None)]
    return [(f"{stem} {c.backend} {c.precision}", checks_of(c.artifact_dir) if c.artifact_dir else [],
             None if c.artifact_dir else c.verdict) for c in selection.candidates]


def _print_progress(event) -> None:
    click.echo(event.line(), err=True)


EXPORT_EXIT_CODES = """Loading a factory imports and runs its Python file: only export code you trust.

\b
Exit codes:
  0  exported, and ONNX Runtime's outputs match PyTorch's
  1  exported, but the outputs differ from PyTorch's beyond tolerance
  2  usage error (a bad FACTORY spec, --shapes or --dynamic; the factory file or attribute missing)
  3  the factory raised, returned something that is not an nn.Module, or the folder is not a model
  4  torch is not installed, or neither exporter can export the module (the reason is printed)
  5  resource exhausted (memory, disk)
  70 internal error (a bug; the log path is printed)"""


@click.command("export", epilog=EXPORT_EXIT_CODES)
@click.argument("factory")
@click.option("--shapes", help="Example input shapes, in forward()'s argument order: x:2x3x224x224[,NAME:...]. "
              "Default for a Hugging Face folder: 1x16 tokens, or its image processor's crop.")
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Output .onnx (default: FACTORY.onnx).")
@click.option("--dynamic", help="More dynamic axes besides the batch: NAME:AXIS[,NAME:AXIS...], e.g. input_ids:1.")
@click.option("--input-dtypes", help="Input dtypes, NAME:DTYPE[,...] (default float32; token ids: input_ids:int64).")
@click.option("--opset", type=int, help="ONNX opset (torch's exporter emits 18 or newer).")
@click.option("--json", "as_json", is_flag=True, help="Print the export and verification reports as JSON.")
@click.option("-v", "--verbose", is_flag=True)
def export_command(factory, shapes, output, dynamic, input_dtypes, opset, as_json, verbose):
    """Export a PyTorch model factory (FILE.py:FACTORY or package.module:FACTORY), or a Hugging Face model folder,
    to ONNX and verify it.

    The factory is a callable returning an nn.Module. The leading dimension of every input is
    dynamic; verification runs ONNX Runtime against PyTorch on fresh inputs at two batch sizes,
    and a mismatch beyond tolerance exits 1.
    """
    setup_logging(verbose)
    try:
        from accel_opt.accuracy.export_check import verify
        from accel_opt.backends.torch.export import export
        from accel_opt.builder.sources import factory_of, hf_folder_of
        from accel_opt.recipe.load import parse_shapes

        loaded = factory_of(factory, hints=_export_hints(input_dtypes, dynamic))
        if loaded is None:
            raise UsageError(f"{factory}: export takes a factory FILE.py:FACTORY or a Hugging Face folder, not a model "
                             "file")
        hints = loaded.export_hints
        if shapes:
            example_shapes = parse_shapes(shapes)
        elif (hf := hf_folder_of(factory)) is not None:
            crop = hf.image_preprocessing()["crop"] if not hf.is_text else 0
            example_shapes = {name: [1, 16]
                              for name in hf.text_inputs} if hf.is_text else {"pixel_values": [1, 3, crop, crop]}
        else:
            raise UsageError("export: give --shapes NAME:DIMxDIM,... (the example inputs, in forward()'s order)")
        module = loaded()
        out = output or Path(loaded.name + ".onnx")
        exported = export(module, example_shapes, out, opset=opset, **hints)
        verification = verify(module, out, example_shapes)
    except (AccelOptError, MemoryError, Exception) as exc:  # noqa: BLE001
        fail(exc, verbose, as_json)
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


def _export_hints(input_dtypes: str | None, dynamic: str | None) -> dict:
    """--input-dtypes and --dynamic as a factory's export hints (input_dtypes, dynamic)."""
    hints: dict = {}
    if input_dtypes:
        hints["input_dtypes"] = {}
        for item in filter(None, (part.strip() for part in input_dtypes.split(","))):
            name, sep, dtype = item.rpartition(":")
            if not sep or not name or dtype not in INPUT_DTYPES:
                raise UsageError(f"--input-dtypes: expected NAME:DTYPE with DTYPE one of {', '.join(INPUT_DTYPES)}, "
                                 f"got {item!r}")
            hints["input_dtypes"][name] = dtype
    if dynamic:
        hints["dynamic"] = _parse_dynamic(dynamic)
    return hints


INPUT_DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool")


def _parse_dynamic(text: str) -> dict[str, list[int]]:
    """NAME:AXIS[,NAME:AXIS...] -> {name: [axes]}."""
    axes: dict[str, list[int]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, axis = item.rpartition(":")
        if not sep or not name or not axis.isdigit():
            raise UsageError(f"--dynamic: expected NAME:AXIS, got {item!r}")
        axes.setdefault(name, []).append(int(axis))
    return axes


def _print_result(result) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"{Path(result.model).name}: {result.precision} on {result.backend}")
    with_torch = any(h.speedup_vs_pytorch is not None for h in result.headline)
    for col in ("batch", "p50 ms", "samples/s", "speedup vs fp32") + (("speedup vs PyTorch eager",
                                                                       ) if with_torch else ()):
        table.add_column(col, justify="right")
    for h in result.headline:
        ratios = [h.speedup_vs_fp32] + ([h.speedup_vs_pytorch] if with_torch else [])
        table.add_row(str(h.batch_size), f"{h.latency_p50_ms:.2f}", f"{h.throughput_per_s:.1f}",
                      *(f"{r:.2f}x" if r is not None else "-" for r in ratios))
    console.print(table)
    verdict = "[green]SIGNED OFF[/green]" if result.signed_off else "[red]NOT SIGNED OFF[/red]"
    if result.verdict.outcome == "no measured benefit":
        verdict += f": no measured benefit (exit {result.exit_code})"
    for said in (result.too_few_line(), result.synthetic_line()):
        verdict += f": {said}" if said else ""
    console.print(f"verdict: {verdict}", highlight=False)
    if result.verdict.benefit is not None:
        console.print(f"benefit: {result.verdict.benefit.line()}", highlight=False)
    for failure in result.failures:
        console.print(f"  - {failure}", highlight=False)
    console.print(f"artifacts: {result.artifact_dir}" + (" (reused: an identical build verified; --force rebuilds)"
                                                         if result.reused else ""))
