"""Saving ONNX models: one self-contained file below protobuf's 2 GB cap, weights in `<name>.data` above it.

The single threshold every writer of the project uses (pipeline, cleanup, precision transforms, export).
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import external_data_helper

from accel_opt.errors import Unsupported, first_line

# Protobuf cannot serialize a message past 2 GiB; leave headroom for the graph itself.
EXTERNAL_DATA_ABOVE_BYTES = 1536 * 2**20


def external_files(model_path: Path) -> list[Path]:
    """The external data files the ONNX model at `model_path` refers to (beside it)."""
    skeleton = onnx.load(str(model_path), load_external_data=False)
    locations = {external_data_helper.ExternalDataInfo(t).location
                 for t in external_data_helper._get_all_tensors(skeleton) if external_data_helper.uses_external_data(t)}
    return [model_path.parent / loc for loc in sorted(locations)]


def tensor_bytes(model_path: Path) -> int:
    """The model file's bytes and its external data files'."""
    return model_path.stat().st_size + sum(p.stat().st_size for p in external_files(model_path))


def save_model(model: onnx.ModelProto, path: Path) -> None:
    """Save `model` (tensor data loaded) to `path`, with `<name>.data` beside it when the weights are large."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data_file = path.with_name(path.name + ".data")
    data_file.unlink(missing_ok=True)  # onnx appends to an existing data file
    size = sum(len(t.raw_data) for t in external_data_helper._get_all_tensors(model))
    if size > EXTERNAL_DATA_ABOVE_BYTES:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data_file.name, size_threshold=1024)
    else:
        onnx.save_model(model, str(path))


def upgrade_opset(source: Path, target: int, dest: Path, why: str) -> Path:
    """Convert `source` to opset `target` with onnx's version converter and save it to `dest`."""
    model = onnx.load(str(source))
    try:
        model = onnx.version_converter.convert_version(model, target)
    except Exception as exc:  # the converter raises assorted C++ errors
        raise Unsupported(f"{why} needs opset {target}; onnx's version converter failed: {first_line(exc)}") from None
    # Custom-domain imports (kept for the nodes that use them) have no IR version of ONNX's: ignore them.
    model.ir_version = max(model.ir_version,
                           onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True))
    save_model(model, dest)
    return dest
