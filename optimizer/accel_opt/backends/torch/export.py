"""PyTorch -> ONNX: load a user's model factory and export it (accuracy/export_check.py verifies the export).

torch is an optional extra: it is imported inside these functions only, and its absence is an
`Unsupported` error naming the install command. Export tries the torch.export-based exporter
(`dynamo=True`) first and falls back to the TorchScript exporter, recording why. The traps of
torch 2.13's exporter are handled here: output names that collide with internal value names
(an invalid model), requested opsets below 18 silently raised (the actual opset is recorded),
and weights written to a `.data` side file (one self-contained file is written below 2 GB).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx
from pydantic import BaseModel

from accel_opt.backends.torch.runner import flatten_outputs, require_torch
from accel_opt.data import synthetic_samples
from accel_opt.errors import InputRejected, Unsupported, UsageError, first_line
from accel_opt.graph.inspect import TensorSpec, io_specs, opset_of
from accel_opt.graph.save import EXTERNAL_DATA_ABOVE_BYTES

log = logging.getLogger(__name__)

DYNAMO_MIN_OPSET = 18
_CHATTY_LOGGERS = ("torch.onnx", "torch.export", "torch._export", "torch._dynamo", "torch.fx", "onnxscript", "onnx_ir")


class ExportReport(BaseModel):
    path: str
    external_data: list[str]  # side files the model needs beside it; empty when self-contained
    size_bytes: int  # model plus side files
    exporter: Literal["dynamo", "torchscript"]
    dynamo_failure: str | None  # why torch.export-based export was not used
    opset_requested: int | None
    opset: int  # what the file actually declares
    example_shapes: dict[str, list[int]]
    dynamic_axes: dict[str, dict[int, str]]  # requested: input -> axis -> name
    inputs: list[TensorSpec]  # as written in the model (dynamic dims by name)
    outputs: list[TensorSpec]
    torch_version: str
    export_seconds: float
    notes: list[str]


def export(
    module: Any,
    shapes: dict[str, list[int]],
    out_path: Path,
    dynamic: dict[str, list[int] | dict[int, str]] | None = None,
    opset: int | None = None,
    input_dtypes: dict[str, str] | None = None,
    output_names: Sequence[str] | None = None,
    seed: int = 0,
    label: str | None = None,
) -> ExportReport:
    """Export `module` to one ONNX file at `out_path`; inputs are forward's positional args, in `shapes` order.

    Every input's leading (batch) axis is dynamic, plus the axes named in `dynamic`
    (`{"input_ids": [1]}` or `{"input_ids": {1: "sequence"}}`). Inputs are float32 unless
    `input_dtypes` says otherwise (`{"input_ids": "int64"}`). `label` names the model in a refusal (a Hugging Face
    folder's architecture).
    """
    torch = require_torch()
    start = time.perf_counter()
    out_path = Path(out_path)
    specs = _input_specs(shapes, input_dtypes)
    axes = _dynamic_axes(shapes, dynamic)
    if opset is not None and not 7 <= opset <= onnx.defs.onnx_opset_version():
        raise UsageError(f"opset {opset} is outside 7..{onnx.defs.onnx_opset_version()} (onnx {onnx.__version__})")
    module.eval()
    feed = synthetic_samples(specs, shapes, 1, seed)[0][0]
    args = tuple(torch.from_numpy(feed[name]) for name in shapes)
    names = _output_names(module, args, shapes, output_names)
    notes: list[str] = []

    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out_path.name}.", dir=out_path.parent) as tmp:
        staged = Path(tmp) / out_path.name
        exporter: Literal["dynamo", "torchscript"] = "dynamo"
        try:
            _export_dynamo(module, args, list(shapes), names, axes, opset, staged, notes)
            _check(staged, exporter)  # an invalid dynamo export falls back too
            dynamo_failure = None
        except Exception as exc:
            dynamo_failure = _reason(exc)
            log.info("dynamo export failed, falling back to TorchScript: %s", dynamo_failure)
            notes.clear()  # they described the discarded dynamo graph
            for leftover in Path(tmp).iterdir():
                leftover.unlink()
            exporter = "torchscript"
            try:
                _export_torchscript(module, args, list(shapes), names, axes, opset, staged, notes)
            except Exception as exc2:
                raise Unsupported(
                    f"could not export {label or 'the module'} to ONNX: dynamo: {dynamo_failure}; torchscript: "
                    f"{_reason(exc2)}"
                ) from exc2
            _check(staged, exporter)
        side_files = _single_file_if_small(staged)
        for path in sorted(Path(tmp).iterdir(), key=lambda p: p == staged):  # the model last
            path.replace(out_path.parent / path.name)
    stale = out_path.with_name(out_path.name + ".data")
    if not side_files and stale.exists():
        stale.unlink()

    proto = onnx.load(str(out_path), load_external_data=False)
    inputs, outputs = io_specs(proto)
    actual_opset = opset_of(proto)
    if opset is not None and actual_opset != opset:
        notes.append(
            f"opset {opset} was requested but the model uses opset {actual_opset}"
            + (f": torch's exporter emits opset >= {DYNAMO_MIN_OPSET} and could not convert down"
               if opset < DYNAMO_MIN_OPSET else "")
        )
    for spec in inputs:
        for axis, name in axes.get(spec.name, {}).items():
            if isinstance(spec.shape[axis], int):
                notes.append(f"input {spec.name}: axis {axis} ({name}) was requested dynamic but the model fixes it to "
                             f"{spec.shape[axis]}")
    files = [out_path.parent / name for name in side_files]
    return ExportReport(
        path=str(out_path),
        external_data=[str(p) for p in files],
        size_bytes=out_path.stat().st_size + sum(p.stat().st_size for p in files),
        exporter=exporter,
        dynamo_failure=dynamo_failure,
        opset_requested=opset,
        opset=actual_opset,
        example_shapes={k: list(v) for k, v in shapes.items()},
        dynamic_axes=axes,
        inputs=inputs,
        outputs=outputs,
        torch_version=torch.__version__,
        export_seconds=time.perf_counter() - start,
        notes=notes,
    )


def _input_specs(shapes: dict[str, list[int]], input_dtypes: dict[str, str] | None) -> list[TensorSpec]:
    if not shapes:
        raise UsageError("export needs --shapes: one NAME:DIMxDIM... per positional input of forward()")
    dtypes = dict(input_dtypes or {})
    unknown = sorted(set(dtypes) - set(shapes))
    if unknown:
        raise UsageError(f"input dtypes given for unknown inputs {unknown}; inputs are {list(shapes)}")
    specs = []
    for name, shape in shapes.items():
        try:
            dtype = np.dtype(dtypes.get(name, "float32"))
        except TypeError:
            raise UsageError(f"input {name}: unknown dtype {dtypes[name]!r}") from None
        specs.append(TensorSpec(name=name, dtype=dtype.name, shape=list(shape)))
    return specs


def _dynamic_axes(shapes: dict[str, list[int]], dynamic: dict | None) -> dict[str, dict[int, str]]:
    """input -> axis -> name: axis 0 ("batch") of every input, plus the requested ones."""
    axes = {name: {0: "batch"} for name, shape in shapes.items() if shape}
    for name, requested in (dynamic or {}).items():
        if name not in shapes:
            raise UsageError(f"dynamic axes given for unknown input {name!r}; inputs are {list(shapes)}")
        named = requested if isinstance(requested, dict) else {a: f"{name}_dim{a}" for a in requested}
        for axis, axis_name in named.items():
            if not -len(shapes[name]) <= axis < len(shapes[name]):
                raise UsageError(f"input {name}: dynamic axis {axis} is out of range for rank {len(shapes[name])}")
            axes[name][axis % len(shapes[name])] = axis_name
    return axes


def _output_names(module: Any, args: tuple, shapes: dict[str, list[int]], given: Sequence[str] | None) -> list[str]:
    """Run the module once eagerly: inputs that do not fit it are a usage error, caught before exporting."""
    import torch

    try:
        with torch.no_grad():
            result = module(*args)
    except Exception as exc:
        if integers := _takes_integers(module, args, shapes):
            wanted = ",".join(f"{name}:int64" for name in integers)
            raise UsageError(
                f"input(s) {', '.join(integers)} take integers (token ids, indices), not float32: give their dtypes "
                f"(--input-dtypes {wanted}, or the factory's input_dtypes attribute) ({type(exc).__name__}: "
                f"{first_line(exc)})") from exc
        shown = ", ".join(f"{k}:{'x'.join(map(str, v))}" for k, v in shapes.items())
        raise UsageError(
            f"the model does not accept inputs of shapes {shown} (check --shapes): {type(exc).__name__}: "
            f"{first_line(exc)}"
        ) from exc
    count = len(flatten_outputs(result))
    if count == 0:
        raise InputRejected("the model's forward() returned no tensors")
    if given is None:
        return _structure_names(result, count)
    if len(given) != count or len(set(given)) != count:
        raise UsageError(f"{len(given)} output names given for {count} outputs, or names repeated: {list(given)}")
    return list(given)


def _takes_integers(module: Any, args: tuple, shapes: dict[str, list[int]]) -> list[str]:
    """The float inputs that, given as int64 zeros instead, let forward() run: those are token ids or indices whose
    dtype was not said. [] when that does not help either (the problem is something else)."""
    import torch

    floats = [i for i, arg in enumerate(args) if arg.is_floating_point()]
    if not floats:
        return []
    try:
        with torch.no_grad():
            module(*(torch.zeros_like(arg, dtype=torch.int64) if i in floats else arg for i, arg in enumerate(args)))
    except Exception:  # noqa: BLE001 - not a dtype problem
        return []
    names = list(shapes)
    return [names[i] for i in floats]


def _structure_names(result: Any, count: int) -> list[str]:
    """Output names the forward() result itself gives: a dict's keys and a named structure's fields ("logits";
    nested: "boxes.0"), else output_<i>. In the order torch.export flattens the result."""
    import torch
    from torch.utils._pytree import GetAttrKey, MappingKey, SequenceKey, tree_flatten_with_path

    positional = [f"output_{i}" for i in range(count)]
    try:
        leaves = [path for path, leaf in tree_flatten_with_path(result)[0] if isinstance(leaf, torch.Tensor)]
    except ValueError:  # a container registered without key paths
        return positional
    names = []
    for index, path in enumerate(leaves):
        parts = [str(k.key) if isinstance(k, MappingKey) else k.name if isinstance(k, GetAttrKey)
                 else str(k.idx) if isinstance(k, SequenceKey) else None for k in path]
        named = any(isinstance(k, MappingKey | GetAttrKey) for k in path) and None not in parts
        names.append(".".join(parts) if named else positional[index])
    return names if len(set(names)) == len(names) else positional


def _export_dynamo(module, args, input_names, output_names, axes, opset, path: Path, notes: list[str]) -> None:
    import torch
    from torch.export import Dim

    dynamic_shapes = tuple({a: Dim.DYNAMIC for a in axes.get(name, {})} or None for name in input_names)
    with _quiet(notes):
        program = torch.onnx.export(
            module, args, None, dynamo=True, dynamic_shapes=dynamic_shapes, opset_version=opset, verbose=False
        )
    graph = program.model.graph
    if len(graph.inputs) != len(input_names) or len(graph.outputs) != len(output_names):
        raise RuntimeError(
            f"exported graph has {len(graph.inputs)} inputs / {len(graph.outputs)} outputs, "
            f"expected {len(input_names)} / {len(output_names)}"
        )
    _rename_dims(graph, input_names, axes)
    _rename_values(graph, list(graph.inputs), input_names, notes)
    _rename_values(graph, list(graph.outputs), output_names, notes, outputs=True)
    big = sum(v.const_value.nbytes for v in graph.initializers.values() if v.const_value is not None)
    program.save(path, external_data=big > EXTERNAL_DATA_ABOVE_BYTES)


def _rename_dims(graph, input_names: list[str], axes: dict[str, dict[int, str]]) -> None:
    """torch names dynamic dims s0, s77...: rename them to the requested axis names everywhere."""
    import onnx_ir as ir

    mapping: dict[str, str] = {}
    for value, name in zip(graph.inputs, input_names, strict=True):
        for axis, axis_name in axes.get(name, {}).items():
            dim = value.shape[axis] if value.shape is not None else None
            if isinstance(dim, ir.SymbolicDim) and dim.value and dim.value.isidentifier():
                mapping.setdefault(dim.value, axis_name)
    if not mapping:
        return
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, mapping)) + r")\b")
    values = list(graph.inputs) + list(graph.outputs)
    values += [out for node in ir.traversal.RecursiveGraphIterator(graph) for out in node.outputs]
    for value in values:
        if value.shape is None:
            continue
        dims = [
            ir.SymbolicDim(pattern.sub(lambda m: mapping[m.group(1)], d.value))
            if isinstance(d, ir.SymbolicDim) and d.value else d
            for d in value.shape
        ]
        value.shape = ir.Shape(dims)


def _rename_values(graph, values: list, names: list[str], notes: list[str], outputs: bool = False) -> None:
    """Give graph inputs/outputs their names, first renaming any internal value that already uses one.

    torch's exporter renames outputs without this check: an output called `embedding` in a model
    with an `embedding` layer duplicates a value name and the model is invalid (seen with torch 2.13).
    """
    import onnx_ir as ir

    taken = {v.name: v for v in list(graph.inputs) + list(graph.initializers.values())}
    taken.update({v.name: v for node in ir.traversal.RecursiveGraphIterator(graph) for v in node.outputs})
    for index, (value, name) in enumerate(zip(values, names, strict=True)):
        if value.name == name:
            continue
        if outputs and (value.is_graph_input() or value.is_initializer() or values.index(value) < index):
            node = ir.node("Identity", [value], name=f"identity_{name}")  # an output needs its own value
            graph.append(node)
            copy = node.outputs[0]
            copy.shape, copy.type = value.shape, value.type
            graph.outputs[index] = value = copy
        clash = taken.get(name)
        if clash is not None and clash is not value:
            new, k = f"{name}_internal", 1
            while new in taken:
                new, k = f"{name}_internal{k}", k + 1
            clash.name = new
            taken[new] = clash
            log.debug("renamed internal value %r to %r to free the name for a graph input/output", name, new)
            if outputs:
                notes.append(f"output name {name!r} is also an internal value's name; that value was renamed {new!r}")
        taken.pop(value.name, None)
        value.name = name
        taken[name] = value


def _export_torchscript(module, args, input_names, output_names, axes, opset, path: Path, notes: list[str]) -> None:
    import torch

    with _quiet(notes):
        torch.onnx.export(
            module, args, str(path), dynamo=False, input_names=input_names, output_names=output_names,
            dynamic_axes={name: dict(a) for name, a in axes.items()}, opset_version=opset or DYNAMO_MIN_OPSET,
        )
    notes.append("exported with the TorchScript (tracing) exporter: data-dependent Python control flow is frozen to "
                 "the example's path")


@contextlib.contextmanager
def _quiet(notes: list[str]):
    """Keep the exporter's prints and log chatter out of our output; keep its tracer warnings as notes."""
    loggers = [logging.getLogger(name) for name in _CHATTY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    captured = io.StringIO()
    try:
        with (warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(captured),
              contextlib.redirect_stderr(captured)):
            warnings.simplefilter("always")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        log.debug("exporter output:\n%s", captured.getvalue())
    for w in caught:
        if w.category.__name__ == "TracerWarning":
            note = f"TracerWarning: {first_line(w.message)}"
            if note not in notes:
                notes.append(note)


def _reason(exc: BaseException) -> str:
    root = exc
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    if root is exc:
        return f"{type(exc).__name__}: {first_line(exc)}"
    return f"{type(exc).__name__} caused by {type(root).__name__}: {first_line(root)}"


def _single_file_if_small(model: Path) -> list[str]:
    """Fold side files (external data) back into the model when it fits one file; return those still needed."""
    side = [f for f in model.parent.iterdir() if f != model]  # the staging folder holds only this export
    if not side or sum(f.stat().st_size for f in side) > EXTERNAL_DATA_ABOVE_BYTES:
        return sorted(f.name for f in side)
    onnx.save(onnx.load(str(model)), str(model))
    for f in side:
        f.unlink()
    return []


def _check(path: Path, exporter: str) -> None:
    try:
        onnx.checker.check_model(str(path))  # by path: works for models with external data
    except Exception as exc:
        message = first_line(exc)
        if "single static assignment" in message:
            raise InputRejected(
                f"the {exporter} exporter wrote an invalid model: a value name is defined twice ({message}); "
                "pick output names that differ from the model's layer names"
            ) from None
        raise InputRejected(f"the {exporter} exporter wrote an invalid model: {message}") from None
