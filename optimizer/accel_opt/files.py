"""Files written whole or not at all, content hashes, the user's cache folder, and the versions a result depends on:
the helpers every layer of the package uses (the artifact folder's format and life cycle are artifact/folder.py)."""

from __future__ import annotations

import hashlib
import json
import logging
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

# What a long stage is doing now (the search's step, the benchmark's round), for a person watching: the command line
# shows the latest message on a terminal's live line (cli.progress.build_progress); nothing else reads it.
progress = logging.getLogger("accel_opt.progress")

# Distributions whose versions key a result: a build's identity, a re-check's remembered verdict, a cached probe.
_TOOLS = ("accel-opt", "onnx", "onnxruntime", "onnxruntime-gpu", "polygraphy", "onnxslim", "numpy", "openvino",
          "nncf", "torch",
          "tensorrt")


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


# ---- cache entries a build may reuse only with proof it made them -------------------------------------------------
# Caches live under --out (.cache/), which whoever can write --out can plant files in: a compiled torch package is
# native code that runs in the building process (the one holding --sign-key), and a cached int8 model or learned
# weights become what is signed. An entry is reused only when the mark beside it is this user's HMAC of its bytes,
# under a secret only this user can read (user_cache_dir, mode 0600): a planted or altered entry is rebuilt.
MADE_SUFFIX = ".made"


def _secret() -> bytes:
    """This user's cache secret (32 random bytes), created on first use; a file another user could read or replace is
    not trusted: a new secret is made, and no earlier entry matches it."""
    import secrets

    path = user_cache_dir("cache-secret")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:  # another build made it just now
                continue
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
            continue
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            secret = f.read(64)
        if info.st_uid == os.getuid() and not info.st_mode & 0o077 and len(secret) == 32:
            return secret
        path.unlink(missing_ok=True)  # not ours alone: replaced
    raise ResourceExhausted(f"cannot create the cache secret {path}")


def _mark_of(digest: str) -> str:
    import hmac

    return hmac.new(_secret(), digest.encode(), hashlib.sha256).hexdigest()


def mark_made(path: Path, mark: Path | None = None) -> None:
    """Mark the cache entry at `path` as made by this user's build (call after it is written whole); the mark goes
    beside it, or at `mark` (an artifact folder's, outside the folder, which must hold listed files only)."""
    mark = mark or path.with_name(path.name + MADE_SUFFIX)
    mark.parent.mkdir(parents=True, exist_ok=True)
    write_text(mark, _mark_of(sha256_file(path)))


def made_here(path: Path, mark: Path) -> bool:
    """Whether `mark` is this user's mark of the file at `path` as it is now (a small file: hashed in place)."""
    try:
        return _marked(mark, sha256_file(path))
    except OSError:
        return False


def _marked(mark: Path, digest: str) -> bool:
    import hmac

    try:
        return mark.is_file() and hmac.compare_digest(mark.read_text().strip(), _mark_of(digest))
    except (OSError, UnicodeDecodeError):
        return False


def made_copy(entry: Path, dest: Path) -> bool:
    """Copy the cache entry `entry` to `dest` when it is one this user's build made: the copy's bytes are what is
    checked (whatever happens to the entry after), and a copy that does not match its mark is removed. False: no
    entry, or not proved made here (rebuild it)."""
    if not entry.is_file():
        return False
    copy_file(entry, dest)
    if _marked(entry.with_name(entry.name + MADE_SUFFIX), sha256_file(dest)):
        return True
    dest.unlink(missing_ok=True)
    return False


def made_bytes(entry: Path) -> bytes | None:
    """The bytes of the cache entry `entry` when this user's build made it (read once, then checked); else None."""
    try:
        data = entry.read_bytes()
    except OSError:
        return None
    return data if _marked(entry.with_name(entry.name + MADE_SUFFIX), hashlib.sha256(data).hexdigest()) else None


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


def install_line(extra: str, then: str = "") -> str:
    """The `pip install` of an extra that works where this accel-opt came from: the checkout or wheel it was installed
    from (pip records it, PEP 610: direct_url.json), else the distribution's name (an index that holds it).
    accel-opt is not on a public index: `pip install 'accel-opt[sign]'` would find nothing there."""
    from urllib.parse import unquote, urlparse

    source = "accel-opt"
    try:
        recorded = json.loads(metadata.distribution("accel-opt").read_text("direct_url.json") or "{}")
    except (metadata.PackageNotFoundError, ValueError):
        recorded = {}
    url = urlparse(str(recorded.get("url", "")))
    if url.scheme == "file" and url.path:
        source = unquote(url.path)
    return f"pip install '{source}[{extra}]'" + (f" {then}" if then else "")


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
