"""A sign-off holds for a CPU class: int8 weights follow the target's kernels, the folder records the class its gate
ran and carries a probe set, and another class re-checks it. The cross-class test lowers OpenVINO's kernels with
oneDNN's ISA cap (ONEDNN_MAX_CPU_ISA=AVX2) in a child process: real saturating kernels, on this one machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from accel_opt import zoo
from accel_opt.accuracy import judge
from accel_opt.artifact.folder import MANIFEST
from accel_opt.machine.cpu import CpuProfile, cpu_class, saturating_int8
from accel_opt.precision.int8 import quantize
from accel_opt.precision.int8_presets import ORT_CPU, TENSORRT, weight_range
from accel_opt.recipe.load import load_recipe
from accel_opt.recipe.stages import CalibrationConfig

from ..conftest import CPU_CLASSES, FAST_BENCH, make_model, save

AVX2 = frozenset({"avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl"}


def test_cpu_classes_from_flags():
    assert cpu_class(AVX2, "x86_64") == "avx2"
    assert cpu_class(AVX512, "x86_64") == "avx512"
    assert cpu_class(AVX2 | {"avx_vnni"}, "x86_64") == "avx_vnni"
    assert cpu_class(AVX512 | {"avx512_vnni"}, "x86_64") == "avx512_vnni"
    assert cpu_class(AVX512 | {"avx512_vnni", "amx_int8", "amx_tile"}, "x86_64") == "amx"
    assert cpu_class(frozenset({"asimd"}), "aarch64") == "arm64"
    assert [saturating_int8(c) for c in ("avx2", "avx512", "avx_vnni", "avx512_vnni", "amx", "arm64")] == \
        [True, True, False, False, False, False]
    capped = CpuProfile(AVX512 | {"avx512_vnni", "amx_int8"}, "x86_64", onednn_max_cpu_isa="AVX2")
    assert capped.kernel_class("openvino") == "avx2"  # oneDNN's cap lowers OpenVINO's kernels ...
    assert capped.kernel_class("onnxruntime") == "amx"  # ... not ONNX Runtime's
    assert CpuProfile(AVX2, "x86_64", "AVX512_CORE_AMX").kernel_class("openvino") == "avx2"  # a cap above: no change


def test_the_host_profile_reads_the_flags_and_the_onednn_cap(monkeypatch):
    """The one reader of the host (the CLI/API edge): its flags, its machine and oneDNN's cap from the environment."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    here = CpuProfile.here()
    assert here.onednn_max_cpu_isa == "AVX2" and here.kernel_class("openvino") in ("avx2", "arm64", "other")
    assert set(here.record()["flags"]) <= here.flags and here == CpuProfile.here()  # frozen: equal reads are equal
    with pytest.raises(ValueError, match="unknown CPU class"):
        CpuProfile.of_class("pentium")


@pytest.mark.parametrize("host", CPU_CLASSES)
@pytest.mark.parametrize(("target", "seven_bit"), [("avx2", True), ("avx512", True), ("avx512_vnni", False),
                                                   ("amx", False)])
def test_int8_weights_follow_the_target_cpu(target, seven_bit, host):
    """A recipe's target class decides the weights' range whatever the class of the CPU that builds."""
    here = CpuProfile.of_class(host)
    cpu, reduce_range, reason = weight_range(ORT_CPU, CalibrationConfig(target_cpu=target), here)
    assert (cpu, reduce_range) == (target, seven_bit) and target in reason
    assert weight_range(TENSORRT, CalibrationConfig(target_cpu="avx2"), here)[1] is False  # the GPU's kernels
    # the recipe
    assert weight_range(ORT_CPU, CalibrationConfig(target_cpu="avx2", reduce_range=False), here)[1] is False


def saturating_data(folder: Path, count: int = 100) -> Path:  # int8 holds 60 out: none failing shows >= 95%
    folder.mkdir(parents=True, exist_ok=True)
    for i, sample in enumerate(zoo.saturating_inputs(count)):
        np.savez(folder / f"s{i:03d}.npz", **sample)
    return folder


