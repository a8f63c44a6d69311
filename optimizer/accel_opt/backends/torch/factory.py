"""PyTorch factories (FILE.py:FACTORY): importing a user's model factory with its export hints, and a runner over the
module it makes with the exported model's inputs and outputs (runner.py's `TorchRunner`).

`TorchRunner` is the accuracy reference for torch-sourced builds and the "PyTorch eager"
baseline row in benchmarks. torch is an optional extra: it is imported inside functions only,
and its absence is an `Unsupported` error (exit 4) naming the install command.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx

# The runner and torch's import live in torch/runner.py.
from accel_opt.backends.torch.runner import (
    TorchRunner,
    require_torch,
)
from accel_opt.errors import InputRejected, UsageError, first_line
from accel_opt.graph.inspect import io_specs


def looks_like_factory(spec: str) -> bool:
    """True for `path/file.py:FACTORY` or `package.module:FACTORY` that is not an existing file."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr.isidentifier() or Path(spec).exists() or target.endswith(".onnx"):
        return False
    return target.endswith(".py") or all(part.isidentifier() for part in target.split("."))


EXPORT_HINTS = ("input_dtypes", "dynamic", "output_names", "label")  # optional attributes of a factory function


class ModuleFactory:
    """A user's zero-argument callable building an nn.Module; calling it checks the result and sets eval mode.

    A factory may carry export hints as function attributes, passed on as `export()` keywords:
    `f.input_dtypes = {"input_ids": "int64"}`, `f.dynamic = {"input_ids": {1: "sequence"}}`,
    `f.output_names = ["sentence_embedding"]`.
    """

    def __init__(self, spec: str, fn: Callable[[], Any], search_path: Path | None = None):
        self.spec, self.fn, self.search_path = spec, fn, search_path
        self.given_hints: dict[str, Any] = {}  # the command line's (--input-dtypes, --dynamic): over the function's

    @property
    def name(self) -> str:
        """FACTORY of FILE.py:FACTORY; a folder's own name for a Hugging Face folder."""
        return self.spec.rpartition(":")[2] if ":" in self.spec else Path(self.spec).name

    @property
    def export_hints(self) -> dict[str, Any]:
        hints = {key: getattr(self.fn, key) for key in EXPORT_HINTS if getattr(self.fn, key, None) is not None}
        for key, value in self.given_hints.items():
            hints[key] = {**hints.get(key, {}), **value} if isinstance(value, dict) else value
        return hints

    def __call__(self) -> Any:
        torch = require_torch()
        try:
            with _on_sys_path(self.search_path):
                model = self.fn()
        except Exception as exc:
            raise InputRejected(f"model factory {self.spec} raised {type(exc).__name__}: {first_line(exc)}") from exc
        if not isinstance(model, torch.nn.Module):
            raise InputRejected(f"model factory {self.spec} returned {type(model).__name__}, expected a "
                                "torch.nn.Module")
        return model.eval()

    def __repr__(self) -> str:
        return f"ModuleFactory({self.spec!r})"


def load_factory(spec: str) -> ModuleFactory:
    """Import `FILE.py:FACTORY` or `package.module:FACTORY`; return the factory, not yet called.

    This imports, and calling the factory runs, the user's own Python code with the user's
    privileges: pass only code you trust. Import problems raise UsageError (exit 2); the
    factory's own failures, raised when it is called, InputRejected (exit 3).
    """
    require_torch()
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr.isidentifier():
        raise UsageError(f"expected FILE.py:FACTORY or package.module:FACTORY, got {spec!r}")
    search_path = None
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise UsageError(f"model factory file not found: {path}")
            search_path = path.resolve().parent
            name = f"_accel_opt_user_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{abs(hash(str(path.resolve()))):x}"
            module_spec = importlib.util.spec_from_file_location(name, path)
            if module_spec is None or module_spec.loader is None:
                raise UsageError(f"cannot import {path} as Python")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module  # dataclasses, pickling and torch.export look modules up by name
            with _on_sys_path(search_path):
                module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except UsageError:
        raise
    except (Exception, SystemExit) as exc:
        raise UsageError(f"importing {target} failed: {type(exc).__name__}: {first_line(exc)}") from exc
    if not hasattr(module, attr):
        callables = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))[:10]
        raise UsageError(f"{target} has no attribute {attr!r} (callables there: {', '.join(callables) or 'none'})")
    fn = getattr(module, attr)
    if not callable(fn):
        raise UsageError(f"{target}:{attr} is a {type(fn).__name__}, not a callable factory")
    return ModuleFactory(spec, fn, search_path)


@contextlib.contextmanager
def _on_sys_path(folder: Path | None):
    """The factory file's folder on sys.path while its code runs, as `python file.py` would have it."""
    if folder is None or str(folder) in sys.path:
        yield
        return
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(folder))


def torch_runner(model: Any, onnx_path: Path, threads: int | None = None, name: str = "pytorch-eager",
                 device: str = "cpu", precision: str = "fp32", compile: bool = False,
                 compile_backend: str = "inductor") -> TorchRunner:
    """A TorchRunner whose inputs and output names are those of the model exported to `onnx_path`."""
    inputs, outputs = io_specs(onnx.load(str(onnx_path), load_external_data=False))
    return TorchRunner(model, inputs, [o.name for o in outputs], threads=threads, name=name, device=device,
                       precision=precision, compile=compile, compile_backend=compile_backend)
