"""Artifact folders that are complete or absent, content hashes, and the environment record.

A build writes into a hidden staging folder beside its final place; on success the folder is
renamed into place and `manifest.json` is written last, atomically. Anything that stops the build
earlier (error, crash, Ctrl-C) leaves no folder holding a manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

from pydantic import BaseModel

MANIFEST = "manifest.json"
_TOOLS = ("accel-opt", "onnx", "onnxruntime", "onnxruntime-gpu", "polygraphy", "onnxslim", "numpy", "openvino", "torch", "tensorrt")


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def write_json(path: Path, model: BaseModel | dict) -> None:
    text = model.model_dump_json(indent=2) if isinstance(model, BaseModel) else json.dumps(model, indent=2)
    write_text(path, text + "\n")


def write_text(path: Path, text: str) -> None:
    _write_atomically(path, lambda f: f.write(text.encode("utf-8")))


def write_bytes(path: Path, data: bytes) -> None:
    _write_atomically(path, lambda f: f.write(data))


def copy_file(src: Path, dest: Path) -> None:
    """Copy `src` to `dest` atomically (a cache entry is complete or absent)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as source:
        _write_atomically(dest, lambda f: shutil.copyfileobj(source, f))


def _write_atomically(path: Path, write) -> None:
    """Write via a temp file in the same folder, fsync, rename: readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; artifacts are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def staging_dir(out_dir: Path, name: str):
    """Yield a staging folder; on success the caller publishes it with `publish`; else it is removed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir, prefix=f".{name}.staging-"))
    staging.chmod(0o755)
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def publish(staging: Path, final: Path) -> None:
    """Move a finished staging folder to `final`, replacing an older build of the same identity."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        (final / MANIFEST).unlink(missing_ok=True)  # the old build stops being complete first
        os.replace(final, old)
    os.replace(staging, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def tool_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for dist in _TOOLS:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return versions


def command_line() -> list[str]:
    return [Path(sys.argv[0]).name, *sys.argv[1:]]
