"""Artifact folders that are complete or absent, content hashes, and the environment record.

A build works in a hidden folder under `--out` (`.<model>.build-<random>/`: `staging/` becomes the
artifact, `work/` holds intermediates), locked by its process for its whole life. `manifest.json` is
written last into `staging/`, which is then renamed into place under a per-artifact lock, so a
folder is complete when it appears. Anything that stops the build earlier (error, Ctrl-C, SIGTERM)
removes the hidden folder; one left by a killed process (its lock free) is removed by the next build.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, computed_field, model_validator

from accel_opt.errors import ResourceExhausted, UsageError, no_space_error
from accel_opt.files import sha256_file
from accel_opt.report.verdict import Verdict, legacy_verdict

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
# Written by `accel-opt sign` after the build: it covers every file (manifest included), so no manifest lists it.
SIGNATURE = "model.sig"
BUILD_PREFIX = ".build-"  # .<model>.build-<random>: one build's hidden folder
OWNER_LOCK = "owner.lock"  # inside it, flock-ed by the building process while it lives
UNLOCKED_GRACE_SECONDS = 600  # a build folder without its lock file yet is left alone this long


class Manifest(BaseModel):
    """`manifest.json`: written last; its presence marks a complete artifact folder."""

    format: int = 2  # 2: the verdict is a typed record; 1: signed_off and exit_code only (read as a verdict)
    created_utc: str
    verdict: Verdict  # the build's one verdict: what runtime.load enforces and every command reads
    precision: str
    backend: str
    input_model: dict[str, Any]
    recipe: dict[str, Any]
    data: dict[str, Any]  # source, path, count, evaluation/calibration counts, synthetic
    artifacts: dict[str, str]  # file name -> sha256, every file of the folder but this one
    stages: list[dict[str, Any]]
    tools: dict[str, str]
    cpu: dict[str, Any]
    command_line: list[str]
    # The CPU class whose kernels the gate ran (accel_opt.machine.cpu.kernel_class): where the sign-off holds.
    # None: a folder from before classes were recorded (runtime.probe.recorded_class derives it from `cpu`).
    cpu_class: str | None = None
    # GPU builds: the GPU model and compute capability the gate ran on (accel_opt.machine.gpu.gpu_class).
    gpu: str | None = None

    @computed_field
    @property
    def signed_off(self) -> bool:  # written for readers of the JSON; `verdict` is the record
        return self.verdict.signed_off

    @computed_field
    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code

    @model_validator(mode="before")
    @classmethod
    def _verdict_of_older_folders(cls, data: Any) -> Any:
        """A folder built before verdicts were recorded carries `signed_off` and `exit_code`: read as its verdict."""
        if isinstance(data, dict) and data.get("format", 1) == 1 and "verdict" not in data and "signed_off" in data:
            failed = next((s for s in data.get("stages",
                                               []) if isinstance(s, dict) and s.get("status") == "failed"), None)
            reason = f"{failed.get('name')}: {failed.get('detail', '')}"[:300] if failed else ""
            data = {**data, "verdict": legacy_verdict(bool(data["signed_off"]), int(data.get("exit_code", 1)), reason)}
        return data


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file directly in `folder` except the manifest and a signature, by name."""
    return {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file()
            and p.name not in (MANIFEST, SIGNATURE)}


def prepare_out_dir(out_dir: Path) -> Path:
    """Create `out_dir`; an unusable one is a usage error (exit 2) with one line, a full disk exit 5."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise _out_dir_error(out_dir, exc) from None
    return out_dir


def _out_dir_error(out_dir: Path, exc: OSError) -> UsageError | ResourceExhausted:
    full = no_space_error(exc)
    if full is not None:
        return full
    if isinstance(exc, FileExistsError) or (out_dir.exists() and not out_dir.is_dir()):
        return UsageError(f"--out {out_dir}: exists and is not a folder")
    if isinstance(exc, NotADirectoryError):
        return UsageError(f"--out {out_dir}: a parent of it is a file, not a folder")
    return UsageError(f"--out {out_dir}: cannot write there ({exc.strerror or exc})")


@contextmanager
def build_folder(out_dir: Path, name: str) -> Iterator[tuple[Path, Path]]:
    """Yield (staging, work) inside a hidden build folder under `out_dir` that this process holds
    locked; the folder is removed at the end, however the build ends. Publish `staging` with `publish`."""
    out_dir = prepare_out_dir(Path(out_dir))
    remove_stale_builds(out_dir)
    try:
        # Absolute: some steps run native tools from another working directory.
        root = Path(tempfile.mkdtemp(dir=out_dir.resolve(), prefix=f".{name}{BUILD_PREFIX}"))
        owner = open(root / OWNER_LOCK, "w")  # noqa: SIM115 - held open (locked) for the build's life
    except OSError as exc:
        raise _out_dir_error(out_dir, exc) from None
    try:
        fcntl.flock(owner, fcntl.LOCK_EX)
        staging, work = root / "staging", root / "work"
        staging.mkdir()
        staging.chmod(0o755)
        work.mkdir()
        yield staging, work
    finally:
        shutil.rmtree(root, ignore_errors=True)
        owner.close()


def remove_stale_builds(out_dir: Path) -> list[Path]:
    """Remove build folders whose process is gone (its owner lock can be taken); return them."""
    removed = []
    for root in out_dir.glob(f".*{BUILD_PREFIX}*"):
        if not root.is_dir():
            continue
        try:
            with open(root / OWNER_LOCK) as owner:
                fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except FileNotFoundError:
            try:
                if time.time() - root.stat().st_mtime < UNLOCKED_GRACE_SECONDS:
                    continue  # just created; its owner is about to lock it
            except FileNotFoundError:
                continue
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                continue  # its build is running
            raise
        shutil.rmtree(root, ignore_errors=True)
        removed.append(root)
        log.info("removed %s, left by a build that did not finish", root)
    return removed


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def publish(staging: Path, final: Path) -> None:
    """Move a finished staging folder (manifest inside) to `final`, replacing an older build of the
    same identity. Under a lock per artifact name: concurrent builds of one identity take turns, and
    each rename moves a complete folder in. The replaced folder goes into the build folder, removed with it."""
    with _locked(final.parent / f".{final.name}.lock"):
        if final.exists() or final.is_symlink():
            os.replace(final, staging.parent / "replaced")
        os.replace(staging, final)
