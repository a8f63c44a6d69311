"""The runtime loads what was built, refuses what was changed, and the gate checks what ships."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from accel_opt import runtime
from accel_opt.artifact.folder import MANIFEST, file_hashes
from accel_opt.builder.pipeline import build
from accel_opt.errors import InputRejected, Unsupported
from accel_opt.machine.cpu import CpuProfile

from ..conftest import image_npz_folder

needs_openvino = pytest.mark.skipif(importlib.util.find_spec("openvino") is None, reason="openvino is not installed")


@pytest.fixture(scope="module")
def published(tiny_cnn_path, tmp_path_factory):
    from accel_opt.recipe.load import load_recipe

    from ..conftest import FAST_BENCH

    recipe = load_recipe().with_overrides(benchmark=FAST_BENCH, **{"accuracy.synthetic_samples": 4})
    result = build(tiny_cnn_path, recipe, out_dir=tmp_path_factory.mktemp("out"))
    return Path(result.artifact_dir)


def _copy(folder: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(folder, tmp_path / folder.name))


def test_load_runs_the_artifact_as_deployed(published):
    deployment = runtime.load(published)
    assert deployment.batch_size == 8 and deployment.batch_axes == {"image": 0}
    feed = {"image": np.zeros((8, 3, 32, 32), np.float32)}
    with deployment.runner() as runner:
        assert runner.infer(feed)["logits"].shape == (8, 10)


def test_incomplete_folder_is_refused(published, tmp_path):
    folder = _copy(published, tmp_path)
    (folder / MANIFEST).unlink()
    with pytest.raises(InputRejected, match="incomplete artifact: no manifest.json") as info:
        runtime.load(folder)
    assert info.value.exit_code == 3


@pytest.mark.parametrize("change, message", [
    (lambda f: (f / "model.onnx").write_bytes((f / "model.onnx").read_bytes()[:-1] + b"\0"),
     "model.onnx: sha256 does not match"),
    (lambda f: (f / "resource_config.json").unlink(), "resource_config.json: missing"),
    (lambda f: (f / "extra.bin").write_bytes(b"x"), "extra.bin: not part of the artifact"),
])
def test_changed_folder_is_refused_before_anything_runs(published, tmp_path, change, message):
    folder = _copy(published, tmp_path)
    change(folder)
    with pytest.raises(InputRejected, match=message):
        runtime.load(folder)


def test_other_runtime_version_is_refused(published, tmp_path):
    folder = _copy(published, tmp_path)
    config = json.loads((folder / "resource_config.json").read_text())
    config["settings"]["onnxruntime_version"] = "0.1.0"
    (folder / "resource_config.json").write_text(json.dumps(config))
    with pytest.raises(Unsupported, match="onnxruntime 0.1.0"):  # what was checked is not what would run
        runtime.load_staged(folder, file_hashes(folder), CpuProfile.of_class("avx2"))


@needs_openvino
def test_gate_evaluates_the_openvino_blob_at_its_deployed_batch(tiny_cnn_path, fast_recipe, tmp_path):
    data = image_npz_folder(tmp_path / "data", 12, seed=2)  # 2 steer, 10 held out: 3 calls of 4 rows, the last padded
    recipe = fast_recipe.with_overrides(backend="openvino", **{"selection.target_batch_size": 4})
    result = build(tiny_cnn_path, recipe, data_dir=data, out_dir=tmp_path / "out")
    assert result.signed_off, result.failures
    folder = Path(result.artifact_dir)
    evaluation = json.loads((folder / "accuracy.json").read_text())["evaluation"]
    assert evaluation["mode"] == "batched" and evaluation["batch_size"] == 4 and evaluation["calls"] == 3
    assert "model.openvino-fp32.blob" in evaluation["deployment"] and folder.name in evaluation["deployment"]
    config = json.loads((folder / "resource_config.json").read_text())
    assert config["settings"]["static_shapes"] == {"image": [4, 3, 32, 32]} and config["batch_size"] == 4
    assert "blob" in result.evaluated and "batch 4" in (folder / "signoff.md").read_text()
    deployment = runtime.load(folder)
    with deployment.runner() as runner:  # the blob itself serves the deployed shapes: nothing recompiled
        runner.infer({"image": np.zeros((4, 3, 32, 32), np.float32)})
        assert runner.compiled_shapes == []


def _verify(folder: Path):
    from click.testing import CliRunner

    from accel_opt.cli import main

    return CliRunner().invoke(main, ["verify", str(folder), "--json"])


def test_verify_passes_a_published_folder_and_names_every_problem(published, tmp_path):
    ok = _verify(published)
    assert ok.exit_code == 0 and json.loads(ok.stdout)["ok"] is True
    for name in sorted(p.name for p in published.iterdir() if p.name != MANIFEST):
        folder = _copy(published, tmp_path / name)
        data = bytearray((folder / name).read_bytes())
        data[len(data) // 2] ^= 1  # one changed bit, anywhere
        (folder / name).write_bytes(bytes(data))
        result = _verify(folder)
        assert result.exit_code == 3, name
        assert [p["line"] for p in json.loads(result.stdout)["problems"]] == [
            f"artifact altered or incomplete: {name}: sha256 does not match the manifest (changed after the build)"]
    folder = _copy(published, tmp_path / "no-manifest")
    (folder / MANIFEST).unlink()
    assert _verify(folder).exit_code == 3


def test_verify_refuses_another_runtime_version_as_exit_4(published, tmp_path):
    folder = _copy(published, tmp_path)
    config = json.loads((folder / "resource_config.json").read_text())
    config["settings"]["onnxruntime_version"] = "0.1.0"
    (folder / "resource_config.json").write_text(json.dumps(config))
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["artifacts"] = file_hashes(folder)  # a consistent folder, built elsewhere
    (folder / MANIFEST).write_text(json.dumps(manifest))
    result = _verify(folder)
    assert result.exit_code == 4 and "onnxruntime 0.1.0" in result.stdout
