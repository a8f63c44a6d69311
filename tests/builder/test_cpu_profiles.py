"""Every decision that depends on the CPU class, made under each class: auto's candidates and the share of the search's
time each gets, the int8 preset's weight range, native bf16/fp16, and whether a folder's sign-off needs the cross-class
re-check. Each takes the CPU profile as an input (machine.cpu.CpuProfile), so these run the same on any host; the ids
name the class (test_...[avx512_vnni])."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from accel_opt import runtime
from accel_opt.artifact.folder import MANIFEST
from accel_opt.backends.select import candidate_precisions, torch_candidate_precisions
from accel_opt.builder import auto
from accel_opt.builder.auto import PROMISE_FAST, PROMISE_SLOW, plan, promise
from accel_opt.builder.context import CandidateLimits
from accel_opt.machine.cpu import CpuProfile
from accel_opt.precision.int8_presets import OPENVINO, ORT_CPU, TENSORRT, weight_range
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.stages import CalibrationConfig
from accel_opt.report.selection import Candidate

from ..conftest import CPU_CLASSES as CLASSES

SATURATING = {"avx2", "avx512"}  # u8 x s8 pairs summed in int16 (VPMADDUBSW): no VNNI
INT8_DOT = {"avx512_vnni", "amx"}  # VNNI / AMX: int8 dot products accumulating in int32
NATIVE_BF16 = {"avx512_vnni", "amx"}  # Zen 4's AVX512-BF16, Sapphire Rapids' AMX-BF16
NATIVE_FP16 = {"amx"}  # Sapphire Rapids' AVX512-FP16


@pytest.fixture(params=CLASSES)
def cpu(request) -> CpuProfile:
    return CpuProfile.of_class(request.param)


def test_a_profile_is_the_class_it_stands_for(cpu):
    name = cpu.cpu_class
    assert name in CLASSES and cpu.kernel_class("onnxruntime") == cpu.kernel_class("openvino") == name
    assert cpu.saturating_int8 == (name in SATURATING) and cpu.int8_dot_products == (name in INT8_DOT)
    assert cpu.native_bf16 == (name in NATIVE_BF16) and cpu.native_fp16 == (name in NATIVE_FP16)
    # oneDNN's ISA cap lowers OpenVINO's kernels (never ONNX Runtime's), never above the CPU's own class.
    capped = CpuProfile.of_class(name, onednn_max_cpu_isa="avx2")
    assert capped.kernel_class("openvino") == "avx2" and capped.kernel_class("onnxruntime") == name


def test_the_plan_follows_the_class(cpu):
    """OpenVINO plans bf16 only where it is native; int8 is planned on every class; fp32 comes first on each backend;
    torch's CPU candidates add bf16 where it is native."""
    name = cpu.cpu_class
    openvino = [p.value for p, _ in candidate_precisions("openvino", cpu)]
    assert openvino == (["fp32", "bf16", "int8"] if name in NATIVE_BF16 else ["fp32", "int8"])
    assert [p.value for p, _ in candidate_precisions("onnxruntime", cpu)] == ["fp32", "int8"]
    pairs, _ = plan(Recipe(), "openvino", "auto", has_data=True, cpu=cpu)
    assert [(b, p) for b, p, _ in pairs] == [("openvino", p) for p in openvino]
    why_int8 = dict((p.value, why) for p, why in candidate_precisions("onnxruntime", cpu))["int8"]
    assert ("int8 dot products in hardware" in why_int8) == (name in INT8_DOT)
    torch = [p.value for p, _ in torch_candidate_precisions(cpu, cuda=False, torchao=False)]
    assert torch == (["fp32", "bf16"] if name in NATIVE_BF16 else ["fp32"])


def test_the_search_time_goes_where_the_class_has_the_instructions(cpu):
    """The rescue search's share of the time left: twice as much for a precision the class runs natively. Two pending
    reduced candidates (int8, fp16) split what is left by that promise: evenly where both or neither are native, 2:1
    for int8 on AVX-512 VNNI (int8 dot products, no native fp16)."""
    name = cpu.cpu_class
    assert promise("int8", cpu) == (PROMISE_FAST if name in INT8_DOT else PROMISE_SLOW)
    assert promise("bf16", cpu) == (PROMISE_FAST if name in NATIVE_BF16 else PROMISE_SLOW)
    assert promise("fp16", cpu) == (PROMISE_FAST if name in NATIVE_FP16 else PROMISE_SLOW)

    recipe = Recipe().with_overrides(**{"selection.time_budget_s": 1000,
                                        "precision_options.fallback.time_budget_s": 10_000})
    fp32 = Candidate(backend="openvino", precision="fp32", why_tried="", seconds=100.0)
    int8, fp16 = (Candidate(backend="openvino", precision=p, why_tried="") for p in ("int8", "fp16"))
    # the fp32 build took 100 s (on the run's injected clock): 900 s left, 100 s of it for each pending build besides
    # its search
    clock = auto._Clock(recipe.selection.time_budget_s, None, now=lambda: 100.0)
    clock.started = 0.0
    limits = auto._limits(int8, [fp32, int8, fp16], clock, "openvino int8", recipe, cpu)
    assert isinstance(limits, CandidateLimits)
    share = 2 / 3 if name == "avx512_vnni" else 1 / 2
    assert limits.search_budget_s == pytest.approx((900 - 2 * 100) * share, abs=0.1)


