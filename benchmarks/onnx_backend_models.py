"""ONNX's own backend test models, built at fp32 on ONNX Runtime: which build, and do they reproduce?

The onnx wheel ships ~140 small models with one recorded input/output set each
(`onnx/backend/test/data/{pytorch-converted,pytorch-operator,simple}/*/model.onnx`, `test_data_set_0/`).
Many are old (opset 1-9): a compiler that takes "any valid ONNX" should build them. Each model is built
with the recorded inputs as a one-sample .npz --data; a signed-off folder is then run through the
runtime (`accel_opt.runtime.load(folder).runner()`) and its outputs compared with the recorded ones
(rtol 1e-3, atol 1e-5).

  python -m benchmarks.onnx_backend_models [--only NAME,...] [--out FILE]

Prints one row per model: model, opset, exit code, reproduced (yes / no / - when not signed off), and
the first line of the reason for a non-zero exit.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from accel_opt import runtime
from accel_opt.builder.pipeline import build
from accel_opt.errors import AccelOptError, first_line
from accel_opt.graph.inspect import io_specs
from accel_opt.recipe.load import load_recipe
from accel_opt.recipe.schema import Recipe

SUITES = ("pytorch-converted", "pytorch-operator", "simple")
RTOL, ATOL = 1e-3, 1e-5
# The benchmark stage only has to run: these builds are about building and reproducing, not timing.
QUICK_BENCH = {"warmup_iterations": 1, "min_iterations": 3, "min_seconds": 0.0, "max_iterations": 10,
               "batch_sizes": [1],
               "concurrency": [1], "window_seconds": 0.01, "max_windows": 4}


def suite_root() -> Path:
    return Path(onnx.__file__).parent / "backend" / "test" / "data"


def backend_models() -> list[Path]:
    """Every backend test model folder (holding model.onnx and test_data_set_0/), sorted by suite and name."""
    return [folder for suite in SUITES for folder in sorted((suite_root() / suite).iterdir())
            if (folder / "model.onnx").is_file() and (folder / "test_data_set_0").is_dir()]


def _tensor(path: Path) -> onnx.TensorProto:
    return onnx.TensorProto.FromString(path.read_bytes())


def _ordered(folder: Path, prefix: str) -> list[Path]:
    return sorted((folder / "test_data_set_0").glob(f"{prefix}_*.pb"), key=lambda p: int(p.stem.split("_")[1]))


def recorded_io(folder: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The recorded inputs and expected outputs by tensor name (graph order where a .pb has no name).
    Raises ValueError for a non-tensor .pb (the sequence models' inputs are SequenceProtos)."""
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    inputs, outputs = io_specs(model)

    def read(files: list[Path], specs) -> dict[str, np.ndarray]:
        arrays = {}
        for index, path in enumerate(files):
            tensor = _tensor(path)
            if not tensor.dims and not tensor.raw_data and tensor.data_type == 0:
                raise ValueError(f"{path.name} is not a TensorProto")
            arrays[tensor.name or specs[index].name] = numpy_helper.to_array(tensor)
        return arrays

    return read(_ordered(folder, "input"), inputs), read(_ordered(folder, "output"), outputs)


def opset_of(folder: Path) -> int:
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def quick_recipe() -> Recipe:
    return load_recipe().with_overrides(benchmark=QUICK_BENCH, precision="fp32", backend="onnxruntime")


@dataclass
class Row:
    model: str
    opset: int
    exit_code: int
    reproduced: str  # "yes", "no" or "-" (not signed off)
    reason: str = ""


def reproduces(artifact: Path, inputs: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> str:
    """'' when the deployed folder's outputs match `expected` within RTOL/ATOL, else the first mismatch."""
    with runtime.load(artifact, allow_not_signed_off=True).runner() as runner:
        got = runner.infer(inputs)
    for name, want in expected.items():
        have = np.asarray(got[name])
        if have.shape != want.shape:
            return f"{name}: shape {list(have.shape)}, expected {list(want.shape)}"
        if not np.allclose(have.astype(np.float64), want.astype(np.float64), rtol=RTOL, atol=ATOL, equal_nan=True):
            return f"{name}: max abs diff {np.max(np.abs(have.astype(np.float64) - want)):.3g}"
    return ""


def build_one(folder: Path, workdir: Path, recipe: Recipe | None = None) -> Row:
    """Build `folder`'s model on its recorded inputs; check a signed-off folder reproduces the outputs."""
    name = f"{folder.parent.name}/{folder.name}"
    opset = opset_of(folder)
    try:
        inputs, expected = recorded_io(folder)
    except (ValueError, onnx.onnx_cpp2py_export.checker.ValidationError) as exc:  # not tensors: cannot be --data
        return Row(name, opset, -1, "-", f"recorded data are not tensors ({first_line(exc)})")
    data = workdir / "data"
    data.mkdir(parents=True)
    np.savez(data / "sample.npz", **inputs)
    try:
        result = build(folder / "model.onnx", recipe or quick_recipe(), data_dir=data, out_dir=workdir / "out")
    except AccelOptError as exc:
        return Row(name, opset, exc.exit_code, "-", first_line(exc, limit=220))
    except Exception as exc:  # a bug: what the CLI reports as exit 70
        return Row(name, opset, 70, "-", f"{type(exc).__name__}: {first_line(exc, limit=120)}")
    if not result.signed_off:
        return Row(name, opset, result.exit_code, "-", first_line("; ".join(result.failures), limit=140))
    mismatch = reproduces(Path(result.artifact_dir), inputs, expected)
    return Row(name, opset, result.exit_code, "no" if mismatch else "yes", mismatch)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model folder names (default: all)")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.CRITICAL
    folders = backend_models()
    if args.only:
        wanted = set(args.only.split(","))
        folders = [f for f in folders if f.name in wanted]
    rows = []
    for folder in folders:
        with tempfile.TemporaryDirectory(prefix="onnx-backend-") as tmp:
            rows.append(build_one(folder, Path(tmp)))
        print(f"{rows[-1].model}: exit {rows[-1].exit_code}", flush=True)
    lines = _table(rows)
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


def _table(rows: list[Row]) -> list[str]:
    header = ("model", "opset", "exit", "reproduced", "reason")
    cells = [header, *[(r.model, str(r.opset), "n/a" if r.exit_code < 0 else str(r.exit_code), r.reproduced, r.reason)
                       for r in rows]]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(4)) + "  " + c[4] for c in cells]
    counts: dict[str, int] = {}
    for r in rows:
        key = "n/a (data not tensors)" if r.exit_code < 0 else f"exit {r.exit_code}"
        counts[key] = counts.get(key, 0) + 1
    reproduced = sum(r.reproduced == "yes" for r in rows)
    lines += ["", f"{len(rows)} models: " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
              + f"; signed off and reproduced: {reproduced}; signed off, not reproduced: "
              + str(sum(r.reproduced == "no" for r in rows))]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