def test_seven_bit_weights_stay_within_their_range(tmp_path):
    model = save(zoo.saturating_conv(), tmp_path / "sat.onnx")
    samples = [dict(np.load(p)) for p in sorted(saturating_data(tmp_path / "data", 8).iterdir())]
    peaks = {}
    for target in ("avx2", "amx"):
        out = tmp_path / f"{target}.onnx"
        report = quantize(model, samples, CalibrationConfig(samples=8, target_cpu=target), "onnxruntime", out, None,
                          CpuProfile.of_class("avx512_vnni"))  # the recipe's target decides, not the building CPU
        assert report.calibration.target_cpu == target and report.calibration.reduce_range_reason
        weights = [numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer
                   if t.data_type == TensorProto.INT8
                   and len(t.dims) == 4]
        peaks[target] = max(int(np.abs(w.astype(np.int32)).max()) for w in weights)
    assert peaks == {"avx2": 64, "amx": 127}  # 7-bit: [-64, 63] (ORT's reduce_range), else the full 8 bits


def _near_constant(count: int, rng) -> list[dict[str, np.ndarray]]:
    """A probability map that is almost the same everywhere (PP-OCRv4's on synthetic inputs): std ~1e-7."""
    return [{"prob": (3e-6 + 1e-7 * rng.random((1, 1, 32, 32))).astype(np.float32)} for _ in range(count)]


def test_the_noise_floor_keeps_fp32_reordering_from_failing_a_near_constant_output():
    rng = np.random.default_rng(0)
    tol = load_recipe().accuracy.tolerances["fp32"]
    refs = _near_constant(8, rng)
    # Another fp32 evaluation: 2% of the output's tiny std off, as float32 reordering leaves such a map.
    other = [{"prob": r["prob"] + np.float32(2e-9) * rng.standard_normal(r["prob"].shape).astype(np.float32)}
             for r in refs]
    noise = {"prob": 2 * max(float(np.abs(o["prob"] - r["prob"]).max()) for o, r in zip(other, refs))}
    names = [f"s{i}" for i in range(8)]
    assert not judge(refs, other, names, tol).passed  # judged in units of that std alone: a false reject
    assert judge(refs, other, names, tol, noise_floor=noise).passed
    # What the gate exists to catch still fails above the floor: one zeroed sample, a 9% gain.
    zeroed = [dict(o) for o in other]
    zeroed[3] = {"prob": np.zeros_like(refs[3]["prob"])}
    assert not judge(refs, zeroed, names, tol, noise_floor=noise).passed
    scaled = [{"prob": o["prob"] * np.float32(1.09)} for o in other]
    assert not judge(refs, scaled, names, tol, noise_floor=noise).passed


def test_an_unmodified_fp32_model_with_a_near_constant_output_signs_off(tmp_path, fast_recipe):
    """Sigmoid of a deep negative logit: values ~1e-5, std tiny; the measured floor keeps the fp32 build signed off."""
    from accel_opt.builder.pipeline import build

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((16, 3, 3, 3)) * 0.5).astype(np.float32)
    w2 = (rng.standard_normal((1, 16, 3, 3)) * 0.05).astype(np.float32)
    model = save(make_model(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
         helper.make_node("Relu", ["c"], ["r"], name="relu"),
         helper.make_node("Conv", ["r", "w2", "bias"], ["logit"], pads=[1, 1, 1, 1], name="head"),
         helper.make_node("Sigmoid", ["logit"], ["prob"], name="sigmoid")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
        [helper.make_tensor_value_info("prob", TensorProto.FLOAT, [1, 1, 32, 32])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w2, "w2"),
         numpy_helper.from_array(np.array([-12.0], np.float32), "bias")]), tmp_path / "prob.onnx")
    result = build(model, fast_recipe, out_dir=tmp_path / "out")
    assert result.signed_off, result.failures
    accuracy = json.loads((Path(result.artifact_dir) / "accuracy.json").read_text())
    assert accuracy["outputs"][0]["noise_floor"] > 0  # measured, and recorded with the verdict


