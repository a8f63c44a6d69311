"""The public import name survives ONNX Runtime's sys.path changes, and every subpackage is installed."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_import_after_onnxruntime_quantization_in_a_fresh_interpreter(tmp_path):
    # onnxruntime.quantization appends onnxruntime/transformers (which holds optimizer.py) to sys.path.
    code = ("import onnxruntime.quantization, sys\n"
            "from accel_opt import build, load_recipe\n"
            "import accel_opt.pipeline\n"
            "assert callable(build) and callable(load_recipe)\n"
            "assert accel_opt.pipeline.__file__.startswith(sys.argv[1]), accel_opt.pipeline.__file__\n")
    done = subprocess.run([sys.executable, "-c", code, str(ROOT / "optimizer")], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_subpackage_is_listed_for_installation():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"accel_opt" + "".join(f".{part}" for part in p.parent.relative_to(ROOT / "optimizer").parts)
             for p in (ROOT / "optimizer").rglob("__init__.py")}
    assert found == listed
