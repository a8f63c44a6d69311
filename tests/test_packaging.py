"""The public import name survives ONNX Runtime's sys.path changes, and every folder of the package is installed."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_import_after_onnxruntime_quantization_in_a_fresh_interpreter(tmp_path):
    # onnxruntime.quantization appends onnxruntime/transformers (which holds optimizer.py) to sys.path.
    code = ("import onnxruntime.quantization, sys\n"
            "from accel_opt import build, load_recipe\n"
            "import accel_opt.builder.pipeline\n"
            "assert callable(build) and callable(load_recipe)\n"
            "assert accel_opt.builder.pipeline.__file__.startswith(sys.argv[1]), accel_opt.builder.pipeline.__file__\n")
    done = subprocess.run([sys.executable, "-c", code, str(ROOT / "optimizer" / "accel_opt")], cwd=tmp_path,
                          capture_output=True, text=True)
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


@pytest.mark.slow
def test_the_wheel_carries_the_recipes_and_a_core_install_builds_a_model(tmp_path):
    """What a user installs from the repository: the wheel (pip wheel .), into a fresh venv with the core dependencies
    only (ONNX Runtime; no torch, OpenVINO or Ray), runs `accel-opt build` on a small model with every bundled recipe
    there, and the install line it prints for a missing extra names the wheel it came from."""
    from accel_opt import zoo

    wheels, venv = tmp_path / "wheels", tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(ROOT)], check=True, timeout=300)
    (wheel,) = wheels.glob("accel_opt-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packed = {Path(name).stem for name in archive.namelist() if name.startswith("accel_opt/recipes/")}
    assert packed == {p.stem for p in (ROOT / "recipes").glob("*.yaml")}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)], check=True,
                   timeout=600)
    model = zoo.save(zoo.resnet(layout=(1, 1), width=8, num_classes=10, image_size=32, seed=0), tmp_path / "tiny.onnx")
    cli = str(venv / "bin" / "accel-opt")
    done = subprocess.run([cli, "build", str(model), "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0 and "SIGNED OFF" in done.stdout, done.stderr
    done = subprocess.run([cli, "build", str(model), "--recipe", "text-classifier", "--backend", "openvino",
                           "--precision", "fp32", "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 4 and f"pip install '{wheel}[openvino]'" in done.stderr, done.stderr
