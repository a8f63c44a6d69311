"""End-to-end builds on a real (tiny) ResNet-layout model with real ORT sessions and Polygraphy."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from accel_opt.artifact.folder import MANIFEST
from accel_opt.builder.pipeline import build
from accel_opt.errors import Unsupported, UsageError
from accel_opt.files import sha256_file
from accel_opt.report.html import render
from tests.conftest import image_npz_folder

EXPECTED_FILES = {"model.onnx", "resource_config.json", "accuracy.json", "signoff.md", "signoff.html", "benchmark.json",
                  "benchmark.md",
                  "build.json", "probe.json", "probe.npz", MANIFEST}


def test_fp32_build_signs_off_with_every_artifact(tiny_cnn_path, fast_recipe, tmp_path):
    result = build(tiny_cnn_path, fast_recipe, out_dir=tmp_path)
    assert result.signed_off and result.exit_code == 0
    folder = tmp_path / result.artifact_dir.split("/")[-1]
    assert folder.name.startswith("tiny_cnn-fp32-onnxruntime-")
    assert {p.name for p in folder.iterdir()} == EXPECTED_FILES
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["signed_off"] is True
    assert manifest["input_model"]["sha256"] == sha256_file(tiny_cnn_path)
    for name, digest in manifest["artifacts"].items():
        assert sha256_file(folder / name) == digest
    stages = {s["name"]: s["status"] for s in manifest["stages"]}
    assert list(stages) == ["export", "load", "cleanup", "precision", "compile", "accuracy", "benchmark",
                            "verdict", "reports"]
    assert stages["export"] == "skipped" and stages["precision"] == "skipped" and stages["accuracy"] == "passed"
    assert manifest["data"]["source"] == "synthetic"
    assert "avx" in " ".join(manifest["cpu"]["flags"]) or manifest["cpu"]["machine"] != "x86_64"

    config = json.loads((folder / "resource_config.json").read_text())
    assert config["providers"] == ["CPUExecutionProvider"]
    assert config["inputs"][0]["shape_used"] == [8, 3, 32, 32]  # the deployed batch: selection.target_batch_size
    assert config["batch_size"] == 8 and config["inputs"][0]["batch_axis"] == 0
    assert config["memory"]["peak_rss_mib"] > 0
    bench = json.loads((folder / "benchmark.json").read_text())
    assert [b["batch_size"] for b in bench["models"][0]["batches"]] == [1, 2]
    assert bench["models"][0]["batches"][0]["latency"]["iterations"] >= 5
    signoff = (folder / "signoff.md").read_text()
    assert "SIGNED OFF" in signoff and "Synthetic data was used" in signoff and "batch defaulted to 1" in signoff
    page = (folder / "signoff.html").read_text()
    assert render(folder) == page  # rendered from the JSON reports alone
    assert "SIGNED OFF" in page and "NOT SIGNED OFF" not in page and "Synthetic data was used" in page
    assert not re.search(r"(src|href)=[\"'](?!data:)|https?://|@import", page)  # self-contained: nothing fetched
    assert page.count("data:image/png;base64,") == 1
    accuracy = json.loads((folder / "accuracy.json").read_text())
    accuracy["outputs"][0]["gain"] = None  # an infinite gain (a zero reference) is null in the JSON
    (folder / "accuracy.json").write_text(json.dumps(accuracy))
    assert "not finite" in render(folder)
    assert not list(tmp_path.glob(".*staging*"))


def test_too_tight_tolerance_fails_the_gate_but_writes_reports(tiny_cnn_path, fast_recipe, tmp_path):
    tight = fast_recipe.with_overrides(**{"accuracy.tolerances": {"fp32": {"atol": 0, "rtol": 0, "min_cosine": 1.0}},
                                          "cleanup.enabled": False})
    # fp32 ORT_ENABLE_ALL fuses and reorders float math against the unoptimized reference: not bit-exact.
    result = build(tiny_cnn_path, tight, out_dir=tmp_path)
    assert not result.signed_off and result.exit_code == 1
    assert result.failures and "logits" in result.failures[0]
    folder = tmp_path / result.artifact_dir.split("/")[-1]
    assert "NOT SIGNED OFF" in (folder / "signoff.md").read_text()
    page = (folder / "signoff.html").read_text()
    assert "NOT SIGNED OFF" in page and "<h2>Failed checks</h2>" in page and "beyond atol=0/rtol=0" in page
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["signed_off"] is False and manifest["exit_code"] == 1
    assert next(s for s in manifest["stages"] if s["name"] == "accuracy")["status"] == "failed"


def test_real_data_is_used_and_named(tiny_cnn_path, fast_recipe, tmp_path):
    data = image_npz_folder(tmp_path / "data", 3, seed=1)
    result = build(tiny_cnn_path, fast_recipe, data_dir=data, out_dir=tmp_path / "out")
    folder = tmp_path / "out" / result.artifact_dir.split("/")[-1]
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["data"]["source"] == "npz" and manifest["data"]["count"] == 3
    assert "Synthetic" not in (folder / "signoff.md").read_text()


def test_interrupted_build_leaves_no_manifest(tiny_cnn_path, fast_recipe, tmp_path):
    def interrupt(stage):
        if stage.name == "benchmark":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build(tiny_cnn_path, fast_recipe, out_dir=tmp_path, on_stage=interrupt)
    assert not list(tmp_path.rglob(MANIFEST))
    assert not [p for p in tmp_path.iterdir() if p.name != ".cache"]


def test_identical_build_is_reused_and_force_rebuilds_it(tiny_cnn_path, fast_recipe, tmp_path):
    first = build(tiny_cnn_path, fast_recipe, out_dir=tmp_path)
    folder = Path(first.artifact_dir)
    stamp = (folder / MANIFEST).stat().st_mtime_ns
    second = build(tiny_cnn_path, fast_recipe, out_dir=tmp_path)
    assert second.reused and not first.reused and second.artifact_dir == first.artifact_dir
    assert second.headline == first.headline and second.signed_off and (folder / MANIFEST).stat().st_mtime_ns == stamp
    assert [s.name for s in second.stages][-1] == "reuse"
    forced = build(tiny_cnn_path, fast_recipe, out_dir=tmp_path, force=True)
    assert not forced.reused and forced.artifact_dir == first.artifact_dir
    assert (folder / MANIFEST).stat().st_mtime_ns != stamp
    assert len([p for p in tmp_path.iterdir() if not p.name.startswith(".")]) == 1


@pytest.mark.slow
def test_a_changed_input_or_a_folder_that_fails_verification_is_rebuilt(tiny_cnn_path, fast_recipe, tmp_path):
    first = build(tiny_cnn_path, fast_recipe, out_dir=tmp_path)
    other_recipe = build(tiny_cnn_path, fast_recipe.with_overrides(**{"accuracy.seed": 1}), out_dir=tmp_path)
    assert not other_recipe.reused and other_recipe.artifact_dir != first.artifact_dir
    data = image_npz_folder(tmp_path / "data", 3)
    other_data = build(tiny_cnn_path, fast_recipe, data_dir=data, out_dir=tmp_path)
    np.savez(data / "s00.npz", image=np.ones((1, 3, 32, 32), np.float32))  # one sample changed
    changed_data = build(tiny_cnn_path, fast_recipe, data_dir=data, out_dir=tmp_path)
    assert not other_data.reused and not changed_data.reused and changed_data.artifact_dir != other_data.artifact_dir
    (Path(first.artifact_dir) / "signoff.md").write_text("edited")
    again = build(tiny_cnn_path, fast_recipe, out_dir=tmp_path)
    assert not again.reused and again.artifact_dir == first.artifact_dir
    assert "edited" not in (Path(first.artifact_dir) / "signoff.md").read_text()


def test_bf16_on_ort_cpu_is_unsupported(tiny_cnn_path, fast_recipe, tmp_path):
    with pytest.raises(Unsupported, match="openvino") as info:
        build(tiny_cnn_path, fast_recipe.with_overrides(precision="bf16"), out_dir=tmp_path)
    assert info.value.exit_code == 4
    assert not list(tmp_path.iterdir())


def test_int8_without_data_is_a_usage_error(tiny_cnn_path, fast_recipe, tmp_path):
    with pytest.raises(UsageError, match="needs --data"):
        build(tiny_cnn_path, fast_recipe.with_overrides(precision="int8"), out_dir=tmp_path)


def _snippet(folder) -> str:
    """The Python block of a folder's signoff.md ("Run it")."""
    text = (folder / "signoff.md").read_text()
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_folders_own_snippet_loads_and_runs_it(classifier, monkeypatch):
    monkeypatch.chdir(classifier.parent)  # the snippet names the folder as a build leaves it under --out
    namespace: dict = {}
    exec(compile(_snippet(classifier), "signoff.md", "exec"), namespace)  # noqa: S102 - the file this build wrote
    assert namespace["outputs"]["logits"].shape == (4, 10)
    signoff = (classifier / "signoff.md").read_text()
    assert f"accel-opt run {classifier.name} INPUTS... --out predictions.jsonl" in signoff