def _accel_opt(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "accel_opt.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def _as_copied_from(folder: Path, machine_class: str) -> None:
    """What copying a folder signed off on a `machine_class` CPU to this one amounts to: the class (and the verdict) its
    manifest records. Every file the manifest hashes stays as built here."""
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest.update(cpu_class=machine_class, signed_off=True, exit_code=0)
    (folder / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def saturating_builds(tmp_path_factory):
    """OpenVINO int8 builds of the saturating model, as signed off on an AMX CPU: 8-bit weights (for VNNI/AMX
    kernels) and 7-bit ones (for AVX2). Built here and recorded as built on AMX, so every host, whatever its own
    class, re-checks them under oneDNN's AVX2 cap: real saturating kernels, on this one machine."""
    pytest.importorskip("openvino")
    from accel_opt.builder.pipeline import build

    root = tmp_path_factory.mktemp("saturating")
    model, data = save(zoo.saturating_conv(), root / "sat.onnx"), saturating_data(root / "data")
    recipe = load_recipe().with_overrides(precision="int8", backend="openvino", benchmark=FAST_BENCH,
                                          **{"precision_options.fallback.enabled": False})
    folders = {}
    for target in ("amx", "avx2"):
        result = build(model, recipe.with_overrides(**{"precision_options.calibration.target_cpu": target}),
                       data_dir=data, out_dir=root / target)
        # 7-bit weights never saturate: signed off on every class. (Whether the 8-bit build passes its own gate here
        # depends on this host's kernels; the re-check below judges it on saturating ones, whatever the host.)
        assert result.signed_off or target == "amx", result.failures
        folders[target] = Path(result.artifact_dir)
        _as_copied_from(folders[target], "amx")
    return folders, data


def test_another_cpu_class_is_rechecked_and_a_saturating_build_refused(saturating_builds, tmp_path):
    folders, data = saturating_builds
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "ONEDNN_MAX_CPU_ISA": "AVX2"}
    inputs = [str(p) for p in sorted(data.iterdir())[:3]]

    done = _accel_opt("verify", str(folders["amx"]), env=env)  # without --accuracy: it says so, and runs
    assert done.returncode == 0 and "this CPU class is avx2" in done.stdout and "--accuracy" in done.stdout
    done = _accel_opt("verify", str(folders["amx"]), "--accuracy", env=env)
    assert done.returncode == 1 and "FAILED" in done.stderr, done.stdout + done.stderr  # saturation, caught
    done = _accel_opt("run", str(folders["amx"]), *inputs, "--out", str(tmp_path / "p.jsonl"), env=env)
    assert done.returncode == 1 and "re-checked on this CPU class (avx2): FAILED" in done.stderr
    assert not (tmp_path / "p.jsonl").exists()  # refused before anything was written
    done = _accel_opt("run", str(folders["amx"]), *inputs, "--out", str(tmp_path / "q.jsonl"), "--no-recheck", env=env)
    assert done.returncode == 0 and "--no-recheck" in done.stderr

    # Built for AVX2 (7-bit weights): the same re-check passes, once, and is remembered outside the folder.
    before = sorted(p.name for p in folders["avx2"].iterdir())
    done = _accel_opt("run", str(folders["avx2"]), *inputs, "--out", str(tmp_path / "r.jsonl"), env=env)
    assert done.returncode == 0 and "re-checked on this CPU class (avx2): passed" in done.stderr, done.stderr
    assert sorted(p.name for p in folders["avx2"].iterdir()) == before  # the folder itself is never modified
    assert len(list((tmp_path / "cache" / "accel-opt" / "rechecks").glob("*.json"))) == 2  # host's failure, avx2's pass


@pytest.mark.slow
def test_a_failure_only_the_deployed_kernels_show_is_not_blamed_on_layers(saturating_builds, tmp_path):
    """Built for AMX (8-bit) on AVX2 kernels: the gate fails, and the fallback says the kernels saturate instead of
    keeping layers in fp32 that the float-emulated diagnosis would wrongly blame."""
    folders, data = saturating_builds
    model = folders["amx"].parent.parent / "sat.onnx"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = _accel_opt("build", str(model), "--precision", "int8", "--backend", "openvino", "--data", str(data),
                      "--target-cpu", "amx", "--out", str(tmp_path / "out"), "--json", env=env)
    assert done.returncode == 1, done.stderr
    folder = Path(json.loads(done.stdout)["artifact_dir"])
    fallback = json.loads((folder / "build.json").read_text())["fallback"]
    assert fallback["status"] == "kernels" and not fallback["kept"], fallback["reason"]
    assert "saturate" in fallback["reason"]
