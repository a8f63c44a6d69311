"""`accel-opt build FILE.py:FACTORY` and `accel-opt export`: the PyTorch module is the reference."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from accel_opt.builder.pipeline import build
from accel_opt.cli import main

pytest.importorskip("torch")
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
CNN = f"{EXAMPLES / 'tiny_models.py'}:cnn"


def test_build_from_factory_uses_pytorch_as_reference_and_baseline(fast_recipe, tmp_path):
    result = build(CNN, fast_recipe.with_overrides(shapes={"x": [1, 3, 32, 32]}), out_dir=tmp_path)
    assert result.signed_off, result.failures
    assert result.stages[0].name == "export" and result.stages[0].status == "passed"
    assert all(h.speedup_vs_pytorch is not None for h in result.headline)
    folder = tmp_path / Path(result.artifact_dir).name
    assert folder.name.startswith("cnn-fp32-onnxruntime-")
    assert json.loads((folder / "accuracy.json").read_text())["reference"] == "reference-pytorch"
    labels = [m["label"] for m in json.loads((folder / "benchmark.json").read_text())["models"]]
    assert labels == ["onnxruntime-fp32", "pytorch-eager"]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["input_model"]["factory"] == CNN and len(manifest["input_model"]["source_sha256"]) == 64


def test_factory_build_needs_shapes(fast_recipe, tmp_path):
    result = CliRunner().invoke(main, ["build", CNN, "--out", str(tmp_path)])
    assert result.exit_code == 2 and "needs --shapes" in result.stderr


def test_export_command_writes_a_verified_model(tmp_path):
    out = tmp_path / "cnn.onnx"
    result = CliRunner().invoke(main, ["export", CNN, "--shapes", "x:2x3x32x32", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["verification"]["failures"] == [] and out.is_file()
    assert payload["export"]["inputs"][0]["shape"][0] == "batch"


@pytest.mark.parametrize(
    "spec, code, message",
    [
        (f"{EXAMPLES / 'tiny_models.py'}:no_such_factory", 2, "no_such_factory"),
        (f"{EXAMPLES / 'missing.py'}:cnn", 2, "missing.py"),
    ],
)
def test_export_bad_factory(spec, code, message, tmp_path):
    result = CliRunner().invoke(main, ["export", spec, "--shapes", "x:1x3x32x32", "-o", str(tmp_path / "m.onnx")])
    assert result.exit_code == code and message in result.stderr


def test_export_help_warns_about_running_code():
    result = CliRunner().invoke(main, ["export", "--help"])
    assert "runs its Python file" in result.stdout
