"""An export verified: ONNX Runtime running the exported model against the PyTorch module on fresh inputs, every
output judged by the gate's own rules (`accel-opt export`, and the export stage of a build from a factory)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from pydantic import BaseModel

from accel_opt.accuracy.judge import judge
from accel_opt.backends.onnxruntime.backend import CPU_PROVIDER, create_session
from accel_opt.backends.torch.runner import TorchRunner, require_torch
from accel_opt.data import Sample, synthetic_samples
from accel_opt.errors import GateFailed, UsageError, first_line
from accel_opt.graph.inspect import io_specs
from accel_opt.machine.cpu import available_cpus
from accel_opt.recipe.gate import AccuracyConfig, Tolerance
from accel_opt.recipe.types import Precision


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
    require_torch()

    threads = threads or available_cpus()
    inputs, outputs = io_specs(onnx.load(str(onnx_path), load_external_data=False))
    if [s.name for s in inputs] != list(shapes):
        raise UsageError(f"shapes name inputs {list(shapes)}, the ONNX model has {[s.name for s in inputs]}")
    if samples is None:
        base = shapes[inputs[0].name][0]
        batch_dynamic = all(s.shape and not isinstance(s.shape[0], int) for s in inputs)
        batch_sizes = batch_sizes or ((base, 3 if base != 3 else 2) if batch_dynamic else (base,))
        samples = [
            synthetic_samples(inputs, {k: [b, *v[1:]] for k, v in shapes.items()}, 1,
                              seed + b)[0][0] for b in batch_sizes
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
                max_abs = float(np.nan_to_num(np.abs(g.astype(np.float64) - r),
                                              nan=np.inf).max(initial=0.0)) if same_shape else np.inf
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


