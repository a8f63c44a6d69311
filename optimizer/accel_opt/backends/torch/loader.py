"""Loading an AOTInductor package (`model.pt2`) into a callable, with its unpacked files kept where they are removed.

The C++ loader unpacks the package into a new folder under the temporary folder (`$TMPDIR/aotinductor_` and six
random characters) and removes it when the loaded model is freed; when the load fails (a package of another torch,
a broken library), nothing removes it, and each failed `run` left one behind (measured with torch 2.13: the folder
stays after the loader's exception). So the loader unpacks into a folder of ours (mode 0700, from `tempfile.mkdtemp`),
removed when the load fails and when the loaded model is freed."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The loader finds the temporary folder through $TMPDIR (std::filesystem::temp_directory_path), an environment
# variable of the whole process: loads that set it are serialized.
_TMPDIR_LOCK = threading.Lock()


def load_package(torch: Any, package: Path, device_index: int = -1, single_threaded: bool = False) -> Any:
    """The package as a callable. `aoti_load_package` imports all of Inductor first (4.6 s measured here, for a job
    that only runs the package), so the C++ loader it wraps is used directly, with the same flattening of arguments
    and results by the call spec the package records; where this torch lacks that loader, aoti_load_package.
    `single_threaded`: run without the package's own stream synchronization (its events), which a CUDA graph capture
    cannot take (cudaEventQuery during capture)."""
    unpacked = Path(tempfile.mkdtemp(prefix="accel-opt-aoti-"))
    try:
        loaded = _load(torch, package, device_index, single_threaded, unpacked)
    except BaseException:
        shutil.rmtree(unpacked, ignore_errors=True)
        raise
    weakref.finalize(loaded, shutil.rmtree, unpacked, ignore_errors=True)
    return loaded


def _load(torch: Any, package: Path, device_index: int, single_threaded: bool, unpacked: Path) -> Any:
    loader_class = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    with _temporary_folder(unpacked):
        if loader_class is not None and hasattr(loader_class, "boxed_run"):
            try:  # (path, model name, run single-threaded, runners, device index): torch 2.7 and newer
                return _Package(torch, loader_class(str(package), "model", single_threaded, 1, device_index))
            except TypeError:  # another release's constructor (the GPU machine runs 2.11, development 2.13)
                pass
        from torch._inductor import aoti_load_package

        return _Loaded(aoti_load_package(str(package), run_single_threaded=single_threaded,
                                         device_index=device_index))


@contextlib.contextmanager
def _temporary_folder(folder: Path) -> Iterator[None]:
    """$TMPDIR pointed at `folder` while the loader unpacks (restored after, under one lock)."""
    with _TMPDIR_LOCK:
        before = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = str(folder)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = before


class _Package:
    """An AOTInductor package's model: flat tensors in (forward()'s order), results unflattened as exported."""

    def __init__(self, torch: Any, loader: Any):
        from torch.utils import _pytree as pytree

        self._torch, self._pytree, self.loader = torch, pytree, loader
        self._out_spec = pytree.treespec_loads(loader.get_call_spec()[1])

    def __call__(self, *args: Any) -> Any:
        flat = [x for x in self._pytree.tree_flatten((args, {}))[0] if isinstance(x, self._torch.Tensor)]
        return self._pytree.tree_unflatten(self.loader.boxed_run(flat), self._out_spec)

    def get_metadata(self) -> dict[str, str]:
        return self.loader.get_metadata()


class _Loaded:
    """aoti_load_package's result, held in an object a finalizer can be attached to."""

    def __init__(self, model: Any):
        self.model = model

    def __call__(self, *args: Any) -> Any:
        return self.model(*args)

    def get_metadata(self) -> dict[str, str]:
        return self.model.get_metadata()
