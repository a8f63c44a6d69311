"""`accel-opt run`: a built folder over inputs, on this machine or (`--engine ray`) a Ray Data actor pool."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from accel_opt.cli.common import (
    allow_not_signed_off_option,
    fail,
    interrupted,
    not_signed_off_note,
    progress,
    say_scope,
    setup_logging,
    trust_from,
    trust_options,
)
from accel_opt.cli.ray import RAY_EXIT_CODES, ray_options, refuse_ray_options, run_on_ray
from accel_opt.errors import AccelOptError

RUN_EXIT_CODES = """\b
Exit codes:
  0  every input predicted
  1  the folder is not signed off, its gate failed (--allow-not-signed-off runs it); or signed off on another
     CPU class, and its re-check on this one failed (nothing was predicted)
  2  usage error: PREDICTIONS exists without --resume/--overwrite; another run is writing it (its pid named);
     --resume over another artifact's answers, or over a file without PREDICTIONS.meta.json; --out among the
     inputs; an input of a kind the artifact does not take (text files without a text stage, images without
     preprocessing, anything but text files with one); a key file missing or not an EC public key
  3  some inputs rejected (listed with the reason in PREDICTIONS.errors.jsonl); the artifact altered/incomplete;
     with --public-key, unsigned or not signed by that key
  4  the artifact cannot run here (another runtime version or CPU); --public-key without model-signing installed
  5  no space left for the predictions (the file keeps whole lines: free space, then --resume)
  6  the folder is not signed off: too few held-out samples certified it (--allow-not-signed-off runs it)
  7  the folder is not signed off: no measured benefit over fp32 (--allow-not-signed-off runs it)
  70 internal error"""




@click.command("run", epilog=RUN_EXIT_CODES + "\n\n" + RAY_EXIT_CODES)
@click.argument("artifact", type=click.Path(path_type=Path))
@click.argument("inputs", nargs=-1, required=True)
@click.option("--out", "predictions", type=click.Path(path_type=Path), required=True,
              help="Predictions, JSON Lines (--engine ray: a folder of part files and _SUMMARY.json).")
@click.option("--resume", is_flag=True, help="Skip the inputs PREDICTIONS already answers; append the rest.")
@click.option("--overwrite", is_flag=True, help="Replace an existing PREDICTIONS file.")
@click.option("--workers", type=click.IntRange(min=1),
              help="Reader threads decoding and preprocessing inputs (default: CPUs available).")
@click.option("--json", "as_json", is_flag=True, help="Print the job summary as one JSON object on stdout.")
@click.option("--strict-device", is_flag=True, help="A torch artifact on a GPU: every image must be decoded on the "
              "device (nvJPEG); a device without a decoder is exit 4, an image it does not decode is rejected (exit "
              "3). "
              "Without it, such images are decoded on the host and the summary says how many and why.")
@click.option("--no-recheck", is_flag=True, help="On another CPU class than the sign-off's, run without re-checking "
              "the folder's probe set here first (the default re-checks, once, and refuses a failed re-check).")
@allow_not_signed_off_option
@trust_options
@ray_options
@click.option("-v", "--verbose", is_flag=True)
def run_command(artifact, inputs, predictions, resume, overwrite, workers, as_json, strict_device,
                no_recheck, public_key,
                certificate_chain, trust_unsigned, allow_not_signed_off, verbose, engine, **ray_args):
    """Run a built ARTIFACT folder on INPUTS: image files, .npz feed dicts, or for an artifact with a text stage
    text files (.txt a text per line, .jsonl, .parquet, .csv), folders of them (read recursively), globs
    ('photos/**/*.jpg') and URIs (file://; s3:// and gs:// with --engine ray). Both engines list INPUTS by this
    one rule; each text is one input, named FILE:LINE or FILE#ROW.

    Writes one JSON line per input, in input order: {"input": PATH, "top1": ..., "topk": [[class, score], ...]}
    for classifier recipes (postprocess: topk), {"input": FILE:LINE, "tokens": N, "embedding": [...]} for
    embedding recipes (all of them also in PREDICTIONS.embeddings.npy, row i = line i), else
    {"input": PATH, "outputs": NPZ}. The artifact is verified
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
                          lambda: trust_from(public_key, certificate_chain, trust_unsigned), verbose, workers, started,
                          allow_not_signed_off,
                          **ray_args)
    try:
        refuse_ray_options(**ray_args)
        from accel_opt import runtime
        from accel_opt.runtime.local.job import run_job
        from accel_opt.runtime.probe import signed_off_here

        deployment = runtime.load(artifact, trust=trust_from(public_key, certificate_chain, trust_unsigned),
                                  allow_not_signed_off=allow_not_signed_off)
        say_scope(signed_off_here(deployment, recheck_allowed=not no_recheck))
        show_progress = not as_json and sys.stderr.isatty()
        with progress(show_progress) as on_progress:
            summary = run_job(deployment, inputs, predictions, resume=resume, overwrite=overwrite, workers=workers,
                              on_progress=on_progress, started=started, strict_device=strict_device)
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
                   f"{summary.seconds:.1f} s ({summary.inputs_per_s:.1f} inputs/s) -> {summary.predictions}"
                   + host_decoding_note(summary) + not_signed_off_note(deployment) + f"; {summary.signature}", err=True)
    sys.exit(summary.exit_code)


def host_decoding_note(summary) -> str:
    """A GPU job's images decoded on the host instead of the device: how many and why (on a CPU that is the design)."""
    if not summary.device.startswith("cuda") or not summary.host_decoded:
        return ""
    why = ", ".join(f"{count} {reason}" for reason, count in summary.host_decoded_reasons.items())
    return (f"; {summary.host_decoded} of {summary.predicted + summary.rejected} decoded on the host, not the device "
            f"({why}; --strict-device refuses them)")
