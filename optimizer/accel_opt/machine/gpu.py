"""NVIDIA GPUs as the CUDA driver sees them, found without importing TensorRT, torch or onnxruntime.

TensorRT's runtime objects can crash a process on a machine without a GPU (seen: a segfault on
exit), so everything that decides whether TensorRT may be imported asks here first. The gpus
reads the driver library (libcuda) through ctypes: cuInit, cuDeviceGetCount, then each device's
name, compute capability and memory. It honours CUDA_VISIBLE_DEVICES like any CUDA program.
"""

from __future__ import annotations

import ctypes
import glob
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache

from pydantic import BaseModel

from accel_opt.machine.support import Availability
from accel_opt.recipe.types import Precision

LIBCUDA = ("libcuda.so.1", "libcuda.so")
# CUdevice_attribute values (cuda.h): the compute capability's major and minor number.
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CUDA_ERROR_NO_DEVICE = 100


@dataclass(frozen=True)
class CudaDevice:
    index: int
    name: str  # "NVIDIA H200"
    compute_capability: str  # "9.0"
    memory_mib: int


@dataclass(frozen=True)
class CudaDevices:
    devices: tuple[CudaDevice, ...]
    driver_cuda_version: str | None  # the newest CUDA version the driver supports, "12.4"
    reason: str = ""  # why no device was found ("" when one was)

    def __bool__(self) -> bool:
        return bool(self.devices)


def _driver_present() -> bool:
    """A device node or nvidia-smi: cheap signs of an NVIDIA driver, checked before loading libcuda."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


def _load_libcuda() -> ctypes.CDLL | None:
    for name in LIBCUDA:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def detect_devices() -> CudaDevices:
    """Every CUDA device this process may use, with the driver's CUDA version, or a reason for none."""
    if not _driver_present():
        return CudaDevices((), None, "no NVIDIA GPU: no /dev/nvidia* device and no nvidia-smi (no NVIDIA driver)")
    lib = _load_libcuda()
    if lib is None:
        return CudaDevices((), None, "no NVIDIA driver library (libcuda.so.1 not found)")
    status = lib.cuInit(0)
    if status == CUDA_ERROR_NO_DEVICE:
        return CudaDevices((), None, "the NVIDIA driver reports no CUDA device (check CUDA_VISIBLE_DEVICES)")
    if status != 0:
        return CudaDevices((), None, f"the CUDA driver failed to initialise (cuInit returned CUDA error {status})")
    version, count = ctypes.c_int(0), ctypes.c_int(0)
    lib.cuDriverGetVersion(ctypes.byref(version))  # 12040 -> CUDA 12.4
    driver_cuda = f"{version.value // 1000}.{version.value % 1000 // 10}" if version.value else None
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return CudaDevices((), driver_cuda, "the NVIDIA driver reports no CUDA device (check CUDA_VISIBLE_DEVICES)")
    devices = []
    for index in range(count.value):
        device, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
        name, memory = ctypes.create_string_buffer(256), ctypes.c_size_t(0)
        if lib.cuDeviceGet(ctypes.byref(device), index) != 0:
            continue
        lib.cuDeviceGetName(name, len(name), device)
        lib.cuDeviceGetAttribute(ctypes.byref(major), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)
        lib.cuDeviceGetAttribute(ctypes.byref(minor), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)
        lib.cuDeviceTotalMem_v2(ctypes.byref(memory), device)
        devices.append(CudaDevice(index, name.value.decode(errors="replace"), f"{major.value}.{minor.value}",
                                  memory.value // 2**20))
    return CudaDevices(tuple(devices), driver_cuda, "" if devices else "no CUDA device could be queried")


@lru_cache(maxsize=1)
def cuda_devices() -> CudaDevices:
    """detect_devices(), once per process (the devices do not change while it runs)."""
    return detect_devices()


def gpu_class(device: str = "cuda") -> str | None:
    """What a GPU sign-off holds for: the model and compute capability of `device` ("cuda[:N]"), as "NVIDIA H200
    (compute 9.0)"; None when there is no such device. Kernels (cuDNN's, Triton's, TensorRT's tactics) are chosen per
    model and capability, so a folder checked on one is re-checked on another."""
    index = int(device.partition(":")[2] or 0)
    devices = {d.index: d for d in cuda_devices().devices}
    if index not in devices:
        return None
    return f"{devices[index].name} (compute {devices[index].compute_capability})"


# Compute capability from which a precision runs on tensor cores (NVIDIA's architecture tables).
GPU_PRECISION_MIN_CC = {"fp16": (7, 0), "int8": (7, 5), "bf16": (8, 0), "fp8": (8, 9)}


class Gpu(BaseModel):
    name: str
    compute_capability: str | None
    memory_mib: int | None
    driver: str | None


def find_gpus() -> tuple[list[Gpu], str]:
    """NVIDIA GPUs from `nvidia-smi`, and a line saying how they were looked for."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "no NVIDIA driver found (nvidia-smi is not on PATH)"
    query = "name,compute_cap,memory.total,driver_version"
    try:
        done = subprocess.run([smi, f"--query-gpu={query}", "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"nvidia-smi failed: {exc}"
    if done.returncode != 0:
        return [], f"nvidia-smi failed: {(done.stderr or done.stdout).strip().splitlines()[:1]}"
    gpus = []
    for row in done.stdout.strip().splitlines():
        name, cc, memory, driver = (part.strip() for part in row.split(",")[:4])
        gpus.append(Gpu(name=name, compute_capability=cc or None, memory_mib=int(memory) if memory.isdigit() else None,
                        driver=driver or None))
    return gpus, f"{len(gpus)} NVIDIA GPU(s) from nvidia-smi"


def gpu_precision_support(precision: Precision) -> Availability:
    """Whether CUDA device 0 has tensor cores for `precision` (both GPU backends ask)."""
    from accel_opt.machine.support import version_tuple

    need, gpus = GPU_PRECISION_MIN_CC.get(precision.value), cuda_devices()
    if need is None or not gpus:
        return Availability(True)
    device = gpus.devices[0]
    if version_tuple(device.compute_capability, 2) < need:
        return Availability(False, f"{device.name} (compute capability {device.compute_capability}) has no "
                                   f"{precision.value} tensor cores; {need[0]}.{need[1]} or newer is needed")
    return Availability(True)
