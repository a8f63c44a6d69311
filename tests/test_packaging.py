"""The public import name survives ONNX Runtime's sys.path changes, and every folder of the package is installed."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_after_onnxruntime_quantization_in_a_fresh_interpreter(tmp_path):
    # onnxruntime.quantization appends onnxruntime/transformers (which holds optimizer.py) to sys.path.
    code = ("import onnxruntime.quantization, sys\n"
            "from accel_opt import build, load_recipe\n"
            "import accel_opt.builder.pipeline\n"
            "assert callable(build) and callable(load_recipe)\n"
            "assert accel_opt.builder.pipeline.__file__.startswith(sys.argv[1]), accel_opt.builder.pipeline.__file__\n")
    done = subprocess.run([sys.executable, "-c", code, str(ROOT / "optimizer" / "accel_opt")], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_folder_of_the_package_is_found_for_installation():
    """optimizer/ is the source root: setuptools' discovery must find every folder holding modules as a package
    (a folder without __init__.py would be left out of a wheel), and nothing outside accel_opt."""
    from setuptools import find_packages

    source_root = ROOT / "optimizer"
    found = set(find_packages(str(source_root), include=["accel_opt*"]))
    folders = {".".join(p.parent.relative_to(source_root).parts) for p in (source_root / "accel_opt").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert folders == found
    assert [p for p in source_root.rglob("*.py") if "accel_opt" not in p.relative_to(source_root).parts[:1]] == []
