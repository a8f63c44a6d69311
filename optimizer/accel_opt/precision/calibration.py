"""Samples -> ONNX Runtime's calibration contract (`get_next() -> dict | None`), adapted once, here."""

from __future__ import annotations

from onnxruntime.quantization import CalibrationDataReader

from accel_opt.data import Sample


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
