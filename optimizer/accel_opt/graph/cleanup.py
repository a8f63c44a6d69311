"""Graph cleanup with onnxslim (constant folding, dead code, fusions). The build uses the simplified model only once
it has been verified against the original (builder/checks.py): a cleanup must never be the reason a build changes its
answers.
"""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path

import onnx
from pydantic import BaseModel

from accel_opt.errors import first_line, no_space_error
from accel_opt.graph.inspect import op_histogram
from accel_opt.graph.save import EXTERNAL_DATA_ABOVE_BYTES

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


def simplify(model_path: Path, total_bytes: int, out_path: Path) -> tuple[Path | None, CleanupReport]:
    """onnxslim's simplification of `model_path` written to `out_path`: (out_path, the report of what changed), or
    (None, the report saying why not) when onnxslim fails on it. The caller verifies before it uses the result."""
    import onnxslim

    before = onnx.load(str(model_path), load_external_data=False)
    counts = dict(nodes_before=len(before.graph.node), ops_before=op_histogram(before))
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # onnxslim prints a summary table
            onnxslim.slim(
                str(model_path), output_model=str(out_path),
                save_as_external_data=total_bytes > EXTERNAL_DATA_ABOVE_BYTES
            )
    except Exception as exc:  # onnxslim surfaces many error types; any failure but a full disk keeps the original
        if no_space_error(exc):
            raise
        reason = f"onnxslim failed ({type(exc).__name__}: {first_line(exc)}); original kept"
        log.warning(reason)
        return None, CleanupReport(applied=False, reason=reason, nodes_after=counts["nodes_before"],
                                   ops_after=counts["ops_before"], **counts)
    after = onnx.load(str(out_path), load_external_data=False)
    return out_path, CleanupReport(applied=False, reason="not verified yet", nodes_after=len(after.graph.node),
                                   ops_after=op_histogram(after), **counts)