def test_the_int8_weight_range_follows_the_class_that_runs_it(cpu):
    """7-bit weights where u8 x s8 pair sums saturate int16 (AVX2, AVX-512 without VNNI), 8-bit elsewhere; a recipe's
    target class or reduce_range wins over the CPU that builds; TensorRT's range never follows the host CPU; OpenVINO's
    follows its kernels under oneDNN's ISA cap."""
    name, host = cpu.cpu_class, CalibrationConfig()
    for preset in (ORT_CPU, OPENVINO):
        target, reduce_range, why = weight_range(preset, host, cpu)
        assert target == name and reduce_range == (name in SATURATING) and name in why
    assert weight_range(ORT_CPU, CalibrationConfig(target_cpu="avx2"), cpu)[:2] == ("avx2", True)
    assert weight_range(ORT_CPU, CalibrationConfig(target_cpu="amx"), cpu)[:2] == ("amx", False)
    assert weight_range(ORT_CPU, CalibrationConfig(reduce_range=False), cpu)[1] is False
    assert weight_range(TENSORRT, host, cpu)[1] is False
    capped = CpuProfile.of_class(name, onednn_max_cpu_isa="AVX2")
    assert weight_range(OPENVINO, host, capped)[:2] == ("avx2", True)
    assert weight_range(ORT_CPU, host, capped)[:2] == (name, name in SATURATING)


@pytest.mark.parametrize("built_on", CLASSES)
def test_a_sign_off_is_rechecked_exactly_when_the_class_differs(built_on, cpu, classifier, tmp_path, monkeypatch):
    """A folder signed off on `built_on`, seen from a CPU of each class: the same class runs as signed off, another
    one is told its kernels differ and is re-checked (nothing remembered yet)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = Path(shutil.copytree(classifier, tmp_path / classifier.name))
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**manifest, "cpu_class": built_on}))
    scope = runtime.sign_off_scope(folder, cpu)
    assert (scope.built_on, scope.here) == (built_on, cpu.cpu_class)
    assert scope.same_class == (built_on == cpu.cpu_class)
    line = scope.line(folder)
    if scope.same_class:
        assert "checked on this CPU class" in line, line
    else:
        assert f"checked on {built_on}, this CPU class is {cpu.cpu_class}" in line and scope.remembered is None, line


def test_a_real_int8_build_gets_the_weights_its_class_needs(cpu, tmp_path):
    """The whole quantization (ONNX Runtime's quantize_static, validated by a session) for the CPU `cpu` with the
    recipe's target left at `host`: 7-bit weights ([-64, 63]) where its kernels saturate, the full 8 bits elsewhere,
    and the build's record says which class it was made for."""
    import numpy as np
    import onnx
    from onnx import TensorProto, numpy_helper

    from accel_opt import zoo
    from accel_opt.precision.int8 import quantize

    model = zoo.save(zoo.saturating_conv(), tmp_path / "sat.onnx")
    report = quantize(model, zoo.saturating_inputs(8), CalibrationConfig(samples=8), "onnxruntime", tmp_path / "q.onnx",
                      None, cpu)
    assert report.calibration.target_cpu == cpu.cpu_class and cpu.cpu_class in report.calibration.reduce_range_reason
    weights = [numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "q.onnx")).graph.initializer
               if t.data_type == TensorProto.INT8 and len(t.dims) == 4]
    peak = max(int(np.abs(w.astype(np.int32)).max()) for w in weights)
    assert peak == (64 if cpu.saturating_int8 else 127)


def test_run_rechecks_a_folder_only_on_another_class(cpu, classifier, tmp_path, monkeypatch):
    """What `run` does before it answers, for a folder signed off on AMX loaded on a CPU of each class: on AMX nothing
    (it runs as signed off); on another class it re-checks the probe set once, says so, and remembers the verdict."""
    from accel_opt.runtime.probe import signed_off_here

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = Path(shutil.copytree(classifier, tmp_path / classifier.name))
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**manifest, "cpu_class": "amx"}))
    line = signed_off_here(runtime.load(folder, cpu=cpu))
    remembered = list((tmp_path / "cache").rglob("*.json"))
    if cpu.cpu_class == "amx":
        assert line is None and not remembered
    else:
        assert f"re-checked on this CPU class ({cpu.cpu_class}): passed" in line and len(remembered) == 1
        again = signed_off_here(runtime.load(folder, cpu=cpu))
        assert again == line and list((tmp_path / "cache").rglob("*.json")) == remembered  # not run twice
