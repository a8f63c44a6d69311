"""PyTorch: importing a user's model factory, the runner over the module (torch_exec.py), verifying an export.

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from pydantic import BaseModel

# The runner, torch's import and CUDA checks live in torch_exec; re-exported here, where callers import them.
from accel_opt.backends.torch_exec import (  # noqa: F401
    AUTOCAST_DTYPES,
    TORCH_EXTRA,
    TorchRunner,
    flatten_outputs,
    require_cuda,
    require_torch,
)
from accel_opt.data import Sample, synthetic_samples
from accel_opt.errors import GateFailed, InputRejected, UsageError, first_line
from accel_opt.graph.inspect import io_specs
from accel_opt.recipe import Tolerance


def looks_like_factory(spec: str) -> bool:
    """True for `path/file.py:FACTORY` or `package.module:FACTORY` that is not an existing file."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr.isidentifier() or Path(spec).exists() or target.endswith(".onnx"):
        return False
    return target.endswith(".py") or all(part.isidentifier() for part in target.split("."))


EXPORT_HINTS = ("input_dtypes", "dynamic", "output_names")  # optional attributes of a factory function


class ModuleFactory:
    """A user's zero-argument callable building an nn.Module; calling it checks the result and sets eval mode.

    A factory may carry export hints as function attributes, passed on as `export()` keywords:
    `f.input_dtypes = {"input_ids": "int64"}`, `f.dynamic = {"input_ids": {1: "sequence"}}`,
    `f.output_names = ["sentence_embedding"]`.
    """

    def __init__(self, spec: str, fn: Callable[[], Any], search_path: Path | None = None):
        self.spec, self.fn, self.search_path = spec, fn, search_path

    @property
    def export_hints(self) -> dict[str, Any]:
        return {key: getattr(self.fn, key) for key in EXPORT_HINTS if getattr(self.fn, key, None) is not None}

    def __call__(self) -> Any:
        torch = require_torch()
        try:
            with _on_sys_path(self.search_path):
                model = self.fn()
        except Exception as exc:
            raise InputRejected(f"model factory {self.spec} raised {type(exc).__name__}: {first_line(exc)}") from exc
        if not isinstance(model, torch.nn.Module):
            raise InputRejected(f"model factory {self.spec} returned {type(model).__name__}, expected a torch.nn.Module")
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


class OutputCheck(BaseModel):
    name: str
    batch_size: int
    shape: list[int]
    max_abs_error: float
    passed: bool  # within the tolerance at this batch size (see the report's failures for why not)


class VerificationReport(BaseModel):
    onnx_path: str
    tolerance: Tolerance  # the fp32 gate's, by default: the one definition of "within tolerance"
    threads: int
    batch_sizes: list[int]
    checks: list[OutputCheck]
    failures: list[str]  # one line each; empty when the export matches PyTorch

    @property
    def passed(self) -> bool:
        return not self.failures


def verify(
    module: Any,
    onnx_path: Path,
    shapes: dict[str, list[int]],
    batch_sizes: Sequence[int] | None = None,
    tolerance: Tolerance | None = None,
    threads: int | None = None,
    samples: list[Sample] | None = None,
    seed: int = 1,
    raise_on_failure: bool = True,
) -> VerificationReport:
    """Run the ONNX model (ONNX Runtime CPU) and the module on fresh inputs and compare every output.

    Default batch sizes: the example's and another one (3, or 2), which exercises the dynamic
    batch axis. `samples` replaces the random inputs (e.g. real tokenized sentences). Judged like
    the build's gate, with its fp32 tolerance unless `tolerance` is given. A mismatch raises
    GateFailed (exit 1) with the report attached as `.report`, unless `raise_on_failure` is False.
    """
    from accel_opt.accuracy import judge
    from accel_opt.recipe import AccuracyConfig, Precision

    require_torch()
    from accel_opt.backends.onnxruntime import CPU_PROVIDER, create_session
    from accel_opt.machine.cpu import available_cpus

    threads = threads or available_cpus()
    inputs, outputs = io_specs(onnx.load(str(onnx_path), load_external_data=False))
    if [s.name for s in inputs] != list(shapes):
        raise UsageError(f"shapes name inputs {list(shapes)}, the ONNX model has {[s.name for s in inputs]}")
    if samples is None:
        base = shapes[inputs[0].name][0]
        batch_dynamic = all(s.shape and not isinstance(s.shape[0], int) for s in inputs)
        batch_sizes = batch_sizes or ((base, 3 if base != 3 else 2) if batch_dynamic else (base,))
        samples = [
            synthetic_samples(inputs, {k: [b, *v[1:]] for k, v in shapes.items()}, 1, seed + b)[0][0] for b in batch_sizes
        ]
    tolerance = tolerance or AccuracyConfig().tolerances[Precision.fp32]
    session = create_session(Path(onnx_path), [CPU_PROVIDER], threads)
    failures: list[str] = []
    refs, gots, names, batches = [], [], [], []
    with TorchRunner(module, inputs, [o.name for o in outputs], threads=threads) as reference:
        for feed in samples:
            batch = int(next(iter(feed.values())).shape[0])
            try:
                got = session.run(None, feed)
            except Exception as exc:
                failures.append(f"batch {batch}: ONNX Runtime failed: {first_line(exc)}")
                continue
            try:
                ref = list(reference.infer(feed, check_inputs=False).values())
            except Exception as exc:
                failures.append(f"batch {batch}: PyTorch failed: {type(exc).__name__}: {first_line(exc)}")
                continue
            refs.append({spec.name: r for spec, r in zip(outputs, ref, strict=True)})
            gots.append({spec.name: g for spec, g in zip(outputs, got, strict=True)})
            names.append(f"batch {batch}")
            batches.append(batch)
    checks: list[OutputCheck] = []
    if refs:
        verdict = judge(refs, gots, names, tolerance, reference_name="pytorch", candidate_name="onnxruntime")
        failures += verdict.failures
        failed = {(s.sample, s.output) for s in verdict.worst_samples if not s.passed}
        for batch, name, ref, got in zip(batches, names, refs, gots):
            for output, r in ref.items():
                g = got[output]
                same_shape = np.shape(g) == np.shape(r)
                max_abs = float(np.nan_to_num(np.abs(g.astype(np.float64) - r), nan=np.inf).max(initial=0.0)) if same_shape else np.inf
                checks.append(OutputCheck(name=output, batch_size=batch, shape=list(np.shape(g)), max_abs_error=max_abs,
                                          passed=same_shape and (name, output) not in failed))
    report = VerificationReport(
        onnx_path=str(onnx_path), tolerance=tolerance, threads=threads,
        batch_sizes=[int(next(iter(f.values())).shape[0]) for f in samples], checks=checks, failures=failures,
    )
    if failures and raise_on_failure:
        more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
        error = GateFailed(f"exported model differs from PyTorch: {failures[0]}{more}")
        error.report = report  # type: ignore[attr-defined]
        raise error
    return report


