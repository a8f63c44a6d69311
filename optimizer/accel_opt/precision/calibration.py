"""Samples -> ONNX Runtime's calibration contract (`get_next() -> dict | None`), adapted once, here."""

from __future__ import annotations

import contextlib

from onnxruntime.quantization import CalibrationDataReader

from accel_opt.data import Sample
from accel_opt.errors import Unsupported
from accel_opt.recipe.types import CalibrationMethod


class SampleReader(CalibrationDataReader):
    """Feeds a list of samples to an ORT calibrator, one feed dict per `get_next()`, then None."""

    def __init__(self, samples: list[Sample]):
        self._samples = list(samples)
        self._index = 0

    def get_next(self) -> Sample | None:
        if self._index >= len(self._samples):
            return None
        sample = self._samples[self._index]
        self._index += 1
        return sample

    def rewind(self) -> None:
        self._index = 0

    def __len__(self) -> int:
        return len(self._samples)


@contextlib.contextmanager
def calibration_errors(method: CalibrationMethod):
    """ORT's histogram calibrators fail on tensors spanning ~float max (attention masks filled with
    -3.4e38): turn that into a one-line error with the way out, not a crash."""
    try:
        yield
    except ValueError as exc:
        if "bins" not in str(exc):
            raise
        raise Unsupported(
            f"{method.value} calibration cannot histogram a tensor whose range spans ~float max "
            f"(typically an attention mask): quantize only matrix ops (precision_options.calibration.op_types: "
            f"[MatMul, Gemm]) or use --calibration minmax ({exc})"
        ) from None
