"""What a job's inputs are: the one listing rule of both engines (`accel-opt run` and `--engine ray`), and how a
listed input names a file on this machine."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable
from pathlib import Path

from accel_opt.errors import UsageError
from accel_opt.preprocess.images import IMAGE_SUFFIXES
from accel_opt.preprocess.text import TEXT_SUFFIXES, TextItem, read_texts
from accel_opt.runtime.output import input_key

NPZ = ".npz"
FILE_SCHEME = "file://"


def list_inputs(items: Iterable[str | os.PathLike], exclude: Path | None = None, remote: bool = True,
                texts: bool = False) -> list[str]:
    """The one input-listing rule of both engines (`accel-opt run` and `--engine ray`): files as given; folders
    recursively, as their image and .npz files (`texts`: their text files), sorted by path; globs (`**` too) expanded;
    URIs (file://, s3://, gs://: any file system pyarrow reads) listed through pyarrow. A path that matches nothing
    stays in the list, to be rejected as not found. Files under `exclude` (an output folder) are left out. Without
    `remote`, a URI of another file system than file:// is a usage error (the local engine reads files on this machine
    only)."""
    listed: list[str] = []
    for item in items:
        text = str(item)
        if not remote and local_path(text) is None:
            raise UsageError(f"{text}: this engine reads files on this machine; --engine ray reads other file systems")
        if "://" in text:
            listed += _list_uri(text, texts)
        elif glob.has_magic(text):
            listed += sorted(glob.glob(text, recursive=True)) or [text]
        elif Path(text).is_dir():
            listed += [str(p) for p in sorted(Path(text).rglob("*")) if p.is_file() and _is_input(p.name, texts)]
        else:
            listed.append(text)
    if exclude is not None:
        out = str(exclude.resolve())
        listed = [p for p in listed if "://" in p or not str(Path(p).resolve()).startswith(out + os.sep)]
    if not listed:
        raise UsageError("no inputs: give " + ("text files" if texts else "image files, .npz feed dicts") +
                         ", folders or globs of them")
    return listed


def job_inputs(config, artifact_name: str, items: Iterable[str | os.PathLike], exclude: Path | None = None,
               remote: bool = True) -> tuple[list[str], dict[str, TextItem]]:
    """What a job answers, by the one rule of both engines: the listed inputs (exit 2 for a kind the artifact does not
    take), and for an artifact with a text stage every text's id instead, with each id's text by input key."""
    given = list_inputs(items, exclude, remote, texts=config.text is not None)
    refuse_other_kinds(config, artifact_name, given)
    if config.text is None:
        return given, {}
    if other := next((p for p in given if local_path(p) is None), None):
        raise UsageError(f"{other}: text files are read by the driver, from this machine's file system")
    return listed_texts([local_path(p) for p in given], config.text.field)


def listed_texts(files: list[str], field_name: str) -> tuple[list[str], dict[str, TextItem]]:
    """The id of every text of `files` in order, repeats kept (a file given twice is read once and listed twice: the
    job answers each id once, at its first place, and counts the repeats), and each id's item by input key."""
    read: dict[str, list[TextItem]] = {}
    items: list[TextItem] = []
    for file in files:
        key = input_key(file)
        if key not in read:
            read[key] = read_texts(file, field_name)
        items += read[key]
    return [item.id for item in items], {input_key(item.id): item for item in reversed(items)}


def _is_input(name: str, texts: bool = False) -> bool:
    suffix = Path(name).suffix
    return suffix.lower() in TEXT_SUFFIXES if texts else suffix.lower() in IMAGE_SUFFIXES or suffix == NPZ


def refuse_other_kinds(config, artifact_name: str, paths: list[str]) -> None:
    """UsageError (exit 2) for an input of a kind the artifact cannot take, naming what it takes: text files for an
    artifact without a text stage, images for one without image preprocessing, anything but text for a text one."""
    takes = ("text files (" + ", ".join(TEXT_SUFFIXES) + ")" if config.text is not None else
             "images or .npz feed dicts" if config.preprocessing is not None else ".npz feed dicts")
    for path in paths:
        suffix = Path(path).suffix.lower()
        if config.text is not None:
            wrong = suffix not in TEXT_SUFFIXES
        else:
            wrong = suffix in TEXT_SUFFIXES or (suffix in IMAGE_SUFFIXES and config.preprocessing is None)
        if wrong:
            why = ("it has a text stage" if config.text is not None else
                   "it was built without a `text` stage" if suffix in TEXT_SUFFIXES else
                   "it was built without image `preprocessing`")
            raise UsageError(f"{path}: {artifact_name} takes {takes}, not {suffix or 'files without a suffix'} ({why})")


def _list_uri(uri: str, texts: bool = False) -> list[str]:
    try:
        import pyarrow.fs
    except ImportError:
        raise UsageError(f"{uri}: URIs are listed through pyarrow: pip install pyarrow") from None
    scheme = uri[: uri.index("://") + 3]
    fs, root = pyarrow.fs.FileSystem.from_uri(uri)
    if fs.get_file_info(root).type != pyarrow.fs.FileType.Directory:
        return [uri]
    found = fs.get_file_info(pyarrow.fs.FileSelector(root, recursive=True))
    return sorted(scheme + f.path for f in found if f.type == pyarrow.fs.FileType.File
                  and _is_input(f.base_name, texts))


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


