"""`accel-opt doctor` on this machine, and what it derives from CPU flags and compute capabilities."""

import json

from click.testing import CliRunner

from accel_opt.builder.doctor import cpu_fast_precisions, cpu_features, gpu_fast_precisions
from accel_opt.cli import main


def test_doctor_reports_this_machine_and_exits_0_without_a_gpu():
    result = CliRunner().invoke(main, ["doctor", "--json", "--no-measure"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["cpu"]["available_cpus"] >= 1 and isinstance(report["gpus"], list)
    by_name = {b["name"]: b for b in report["backends"]}
    assert by_name["onnxruntime"]["installed"] and "CPUExecutionProvider" in by_name["onnxruntime"]["detail"]
    assert set(by_name) == {"onnxruntime", "openvino", "torch", "tensorrt"}
    if not report["gpus"]:
        assert by_name["tensorrt"]["detail"].startswith("needs an NVIDIA GPU")
    human = CliRunner().invoke(main, ["doctor", "--no-measure"])
    assert human.exit_code == 0 and human.stdout.startswith("CPU ") and "onnxruntime" in human.stdout
    assert CliRunner().invoke(main, ["doctor", "--no-probe"]).stdout == human.stdout  # the flag's earlier name


def test_faster_precisions_are_measured_and_cached_per_cpu(tmp_path, monkeypatch):
    """Whatever this CPU is: every precision is timed against its backend's fp32, the verdict follows the ratios,
    and a second doctor reads the cache instead of timing again."""
    from accel_opt.builder.cpu_speed import FASTER_ABOVE, faster_than_fp32, speedups
    from accel_opt.machine.cpu import CpuProfile

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    result = CliRunner().invoke(main, ["doctor", "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    measured = report["measured_speedups"]
    # Every precision that runs on the backend here is timed, as a finite ratio to its fp32 (1.0 by definition).
    assert measured["onnxruntime"]["fp32"] == 1.0 and set(measured["onnxruntime"]) == {"fp32", "int8"}
    assert all(0.05 < r < 50 for ratios in measured.values() for r in ratios.values()), measured
    by_name = {b["name"]: b for b in report["backends"]}
    for backend, ratios in measured.items():
        # The verdict follows the ratios: faster means at least FASTER_ABOVE (1.15x) fp32's speed, nothing else.
        expected = ["fp32"] + [p for p, r in ratios.items() if p != "fp32" and r >= FASTER_ABOVE]
        assert by_name[backend]["fast_precisions"] == expected == faster_than_fp32(backend, measured)
        assert all(f"{p} {r:.2f}x" in by_name[backend]["detail"] for p, r in ratios.items() if p != "fp32")
    cached = list((tmp_path / "accel-opt" / "cpu-speed").glob("*.json"))
    assert len(cached) == 1
    reported = report["cpu"]  # the CPU doctor reported: its cache is keyed on that record
    doctor_cpu = CpuProfile(frozenset(reported["flags"]), reported["machine"], model=reported["model"])
    assert speedups(doctor_cpu) == measured  # from the cache


def test_fast_precisions_follow_the_instruction_set():
    amx = cpu_features(frozenset({"avx512f", "avx512_vnni", "amx_int8", "amx_bf16", "avx512_bf16"}))
    assert cpu_fast_precisions(amx, "openvino") == ["fp32", "int8", "bf16"]
    assert cpu_fast_precisions(amx, "onnxruntime") == ["fp32", "int8"]  # no bf16 kernels in ORT's CPU EP
    assert cpu_fast_precisions(cpu_features(frozenset({"avx2", "fma"})), "openvino") == ["fp32"]


def test_gpu_precisions_follow_the_compute_capability():
    assert gpu_fast_precisions("7.5") == ["fp32", "fp16", "int8"]
    assert gpu_fast_precisions("8.6") == ["fp32", "fp16", "int8", "bf16"]
    assert gpu_fast_precisions("9.0") == ["fp32", "fp16", "int8", "bf16", "fp8"]
    assert gpu_fast_precisions(None) == ["fp32"]
