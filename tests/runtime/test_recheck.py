"""The re-check of a folder on another machine class, on every host: a folder whose recorded class differs from this
machine's is a real case (built elsewhere, copied here), so it is made by editing the class its manifest records.
ONNX Runtime and OpenVINO alike; passing, failing and broken probe sets; folders from before probe sets."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from accel_opt import zoo
from accel_opt.artifact.folder import MANIFEST, file_hashes
from accel_opt.builder.pipeline import build
from accel_opt.machine.cpu import CpuProfile, cpu_class
from accel_opt.machine.gpu import CudaDevice, CudaDevices
from accel_opt.recipe.load import load_recipe
from accel_opt.runtime.probe import PROBE_JSON, PROBE_NPZ, UINT8_IMAGE, _record_path

from ..conftest import CLASSIFIER_PRE, FAST_BENCH

BACKENDS = ["onnxruntime", pytest.param("openvino", marks=[pytest.mark.slow, pytest.mark.skipif(
    __import__("importlib").util.find_spec("openvino") is None, reason="openvino is not installed")])]


def _recorded_class(folder: Path) -> str:
    """The class a folder's gate ran on, as its manifest records it (built here: this machine's, whatever it is)."""
    return json.loads((folder / MANIFEST).read_text())["cpu_class"]


def _other_class(folder: Path) -> str:
    """A class other than the one `folder` was checked on."""
    return "avx2" if _recorded_class(folder) != "avx2" else "amx"


def _accel_opt(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    return subprocess.run([sys.executable, "-m", "accel_opt.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def _edit_manifest(folder: Path, rehash: bool = False, **fields) -> None:
    """What copying a folder from another machine amounts to (the class it records), or, with `rehash`, a forger's
    re-hashed manifest (no signature to stop it)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    for key, value in fields.items():
        if value is None:
            manifest.pop(key, None)
        else:
            manifest[key] = value
    if rehash:
        manifest["artifacts"] = file_hashes(folder)
    (folder / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture(scope="module", params=BACKENDS)
def built(request, tiny_cnn_path, photos, tmp_path_factory) -> Path:
    """The tiny classifier built from photos (fp32; the re-check path is the same for every precision)."""
    recipe = load_recipe().with_overrides(benchmark=FAST_BENCH, preprocessing=CLASSIFIER_PRE, postprocess={"topk": 3},
                                          backend=request.param, **{"selection.target_batch_size": 4})
    result = build(tiny_cnn_path, recipe, data_dir=photos, out_dir=tmp_path_factory.mktemp(request.param))
    assert result.signed_off, result.failures
    return Path(result.artifact_dir)


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "copy" / folder.name))


def test_another_class_is_said_rechecked_once_and_remembered(built, photos, tmp_path):
    manifest = json.loads((built / MANIFEST).read_text())
    recorded = manifest["cpu"]  # the class its gate ran on follows from the CPU it records
    assert manifest["cpu_class"] == cpu_class(frozenset(recorded["flags"]), recorded["machine"])
    assert {PROBE_NPZ, PROBE_JSON} <= set(manifest["artifacts"])  # the probe set is hashed like every file
    folder = _copy(built, tmp_path)
    other, here = _other_class(built), _recorded_class(built)
    _edit_manifest(folder, cpu_class=other)
    cache = tmp_path / "cache"
    said = _accel_opt("verify", folder, cache=cache)
    assert said.returncode == 0 and f"checked on {other}, this CPU class is {here}" in said.stdout, said.stdout
    checked = _accel_opt("verify", folder, "--accuracy", "--json", cache=cache)
    assert checked.returncode == 0, checked.stderr
    report = json.loads(checked.stdout)
    assert report["recheck"]["passed"] and report["recheck"]["sample_count"] == 10  # every sample the build judged
    assert report["cpu_class"]["remembered"] is True  # the scope states this re-check's verdict, not an older one
    human = _accel_opt("verify", folder, "--accuracy", cache=cache)
    first, second, *rates = human.stdout.strip().splitlines()
    assert first.startswith("ok: ") and f"re-checked on this CPU class ({here}): passed" in first
    assert second.startswith(f"accuracy re-checked here ({here}) on 10 probe samples of the 10 the build judged")
    # not a bare "passed": what the probe samples show, with their counts, bound and confidence
    assert second.endswith("no check failed; what 10 samples show:") and rates
    assert all(line.strip().startswith("the probe set confirms ") and "at 95% confidence (0 " in line for line in rates)
    before = sorted(p.name for p in folder.iterdir())
    ran = _accel_opt("run", folder, photos, "--out", tmp_path / "p.jsonl", cache=cache)
    assert ran.returncode == 0 and f"re-checked on this CPU class ({here}): passed" in ran.stderr
    assert sorted(p.name for p in folder.iterdir()) == before  # the folder itself is never modified
    assert len(list((cache / "accel-opt" / "rechecks").glob("*.json"))) == 1


