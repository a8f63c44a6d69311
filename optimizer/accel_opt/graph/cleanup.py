"""Graph cleanup with onnxslim (constant folding, dead code, fusions), verified before use.

The simplified model replaces the original only if it matches it within the recipe's fp32 tolerance
on the evaluation samples (both run unoptimized on the ORT CPU EP, judged like any build). Otherwise the original
is kept and the report says why: a cleanup must never be the reason a build changes its answers.
"""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path

import onnx
from pydantic import BaseModel

from accel_opt.accuracy import compare
from accel_opt.backends.onnxruntime import reference_runner
from accel_opt.data import Sample
from accel_opt.errors import AccelOptError, first_line, no_space_error
from accel_opt.graph.inspect import op_histogram
from accel_opt.graph.save import EXTERNAL_DATA_ABOVE_BYTES
from accel_opt.recipe import Tolerance

log = logging.getLogger(__name__)


class CleanupReport(BaseModel):
    applied: bool
    reason: str
    nodes_before: int
    nodes_after: int
    ops_before: dict[str, int]
    ops_after: dict[str, int]
    max_abs_error: float | None = None
    cosine: float | None = None


def cleanup(
    model_path: Path, total_bytes: int, samples: list[Sample], tolerance: Tolerance, threads: int, out_path: Path
) -> tuple[Path, CleanupReport]:
    """Return (model to use, report): `out_path` when the simplified model verified, else `model_path`."""
    import onnxslim

    before = onnx.load(str(model_path), load_external_data=False)
    counts = dict(nodes_before=len(before.graph.node), ops_before=op_histogram(before))
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # onnxslim prints a summary table
            onnxslim.slim(
                str(model_path), output_model=str(out_path), save_as_external_data=total_bytes > EXTERNAL_DATA_ABOVE_BYTES
            )
    except Exception as exc:  # onnxslim surfaces many error types; any failure but a full disk keeps the original
        if no_space_error(exc):
            raise
        reason = f"onnxslim failed ({type(exc).__name__}: {first_line(exc)}); original kept"
        log.warning(reason)
        return model_path, CleanupReport(applied=False, reason=reason, nodes_after=counts["nodes_before"],
                                         ops_after=counts["ops_before"], **counts)
    after = onnx.load(str(out_path), load_external_data=False)
    counts.update(nodes_after=len(after.graph.node), ops_after=op_histogram(after))
    try:
        report = compare(reference_runner(model_path, threads), reference_runner(out_path, threads), samples, tolerance,
                         noise_reference=reference_runner(model_path, threads, optimize=True))
    except AccelOptError as exc:
        reason = f"simplified model does not load ({exc}); original kept"
        return model_path, CleanupReport(applied=False, reason=reason, **counts)
    max_abs = max((o.max_abs_error for o in report.outputs), default=0.0)
    cosine = report.worst_cosine
    if not report.passed:
        reason = f"simplified model differs from the original ({'; '.join(report.failures)}); original kept"
        log.warning(reason)
        return model_path, CleanupReport(applied=False, reason=reason, max_abs_error=max_abs, cosine=cosine, **counts)
    reason = f"verified on {report.sample_count} samples (max abs error {max_abs:.3g})"
    return out_path, CleanupReport(applied=True, reason=reason, max_abs_error=max_abs, cosine=cosine, **counts)
