"""Pure parts of a TensorRT build: optimization profiles from shapes, and the equivalent trtexec line.

Nothing here imports TensorRT, so all of it is tested on machines without a GPU.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from accel_opt.errors import UsageError
from accel_opt.graph.inspect import TensorSpec, batch_axes


@dataclass(frozen=True)
class ShapeRange:
    min: list[int]
    opt: list[int]
    max: list[int]


def _fmt(dims: list[int]) -> str:
    return "x".join(map(str, dims))


def derive_profiles(
    inputs: list[TensorSpec],
    shapes: dict[str, list[int]],
    min_shapes: dict[str, list[int]] | None = None,
    opt_shapes: dict[str, list[int]] | None = None,
    max_shapes: dict[str, list[int]] | None = None,
) -> dict[str, ShapeRange]:
    """The optimization profile (min/opt/max per input with a dynamic dim) for one TensorRT build.

    `shapes`: the deployment's shapes (what is checked and timed); they are the opt shapes unless
    `opt_shapes` names others. min and max default to opt. Static inputs are validated and left out:
    TensorRT takes profile shapes only for inputs with dynamic dimensions. A usage error (exit 2)
    names the input and dimension for: an unknown input, a missing shape, a wrong rank, a dimension
    the model fixes given otherwise, a dimension below 1, or min > opt > max.
    """
    min_shapes, opt_shapes, max_shapes = min_shapes or {}, opt_shapes or {}, max_shapes or {}
    names = [spec.name for spec in inputs]
    for flag, given in (("--shapes", shapes), ("min shapes", min_shapes), ("opt shapes", opt_shapes),
                        ("max shapes", max_shapes)):
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise UsageError(f"{flag} name unknown input {unknown[0]!r}; model inputs: {', '.join(names)}")
    profile: dict[str, ShapeRange] = {}
    for spec in inputs:
        opt = opt_shapes.get(spec.name) or shapes.get(spec.name)
        if opt is None:
            if spec.dynamic_axes:
                raise UsageError(f"input {spec.name!r} has dynamic dims {spec.dynamic_axes} and no shape: give "
                                 "--shapes "
                                 f"{spec.name}:{'x'.join(str(d) if isinstance(d, int) else '?' for d in spec.shape)}")
            opt = [int(d) for d in spec.shape]  # type: ignore[arg-type]  # all fixed ints here
        low, high = min_shapes.get(spec.name, opt), max_shapes.get(spec.name, opt)
        for which, dims in (("opt", opt), ("min", low), ("max", high)):
            if len(dims) != len(spec.shape):
                raise UsageError(f"{which} shape of {spec.name}: rank {len(dims)} ({_fmt(dims)}), the model's input "
                                 "has "
                                 f"rank {len(spec.shape)}")
            for axis, (dim, model_dim) in enumerate(zip(dims, spec.shape)):
                if dim < 1:
                    raise UsageError(f"{which} shape of {spec.name}: dim {axis} is {dim}, must be >= 1")
                if isinstance(model_dim, int) and model_dim > 0 and dim != model_dim:
                    raise UsageError(f"{which} shape of {spec.name}: dim {axis} is fixed at {model_dim} in the model, "
                                     f"got {dim}")
        for axis, (a, b, c) in enumerate(zip(low, opt, high)):
            if not a <= b <= c:
                raise UsageError(f"profile of {spec.name}: dim {axis} needs min <= opt <= max, got {a}, {b}, {c} "
                                 f"(min {_fmt(low)}, opt {_fmt(opt)}, max {_fmt(high)})")
        if spec.dynamic_axes:
            profile[spec.name] = ShapeRange(list(low), list(opt), list(high))
    return profile


def profile_bounds(
    inputs: list[TensorSpec],
    shapes: dict[str, list[int]],
    batch_sizes: list[int],
    max_shapes: dict[str, list[int]] | None = None,
    given_batch_axes: dict[str, int | None] | None = None,
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """(min, max) shapes for a deployment at `shapes`: a dynamic batch axis spans 1 .. the largest of
    `batch_sizes` (the benchmark sweeps them) and the deployed batch; `max_shapes` (--max-shapes, the
    capacity point) raises the max. Other dynamic dims stay at the deployed size unless `max_shapes`
    names a larger one: a smaller spatial size may be invalid for the model (a 7x7 convolution on 1x1)."""
    axes = batch_axes(inputs, given_batch_axes)
    low: dict[str, list[int]] = {}
    high: dict[str, list[int]] = {}
    for spec in inputs:
        if spec.name not in shapes or not spec.dynamic_axes:
            continue
        axis = axes.get(spec.name)
        low[spec.name], high[spec.name] = list(shapes[spec.name]), list(shapes[spec.name])
        if axis is not None and axis in spec.dynamic_axes:
            low[spec.name][axis] = 1
            high[spec.name][axis] = max([shapes[spec.name][axis], *batch_sizes])
        if max_shapes and spec.name in max_shapes:
            high[spec.name] = [max(a, b) for a, b in zip(high[spec.name], max_shapes[spec.name])]
    return low, high


def _shape_arg(profile: dict[str, ShapeRange], which: str) -> str:
    return ",".join(f"{name}:{_fmt(getattr(r, which))}" for name, r in profile.items())


def trtexec_command(
    onnx_file: str,
    engine_file: str,
    profile: dict[str, ShapeRange],
    workspace_mib: int,
    optimization_level: int,
    timing_cache_file: str,
    tensorrt_major: int,
) -> str:
    """The trtexec line that builds what compile() builds and times GPU compute the same way on 10.x and 11.x.

    Both: no precision flag (the ONNX graph carries the precision), --noTF32 (fp32 stays fp32),
    --memPoolSize=workspace:<MiB>M, --builderOptimizationLevel, --timingCacheFile, detailed profiling
    verbosity, --min/opt/maxShapes for dynamic inputs. 10.x: --stronglyTyped, plus --useCudaGraph,
    --useSpinWait and --noDataTransfers, which are 11.x's defaults. 11.x: every network is strongly
    typed and those three are deprecated no-ops (trtexec's sampleOptions.cpp in NVIDIA/TensorRT
    release/11.1: "Data transfers are now disabled by default", "--includeDataTransfers" re-enables them).
    Checked against the release/10.16 and release/11.1 trtexec sources, not against 11.4's binary.
    """
    args = ["trtexec", f"--onnx={onnx_file}", f"--saveEngine={engine_file}"]
    if tensorrt_major < 11:
        args.append("--stronglyTyped")
    if profile:
        args += [f"--minShapes={_shape_arg(profile, 'min')}", f"--optShapes={_shape_arg(profile, 'opt')}",
                 f"--maxShapes={_shape_arg(profile, 'max')}", f"--shapes={_shape_arg(profile, 'opt')}"]
    args += ["--noTF32", f"--memPoolSize=workspace:{workspace_mib}M",
             f"--builderOptimizationLevel={optimization_level}",
             f"--timingCacheFile={timing_cache_file}", "--profilingVerbosity=detailed"]
    if tensorrt_major < 11:
        args += ["--useCudaGraph", "--useSpinWait", "--noDataTransfers"]
    return shlex.join(args)