@pytest.mark.slow
def test_a_failing_recheck_refuses_the_run_and_fails_verify(built, photos, tmp_path):
    """A probe set whose reference outputs the folder's model does not reproduce (what another machine's kernels
    would yield): verify --accuracy is exit 1 with the failure, run is exit 1 before anything is written."""
    folder = _copy(built, tmp_path)
    with np.load(folder / PROBE_NPZ) as npz:
        arrays = {k: (npz[k] * 1.5 if k.startswith("ref_") else npz[k]) for k in npz.files}
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    (folder / PROBE_NPZ).write_bytes(buffer.getvalue())
    _edit_manifest(folder, rehash=True, cpu_class=_other_class(folder))
    cache = tmp_path / "cache"
    checked = _accel_opt("verify", folder, "--accuracy", cache=cache)
    assert checked.returncode == 1 and "FAILED" in checked.stderr and "gain 0.6667" in checked.stderr, checked.stderr
    assert checked.stdout.startswith("not ok: ")
    assert "re-checked on this CPU class" in checked.stdout and "FAILED" in checked.stdout
    ran = _accel_opt("run", folder, photos, "--out", tmp_path / "p.jsonl", cache=cache)
    assert ran.returncode == 1 and "FAILED" in ran.stderr and not (tmp_path / "p.jsonl").exists()


def test_an_error_inside_the_recheck_is_one_line_with_its_exit_code(built, tmp_path):
    """Probe inputs the model cannot take: ONNX Runtime raises its own InvalidArgument (unexpected here: exit 70, a
    bug's code, never 1, the code of a re-check that ran and failed), OpenVINO's runner says the input does not fit
    (exit 3). One line either way, and --json still parses."""
    folder = _copy(built, tmp_path)
    backend = json.loads((folder / "resource_config.json").read_text())["backend"]
    expected = {"onnxruntime": 70, "openvino": 3}[backend]
    with np.load(folder / PROBE_NPZ) as npz:
        arrays = {k: (npz[k][..., :5] if k.startswith("in_") else npz[k]) for k in npz.files}  # not the model's shape
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    (folder / PROBE_NPZ).write_bytes(buffer.getvalue())
    probe = json.loads((folder / PROBE_JSON).read_text())
    probe["input_encoding"] = {}  # the cropped arrays are taken as they are
    (folder / PROBE_JSON).write_text(json.dumps(probe))
    _edit_manifest(folder, rehash=True, cpu_class=_other_class(folder))
    for json_flag in ([], ["--json"]):
        done = _accel_opt("verify", folder, "--accuracy", *json_flag, cache=tmp_path / "cache")
        assert done.returncode == expected, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("accel-opt: error: ")
        if json_flag:
            assert json.loads(done.stdout)["exit_code"] == expected


@pytest.mark.slow
def test_a_folder_from_before_probe_sets_runs_on_its_own_class_only(built, photos, tmp_path):
    folder = _copy(built, tmp_path)
    for name in (PROBE_NPZ, PROBE_JSON):
        (folder / name).unlink()
    _edit_manifest(folder, rehash=True, cpu_class=None)  # older builds recorded the CPU's flags, not a class
    cache = tmp_path / "cache"
    ran = _accel_opt("run", folder, photos, "--out", tmp_path / "p.jsonl", cache=cache)
    assert ran.returncode == 0, ran.stderr  # the class derived from its recorded flags is this CPU's: it runs as it did
    manifest = json.loads((folder / MANIFEST).read_text())
    elsewhere = "avx2" if _recorded_class(built) != "avx2" else "amx_int8"
    manifest["cpu"]["flags"] = ["avx", "avx2",
                                "fma"] if elsewhere == "avx2" else [*manifest["cpu"]["flags"], "amx_int8"]
    (folder / MANIFEST).write_text(json.dumps(manifest))
    refused = _accel_opt("run", folder, photos, "--out", tmp_path / "q.jsonl", cache=cache)
    assert refused.returncode == 3 and "predates probe sets" in refused.stderr


