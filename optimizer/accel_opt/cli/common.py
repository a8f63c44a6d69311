"""What every `accel-opt` subcommand shares: logging set-up, the one-line failure and its exit code, interruption,
JUnit output, progress bars and the sign-off-scope line. Its own module so the command modules import it, not
each other."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import traceback
from pathlib import Path

import click

from accel_opt.artifact.signing import PUBLIC_KEY_ENV
from accel_opt.errors import (
    AccelOptError,
    InternalError,
    ResourceExhausted,
    first_line,
    no_space_error,
    termination_requested,
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
  6  built, but too few held-out samples to certify it (the number needed is printed; reports written)
  7  built and correct, but no measured benefit: a reduced precision not faster than its fp32 build by
     benchmark.min_speedup at the deployed batch (lower bound; reports written, not signed off)
  70 internal error (a bug; the log path is printed)"""


IMPORT_CHATTER_LOGGERS = ("torchao", "torch.utils._pytree")


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    # Warnings printed on import, whoever imports them (transformers imports torchao when it is installed): torchao
    # names each CUDA kernel library a CPU build cannot load, and torch's pytree deprecates how torchao registers
    # its enums. Neither concerns the build; --verbose shows them.
    for name in IMPORT_CHATTER_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.ERROR)
    # Python warnings (numpy's RuntimeWarnings inside a quantizer: "overflow encountered in reduce", "All-NaN axis")
    # are not the user's one line: logged, and shown with --verbose only. ONNX Runtime's own log (a failed kernel,
    # in colour) likewise: the error that follows says it in one line.
    logging.captureWarnings(True)
    logging.getLogger("py.warnings").setLevel(logging.NOTSET if verbose else logging.ERROR)
    if not verbose:
        import onnxruntime

        onnxruntime.set_default_logger_severity(4)
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.INFO if verbose else G_LOGGER.CRITICAL
    G_LOGGER.colors = False  # else Polygraphy prints a hint about the `colored` module on stdout


def fail(exc: BaseException, verbose: bool, as_json: bool) -> None:
    """Print one line on stderr (a traceback only with --verbose) and exit with the mapped code; after a SIGTERM, the
    error a library raised where it swallowed the termination is the termination (exit 143)."""
    if (asked := termination_requested()) is not None:
        interrupted(asked)
    if isinstance(exc, MemoryError):
        exc = ResourceExhausted("out of memory")
    exc = no_space_error(exc) or exc
    if not isinstance(exc, AccelOptError):
        exc = InternalError(f"internal error (a bug, please report it): {type(exc).__name__}: {first_line(exc)}; "
                            f"log: {write_crash_log(exc)}")  # one line: the whole message and traceback are in the log
    if verbose:
        traceback.print_exception(exc.__cause__ or exc, file=sys.stderr)
    # One line, even where a runtime's message we pass on spans several (OpenVINO's shape-inference errors).
    line = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    click.echo(f"accel-opt: error: {line}", err=True)
    if as_json:
        click.echo(json.dumps({"exit_code": exc.exit_code, "signed_off": False, "error": line, "artifact_dir": None}))
    sys.exit(exc.exit_code)


def interrupted(exc: KeyboardInterrupt, what: str = "no artifact was written") -> None:
    """Ctrl-C (exit 130) or SIGTERM (exit 143): the cleanup has run; say so and exit."""
    signum = getattr(exc, "signum", signal.SIGINT)
    click.echo(f"accel-opt: {'terminated' if signum == signal.SIGTERM else 'interrupted'}; {what}", err=True)
    sys.exit(128 + signum)


def write_junit(path: Path, suites: list) -> None:
    from accel_opt.files import write_text
    from accel_opt.report.junit import junit_xml

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, junit_xml(suites))


def not_signed_off_note(deployment) -> str:
    """What a summary adds for a folder its build did not sign off, run because the caller allowed it ("" otherwise)."""
    if not deployment.not_signed_off:
        return ""
    return f"; ran a folder that is NOT signed off (--allow-not-signed-off): {deployment.verdict.line()}"


def _deprecated_allow_unsigned(ctx, _param, value) -> None:
    if value:
        click.echo("accel-opt: --allow-unsigned is deprecated and will be removed in the next release: it allows a "
                   "folder its build did not sign off (not one without a signature); use --allow-not-signed-off",
                   err=True)
        ctx.meta["allow_not_signed_off"] = True


def allow_not_signed_off_option(command):
    """--allow-not-signed-off (and its deprecated spelling --allow-unsigned): open a folder its build did not sign
    off; runtime.load refuses it otherwise, with the verdict's exit code."""
    command = click.option("--allow-not-signed-off", is_flag=True,
                           callback=lambda ctx, _p, value: value or ctx.meta.get("allow_not_signed_off", False),
                           help="Open a folder its build did not sign off (gate failed, too few held-out samples, or "
                                "no measured benefit); without it that is refused with the verdict's own exit code "
                                "(1, 6 or 7). The summary line and JSON say it ran a folder that is not signed "
                                "off.")(command)
    return click.option("--allow-unsigned", is_flag=True, hidden=True, expose_value=False, is_eager=True,
                        callback=_deprecated_allow_unsigned)(command)


def say_scope(line: str | None) -> None:
    """Where a folder's sign-off holds, when it is not this CPU class: one line on stderr."""
    if line:
        click.echo(f"accel-opt: {line}", err=True)


@contextlib.contextmanager
def progress(enabled: bool):
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


def trust_options(command):
    """--public-key / --certificate-chain: require a signature by that key or CA before the folder is read;
    --trust-unsigned: run an unsigned folder that holds native code."""
    command = click.option("--trust-unsigned", is_flag=True, help="Without a key: load an unsigned folder that holds "
                           "native code (a torch package, a TensorRT plan or engine cache), which is otherwise refused "
                           "(exit 3). Loading it runs whatever its builder compiled in: only for folders you built "
                           "yourself. The summary and JSON say so.")(command)
    command = click.option("--certificate-chain", "certificate_chain", multiple=True, type=click.Path(path_type=Path),
                           help="Require a signature whose signing certificate chains to these CA certificates "
                                "(PEM).")(command)
    return click.option("--public-key", type=click.Path(path_type=Path),
                        help=f"Require a signature (model.sig) by this elliptic-curve public key (PEM), checked before "
                             f"anything in the folder is read. Default: the key {PUBLIC_KEY_ENV} names (set but "
                             "empty is a usage error).")(command)


def trust_from(public_key, certificate_chain, trust_unsigned=False):
    """The TrustPolicy the user asked for (the key from ACCEL_OPT_PUBLIC_KEY when no option names one); model-signing
    is imported only when there is a key."""
    from accel_opt.artifact.signing import TrustPolicy

    return TrustPolicy.of(public_key, certificate_chain, trust_unsigned)
