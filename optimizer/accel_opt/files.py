"""Files written whole or not at all, content hashes, the user's cache folder, and the versions a result depends on:
the helpers every layer of the package uses (the artifact folder's format and life cycle are artifact/folder.py)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from pydantic import BaseModel

from accel_opt.errors import ResourceExhausted

# Distributions whose versions key a result: a build's identity, a re-check's remembered verdict, a cached probe.
_TOOLS = ("accel-opt", "onnx", "onnxruntime", "onnxruntime-gpu", "polygraphy", "onnxslim", "numpy", "openvino", "nncf", "torch",
          "tensorrt")


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


def user_cache_dir(*parts: str) -> Path:
    """accel-opt's folder in the user's cache ($XDG_CACHE_HOME, else ~/.cache): what is remembered outside artifacts."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "accel-opt", *parts)


def now_utc() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def ensure_free_space(folder: Path, needed_bytes: int) -> None:
    """ResourceExhausted (exit 5) when `folder`'s file system has less than `needed_bytes` free. Native
    writers (ONNX shape inference, for one) truncate files silently on a full disk instead of failing."""
    free = shutil.disk_usage(folder).free
    if free < needed_bytes:
        raise ResourceExhausted(f"no space left on the device holding {folder}: {free / 2**20:.1f} MiB free, "
                                f"this step needs about {needed_bytes / 2**20:.1f} MiB")


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
