"""`.npz` feed dicts, read within a size limit: every member's declared size, shape and dtype are checked from the
zip and .npy headers before any array is read.

A .npz is a zip of .npy arrays; numpy reads a member by allocating the array its header declares, then filling it.
A file of 1 MB can declare 1 GiB (a compressed run of zeros): read naively, that is 1 GiB resident before any check
can refuse it. Here a member whose declared array, or uncompressed size, is beyond the per-input limit is refused
(exit 3) with both sizes, and so is a file whose arrays add up beyond it; with the model's inputs given, names,
dtypes, ranks and fixed dims are checked from the headers too. Each reader thread then holds at most one input of
at most the limit. The limit: ACCEL_OPT_MAX_INPUT_MIB (default 256 MiB per input file).
"""

from __future__ import annotations

import math
import os
import threading
import zipfile
from pathlib import Path

import numpy as np

from accel_opt.errors import InputRejected, UsageError, first_line
from accel_opt.graph.inspect import TensorSpec

# numpy parses a .npy header with ast.literal_eval, and CPython 3.11 before 3.11.8 miscounts the AST's recursion depth
# when two threads compile at once ("SystemError: AST constructor recursion depth mismatch", gh-106905; seen in
# `accel-opt run`'s reader threads on 3.11.7). Reading a .npz, headers and arrays, is one thread at a time: one feed
# dict's read, small next to the model call the other threads wait on.
_NPZ_LOCK = threading.Lock()

MAX_INPUT_MIB_ENV = "ACCEL_OPT_MAX_INPUT_MIB"
DEFAULT_MAX_INPUT_MIB = 256


def max_input_bytes() -> int:
    """The per-input limit in bytes: ACCEL_OPT_MAX_INPUT_MIB, else 256 MiB; a value that is not a positive number of
    MiB is a usage error (exit 2)."""
    raw = os.environ.get(MAX_INPUT_MIB_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_INPUT_MIB << 20
    try:
        mib = float(raw)
    except ValueError:
        mib = -1.0
    if not (math.isfinite(mib) and mib > 0):
        raise UsageError(f"{MAX_INPUT_MIB_ENV}={raw!r}: expected a positive number of MiB")
    return int(mib * (1 << 20))


def spec_problem(name: str, dtype: np.dtype, shape: tuple[int, ...], spec: TensorSpec) -> str | None:
    """Why an array `name` of this dtype and shape does not fit the model input `spec` (None: it does)."""
    if dtype.name != spec.dtype:
        return f"{name} has dtype {dtype.name}, the model expects {spec.dtype}"
    if len(shape) != len(spec.shape):
        return f"{name} has rank {len(shape)}, the model expects {len(spec.shape)}"
    for axis, (have, want) in enumerate(zip(shape, spec.shape)):
        if isinstance(want, int) and want >= 0 and have != want:
            return f"{name} dim {axis} is {have}, the model fixes it at {want}"
    return None


def read_npz(path: str | Path, specs: list[TensorSpec] | None = None,
             max_bytes: int | None = None) -> dict[str, np.ndarray]:
    """The arrays of a .npz feed dict, or InputRejected saying why not (never unpickles anything). Sizes (and with
    `specs`, the model's inputs, whose names must match exactly) are checked from the headers before reading."""
    limit = max_input_bytes() if max_bytes is None else max_bytes
    # A zip is found by its end: a .npy with a zip appended passed as one, and numpy, which reads a file by its start,
    # then read the .npy (767 MB past the limit). A .npz starts as a zip too, and its arrays are read from the very
    # members whose headers were checked, never by opening the path again.
    with open(path, "rb") as f:
        start = f.read(4)
    if start not in (b"PK\x03\x04", b"PK\x05\x06") or not zipfile.is_zipfile(path):
        raise InputRejected("not a .npz (zip) file")
    try:
        with _NPZ_LOCK, zipfile.ZipFile(path) as archive:
            declared = _declared_arrays(archive, limit)
            if specs is not None:
                _check_declared(declared, specs)
            arrays = {}
            for info in archive.infolist():
                with archive.open(info) as member:
                    array = np.lib.format.read_array(member, allow_pickle=False)
                    arrays[info.filename.removesuffix(".npy")] = _native(array)
            return arrays
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise InputRejected(f"not a readable .npz without pickles ({first_line(exc)})") from None


def array_names(folder: str | Path) -> set[str]:
    """The array names the first .npz feed dict of `folder` gives (read from the zip's listing, nothing decoded);
    empty for a folder of images or texts, a file, or a folder without .npz files."""
    root = Path(folder)
    first = min((p for p in root.iterdir() if p.suffix == ".npz" and p.is_file()),
                default=None) if root.is_dir() else None
    if first is None:
        return set()
    try:
        with zipfile.ZipFile(first) as archive:
            return {name.removesuffix(".npy") for name in archive.namelist()}
    except (OSError, zipfile.BadZipFile):
        return set()  # read_npz names the problem when the samples are read


def _native(array: np.ndarray) -> np.ndarray:
    """The array in this machine's byte order: a big-endian '>f4' has the dtype name float32 too, and a runtime given
    its bytes as they are reads other numbers."""
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


def _declared_arrays(archive: zipfile.ZipFile, limit: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """name -> (shape, dtype) of every member, from the headers; InputRejected past `limit` bytes."""
    declared, total = {}, 0
    for info in archive.infolist():
        if not info.filename.endswith(".npy"):
            raise InputRejected(f"member {info.filename!r} is not a .npy array")
        name = info.filename.removesuffix(".npy")
        if info.file_size > limit:
            raise InputRejected(f"{name} is {_mib(info.file_size)} uncompressed, over the {_mib(limit)} limit per "
                                "input "
                                f"({MAX_INPUT_MIB_ENV})")
        with archive.open(info) as member:
            version = np.lib.format.read_magic(member)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(member)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(member)
            else:
                raise InputRejected(f"{name}: .npy format {version[0]}.{version[1]} is not read here (1.0 or 2.0)")
        if dtype.hasobject:
            raise InputRejected(f"{name} holds Python objects (a pickle): only .npz without pickles are read")
        size = math.prod(shape) * dtype.itemsize
        total += size
        if size > limit or total > limit:
            what = f"{name} declares {list(shape)} {dtype.name} ({_mib(size)})" if size > limit else \
                f"its arrays declare {_mib(total)} together"
            raise InputRejected(f"{what}, over the {_mib(limit)} limit per input ({MAX_INPUT_MIB_ENV})")
        declared[name] = (tuple(shape), dtype)
    return declared


def _check_declared(declared: dict[str, tuple[tuple[int, ...], np.dtype]], specs: list[TensorSpec]) -> None:
    expected = {spec.name: spec for spec in specs}
    missing, extra = sorted(set(expected) - set(declared)), sorted(set(declared) - set(expected))
    if missing or extra:
        raise InputRejected(f"arrays {sorted(declared)} do not match model inputs {sorted(expected)}"
                            + (f" (missing {missing})" if missing else "") + (f" (unknown {extra})" if extra else ""))
    for name, (shape, dtype) in declared.items():
        if problem := spec_problem(name, dtype, shape, expected[name]):
            raise InputRejected(problem)


def _mib(size: int) -> str:
    return f"{size / (1 << 20):,.1f} MiB"