@pytest.mark.slow
def test_probe_sets_keep_16_samples_whatever_the_input_size(tmp_path):
    """224x224 images: 16 probe samples stored as their uint8 crops (the 4 MiB cap kept 6 before), rebuilt bit for bit
    by the recorded preprocessing; a recipe can keep more."""
    photos = tmp_path / "photos"
    photos.mkdir()
    for i, photo in enumerate(zoo._skimage_photos()[:6]):  # 24 photos: 4 steer, 20 held out
        for j, scale in enumerate((0.6, 0.8, 1.0, 1.3)):
            img = Image.fromarray(photo)
            img.resize((int(img.width * scale), int(img.height * scale))).save(photos / f"{i}_{j}.jpg")
    model = zoo.save(zoo.resnet(layout=(1,), width=8, num_classes=10, image_size=224, seed=0), tmp_path / "m224.onnx")
    recipe = load_recipe("image-classifier").with_overrides(precision="fp32", benchmark=FAST_BENCH,
                                                            **{"selection.target_batch_size": 4})
    for wanted, kept in ((None, 16), (20, 20)):
        chosen = recipe if wanted is None else recipe.with_overrides(**{"accuracy.probe_samples": wanted})
        result = build(model, chosen, data_dir=photos, out_dir=tmp_path / f"out{kept}")
        folder = Path(result.artifact_dir)
        probe = json.loads((folder / PROBE_JSON).read_text())
        assert len(probe["samples"]) == kept and probe["evaluated"] == 20
        assert probe["input_encoding"] == {"image": UINT8_IMAGE}
        from accel_opt.runtime.probe import read_probe

        _, inputs, _ = read_probe(folder)
        assert inputs[0]["image"].dtype == np.float32 and inputs[0]["image"].shape == (1, 3, 224, 224)
        assert (folder / PROBE_NPZ).stat().st_size < 16 * 224 * 224 * 3 * 1.1 * kept / 16  # uint8, not float32


def test_a_remembered_verdict_is_keyed_on_what_picks_kernels(built, monkeypatch):
    """Not the runtime's major.minor only: every tool version, oneDNN's ISA cap and the folder's identity."""
    key = _record_path(built, "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert _record_path(built, "avx2") != key
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr("accel_opt.runtime.probe.tool_versions", lambda: {"onnxruntime": "1.32.1"})
    assert _record_path(built, "avx2") != key
    assert _record_path(built, "amx") != _record_path(built, "avx2")



def test_a_gpu_sign_off_is_rechecked_on_another_gpu_model(built, monkeypatch):
    """A GPU folder records the GPU model and compute capability its gate ran on; another one is another machine
    class (re-checked from the probe set), a machine without one says so."""
    from accel_opt import runtime
    from accel_opt.runtime.probe import scope

    a100, h200 = "NVIDIA A100-SXM4-80GB (compute 8.0)", "NVIDIA H200 (compute 9.0)"
    other = scope(built, a100, h200, device="cuda")
    assert not other.same_class and other.what == "GPU"
    assert other.line(built).startswith(f"checked on {a100}, this GPU is {h200}: its kernels differ")
    assert scope(built, h200, h200, device="cuda:0").same_class
    config = runtime.load(built).config.model_copy(update={"device": "cuda:0"})
    cpu = CpuProfile.of_class("amx")  # a GPU build's class is its GPU's, whatever the CPU
    monkeypatch.setattr("accel_opt.machine.gpu.cuda_devices", lambda: CudaDevices((), None, "no driver"))
    assert runtime.machine_class(config, cpu) == "no GPU"
    h200_here = CudaDevices((CudaDevice(0, "NVIDIA H200", "9.0", 143771),), "13.0")
    monkeypatch.setattr("accel_opt.machine.gpu.cuda_devices", lambda: h200_here)
    assert runtime.machine_class(config, cpu) == h200
