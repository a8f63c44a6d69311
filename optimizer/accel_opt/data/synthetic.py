"""Seeded synthetic samples for builds without --data (the sign-off then says the data was synthetic)."""

from __future__ import annotations

import math

import numpy as np

from accel_opt.data.summary import DataSummary, Sample
from accel_opt.errors import ResourceExhausted
from accel_opt.graph.inspect import TensorSpec
from accel_opt.machine.memory import available_memory_bytes

SYNTHETIC_INT_HIGH = 100  # integers are drawn in [0, 100) unless the input indexes a smaller table


def synthetic_samples(
    inputs: list[TensorSpec], shapes: dict[str, list[int]], count: int, seed: int,
    int_bounds: dict[str, int] | None = None,
) -> tuple[list[Sample], DataSummary]:
    """Seeded inputs: N(0,1) floats; masks all ones, type ids zeros, other integers in [0, 100), or in
    [0, bound) for an input that indexes a table of `int_bounds[name]` rows (graph.inspect.index_bounds):
    an out-of-range index fails the reference run instead of testing the model."""
    rng = np.random.default_rng(seed)
    bounds = int_bounds or {}
    _refuse_beyond_memory(inputs, shapes, count)
    samples = [{spec.name: _random_array(spec, shapes[spec.name], rng, bounds.get(spec.name)) for spec in inputs}
               for _ in range(count)]
    names = [f"synthetic-{i:04d}" for i in range(count)]
    return samples, DataSummary(source="synthetic", path=None, count=count, sha256=None, seed=seed, names=names)


def _refuse_beyond_memory(inputs: list[TensorSpec], shapes: dict[str, list[int]], count: int) -> None:
    """ResourceExhausted (exit 5) with the size when `count` samples of these shapes cannot fit in memory."""
    one = sum(math.prod(shapes[s.name]) * np.dtype(s.dtype if s.dtype != "bfloat16" else "float32").itemsize
              for s in inputs)
    available = available_memory_bytes()
    if available is not None and one * count > available:
        raise ResourceExhausted(f"{count} synthetic samples of {', '.join(f'{n}:{shapes[n]}' for n in shapes)} take "
                                f"{one * count / (1 << 30):,.1f} GiB, more than the {available / (1 << 30):,.1f} GiB "
                                "available: smaller --shapes")


def _random_array(spec: TensorSpec, shape: list[int], rng: np.random.Generator, high: int | None = None) -> np.ndarray:
    dtype = np.dtype(spec.dtype) if spec.dtype != "bfloat16" else np.dtype("float32")
    lowered = spec.name.lower()
    if dtype.kind == "f":
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if "mask" in lowered:
        return np.ones(shape, dtype=dtype)
    if "type" in lowered:
        return np.zeros(shape, dtype=dtype)
    return rng.integers(0, min(SYNTHETIC_INT_HIGH, high or SYNTHETIC_INT_HIGH), size=shape).astype(dtype)
