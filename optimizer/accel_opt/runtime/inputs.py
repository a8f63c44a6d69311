"""What a job's inputs are: the one listing rule of both engines (`accel-opt run` and `--engine ray`), and how a
listed input names a file on this machine."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable
from pathlib import Path

from accel_opt.errors import UsageError
from accel_opt.preprocess.images import IMAGE_SUFFIXES
from accel_opt.runtime.output import input_key

NPZ = ".npz"
FILE_SCHEME = "file://"


def list_inputs(items: Iterable[str | os.PathLike], exclude: Path | None = None, remote: bool = True) -> list[str]:
    """The one input-listing rule of both engines (`accel-opt run` and `--engine ray`): files as given; folders
    recursively, as their image and .npz files, sorted by path; globs (`**` too) expanded; URIs (file://, s3://,
    gs://: any file system pyarrow reads) listed through pyarrow. A path that matches nothing stays in the list,
    to be rejected as not found. Files under `exclude` (an output folder) are left out. Without `remote`, a URI
    of another file system than file:// is a usage error (the local engine reads files on this machine only)."""
    listed: list[str] = []
    for item in items:
        text = str(item)
        if not remote and local_path(text) is None:
            raise UsageError(f"{text}: this engine reads files on this machine; --engine ray reads other file systems")
        if "://" in text:
            listed += _list_uri(text)
        elif glob.has_magic(text):
            listed += sorted(glob.glob(text, recursive=True)) or [text]
        elif Path(text).is_dir():
            listed += [str(p) for p in sorted(Path(text).rglob("*")) if p.is_file() and _is_input(p.name)]
        else:
            listed.append(text)
    if exclude is not None:
        out = str(exclude.resolve())
        listed = [p for p in listed if "://" in p or not str(Path(p).resolve()).startswith(out + os.sep)]
    if not listed:
        raise UsageError("no inputs: give image files, .npz feed dicts, folders or globs of them")
    return listed


def _is_input(name: str) -> bool:
    suffix = Path(name).suffix
    return suffix.lower() in IMAGE_SUFFIXES or suffix == NPZ


def _list_uri(uri: str) -> list[str]:
    try:
        import pyarrow.fs
    except ImportError:
        raise UsageError(f"{uri}: URIs are listed through pyarrow: pip install pyarrow (or 'accel-opt[ray]')") from None
    scheme = uri[: uri.index("://") + 3]
    fs, root = pyarrow.fs.FileSystem.from_uri(uri)
    if fs.get_file_info(root).type != pyarrow.fs.FileType.Directory:
        return [uri]
    found = fs.get_file_info(pyarrow.fs.FileSelector(root, recursive=True))
    return sorted(scheme + f.path for f in found if f.type == pyarrow.fs.FileType.File and _is_input(f.base_name))


def local_path(uri: str) -> str | None:
    """The local path of a plain path or a file:// URI; None for another file system (s3://, gs://)."""
    if uri.startswith(FILE_SCHEME):
        return uri[len(FILE_SCHEME):]
    return None if "://" in uri else uri


def unique_inputs(paths: list[str]) -> list[str]:
    """Each input once, at its first place: a fresh run and a resumed one answer a repeated path alike."""
    seen: set[str] = set()
    unique = []
    for path in paths:
        if (key := input_key(path)) not in seen:
            seen.add(key)
            unique.append(path)
    return unique


