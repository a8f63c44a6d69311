"""`accel-opt doctor`: what this machine can build and run, and what each missing piece needs.

Read-only and safe on any machine: GPUs are found through `nvidia-smi` (no CUDA library is loaded),
backends through their package metadata and a cheap query; TensorRT is imported only where a GPU
was found, since its runtime objects can crash a process on a machine without one.
"""

from __future__ import annotations

import importlib.util
from importlib import metadata

from pydantic import BaseModel

from accel_opt.backends.base import INSTALL, TORCH_INSTALL
from accel_opt.machine.cpu import BF16_FLAGS, FP16_FLAGS, CpuProfile
from accel_opt.machine.gpu import GPU_PRECISION_MIN_CC, Gpu, find_gpus


class BackendStatus(BaseModel):
    name: str
    installed: bool
    version: str | None = None
    detail: str = ""  # providers, devices, or why it cannot run here
    fast_precisions: list[str] = []
    install: str | None = None  # the command that adds it, when it is missing and would help here


class DoctorReport(BaseModel):
    cpu: dict
    cpu_features: dict[str, bool]
    cpu_class: str  # the kernel class a sign-off is made for (accel_opt.machine.cpu.cpu_class)
    measured_speedups: dict[str, dict[str, float]] | None = None  # backend -> precision -> fp32 time / its time
    gpus: list[Gpu]
    gpu_detail: str
    backends: list[BackendStatus]


def cpu_features(flags: frozenset[str]) -> dict[str, bool]:
    return {
        "avx512": "avx512f" in flags,
        "vnni": bool(flags & {"avx512_vnni", "avx_vnni"}),
        "amx_int8": "amx_int8" in flags,
        "bf16": bool(flags & BF16_FLAGS),
        "fp16": bool(flags & FP16_FLAGS),
    }


def cpu_fast_precisions(features: dict[str, bool], backend: str) -> list[str]:
    """Precisions the instruction set promises faster than fp32 for `backend` (what `doctor --no-measure` says; the
    doctor's answer is measured, see cpu_speed)."""
    fast = ["fp32"]
    if features["vnni"] or features["amx_int8"]:
        fast.append("int8")
    if backend == "openvino":
        fast += [p for p in ("bf16", "fp16") if features[p]]
    return fast


def gpu_fast_precisions(compute_capability: str | None) -> list[str]:
    try:
        major, minor = (int(x) for x in (compute_capability or "").split(".")[:2])
    except ValueError:
        return ["fp32"]
    return ["fp32"] + [p for p, need in GPU_PRECISION_MIN_CC.items() if (major, minor) >= need]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def diagnose(measure: bool = True, refresh: bool = False, cpu: CpuProfile | None = None) -> DoctorReport:
    """This machine's report. `measure`: which CPU precisions are faster than fp32 comes from a short measurement
    (cpu_speed, cached per CPU; `refresh` measures again); without it, from the instruction set. `cpu`: this
    machine's profile (read here by default: doctor describes the host)."""
    cpu = cpu or CpuProfile.here()
    features = cpu_features(cpu.flags)
    gpus, gpu_detail = find_gpus()
    best_cc = max((g.compute_capability for g in gpus if g.compute_capability), default=None)
    backends = [_onnxruntime(features, gpus), _openvino(features), _torch(gpus, best_cc), _tensorrt(gpus, best_cc)]
    measured = None
    if measure:
        from accel_opt.builder.cpu_speed import faster_than_fp32, speedups

        measured = speedups(cpu, refresh)
        for status in backends:
            if status.name in measured:
                ratios = ", ".join(f"{p} {r:.2f}x" for p, r in measured[status.name].items() if p != "fp32")
                status.fast_precisions = faster_than_fp32(status.name, measured)
                status.detail += f"; measured vs its fp32 here: {ratios}"
    return DoctorReport(cpu=cpu.record(), cpu_features=features, cpu_class=cpu.cpu_class, gpus=gpus,
                        gpu_detail=gpu_detail,
                        backends=backends, measured_speedups=measured)


def _onnxruntime(features: dict[str, bool], gpus: list[Gpu]) -> BackendStatus:
    import onnxruntime as ort

    providers = ort.get_available_providers()
    gpu_build = _version("onnxruntime-gpu") is not None
    status = BackendStatus(name="onnxruntime", installed=True, version=ort.__version__,
                           detail=f"providers: {', '.join(providers)}",
                           fast_precisions=cpu_fast_precisions(features, "onnxruntime"))
    if gpus and not gpu_build:
        status.install = INSTALL["onnxruntime-gpu"]
        status.detail += "; the CPU build: the CUDA and TensorRT execution providers need onnxruntime-gpu"
    return status


def _openvino(features: dict[str, bool]) -> BackendStatus:
    version = _version("openvino")
    if version is None:
        return BackendStatus(name="openvino", installed=False, detail="the fastest CPU runtime on x86 with AVX-512",
                             install=INSTALL["openvino"])
    from accel_opt.backends.openvino.backend import _core

    devices = _core().available_devices
    return BackendStatus(name="openvino", installed=True, version=version, detail=f"devices: {', '.join(devices)}",
                         fast_precisions=cpu_fast_precisions(features, "openvino"))


def _torch(gpus: list[Gpu], best_cc: str | None) -> BackendStatus:
    version = _version("torch")
    if version is None:
        return BackendStatus(name="torch", installed=False, detail="PyTorch export and the PyTorch reference",
                             install=TORCH_INSTALL)
    cuda_build = "+cu" in version  # the wheel's local version tag; torch itself is not imported (slow)
    detail = "CUDA build" if cuda_build else "CPU build" if "+cpu" in version else "build not told by its version"
    fast = gpu_fast_precisions(best_cc) if gpus and cuda_build else ["fp32"]
    return BackendStatus(name="torch", installed=True, version=version, detail=detail, fast_precisions=fast)


def _tensorrt(gpus: list[Gpu], best_cc: str | None) -> BackendStatus:
    installed = importlib.util.find_spec("tensorrt") is not None
    if not gpus:
        return BackendStatus(name="tensorrt", installed=installed, version=_version("tensorrt"),
                             detail="needs an NVIDIA GPU (none found); not imported")
    if not installed:
        return BackendStatus(name="tensorrt", installed=False, detail="native TensorRT engines for the GPU(s) found",
                             install=INSTALL["tensorrt"])
    try:
        import tensorrt

        version = tensorrt.__version__
    except Exception as exc:  # the bindings without their libraries
        return BackendStatus(name="tensorrt", installed=True, detail=f"does not import: {exc}",
                             install=INSTALL["tensorrt"])
    return BackendStatus(name="tensorrt", installed=True, version=version, detail="GPU found",
                         fast_precisions=gpu_fast_precisions(best_cc))
