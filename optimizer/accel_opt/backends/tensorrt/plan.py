"""TensorRT plans (serialized engines): the header, and whether a recorded engine may run here.

Pure functions of bytes and dictionaries; nothing here imports TensorRT. A plan is tied to the
TensorRT version that built it and to the GPU's compute capability (unless built
hardware-compatible); a plan from another GPU model of the same compute capability loads, but the
accuracy sign-off and the timings were measured on the GPU that built it, so it is refused too.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any

from accel_opt.errors import InputRejected
from accel_opt.machine.support import version_tuple

PLAN_MAGIC = 0x74727466  # b"ftrt" read as a little-endian uint32 at offset 0 ("Magic tag does not match" otherwise)
# Bytes 24, 25, 26: TensorRT major, minor, patch of the builder. Source: NVIDIA's answer in TensorRT
# issue #3073, as used by autoware_universe's tensorrt_common (TRT_MAJOR_IDX = 24, ...). Not confirmed
# here on a plan of our own (no GPU to build one), so a disagreement with the recorded version refuses
# the plan rather than being trusted over the record.
VERSION_OFFSETS = (24, 25, 26)
HEADER_BYTES = VERSION_OFFSETS[-1] + 1
# Recorded in the artifact's settings by the build; `here` has the same keys for this machine.
ENGINE_FACTS = ("tensorrt_version", "gpu_name", "compute_capability", "hardware_compatibility_level",
                "cuda_driver_version", "driver_version")
AMPERE_PLUS_MIN_CC = (8, 0)  # HardwareCompatibilityLevel.AMPERE_PLUS: one engine for compute capability >= 8.0


@dataclass(frozen=True)
class PlanHeader:
    tensorrt_version: tuple[int, int, int]  # (major, minor, patch) of the TensorRT that built the plan


def read_plan_header(data: bytes) -> PlanHeader:
    """The header of a serialized plan; InputRejected (exit 3) when `data` is not one."""
    if len(data) < HEADER_BYTES:
        raise InputRejected(f"not a TensorRT plan: {len(data)} bytes, a plan header has at least {HEADER_BYTES}")
    (magic,) = struct.unpack_from("<I", data, 0)
    if magic != PLAN_MAGIC:
        raise InputRejected(f"not a TensorRT plan: magic tag {data[:4]!r}, expected b'ftrt'")
    major, minor, patch = (data[offset] for offset in VERSION_OFFSETS)
    return PlanHeader((major, minor, patch))


def _cc(value: Any) -> tuple[int, ...]:
    return version_tuple(str(value) if value is not None else None, 2)


def plan_mismatch(header: PlanHeader, settings: dict[str, Any]) -> str | None:
    """Why a plan's header disagrees with the TensorRT version its artifact records (None: it agrees)."""
    recorded = version_tuple(settings.get("tensorrt_version"))
    if header.tensorrt_version != recorded:
        built = ".".join(map(str, header.tensorrt_version))
        return f"the engine's header says TensorRT {built}, the artifact records {settings.get('tensorrt_version')}"
    return None


def check_engine_compatible(settings: dict[str, Any], here: dict[str, Any]) -> str | None:
    """One line saying why an engine built with `settings` must not run on `here` (exit 4), None if it may.

    TensorRT refuses a plan of another version ("expecting library version ..."); its header holds
    major.minor.patch, which must match. The compute capability must match unless the engine was built
    AMPERE_PLUS (then both sides need >= 8.0); the GPU model must match, because the sign-off and the
    benchmark describe the GPU that built it. Driver versions are recorded, not compared: a driver too
    old for the CUDA runtime already stops TensorRT from loading.
    """
    built_trt, here_trt = settings.get("tensorrt_version"), here.get("tensorrt_version")
    if not here_trt:
        return "TensorRT is not installed here"
    if version_tuple(built_trt) != version_tuple(here_trt):
        return f"engine built with TensorRT {built_trt}, this machine has TensorRT {here_trt}: rebuild here"
    if not here.get("gpu_name"):
        return "no CUDA GPU here"
    level = str(settings.get("hardware_compatibility_level") or "NONE").rsplit(".", 1)[-1]
    built_cc, here_cc = _cc(settings.get("compute_capability")), _cc(here.get("compute_capability"))
    if level == "AMPERE_PLUS":
        if here_cc < AMPERE_PLUS_MIN_CC:
            return (f"engine built hardware-compatible AMPERE_PLUS (compute capability >= 8.0), this GPU "
                    f"({here.get('gpu_name')}) has {here.get('compute_capability')}")
    elif built_cc != here_cc:
        return (f"engine built for compute capability {settings.get('compute_capability')} "
                f"({settings.get('gpu_name')}), this GPU ({here.get('gpu_name')}) has "
                f"{here.get('compute_capability')}: "
                "rebuild here")
    if level == "NONE" and settings.get("gpu_name") != here.get("gpu_name"):
        return (f"engine built and signed off on {settings.get('gpu_name')}, this GPU is {here.get('gpu_name')} "
                "(same compute capability, but not what was checked and timed): rebuild here")
    return None


TIMING_CACHE_KEYS = ("gpu_name", "compute_capability", "tensorrt_version")


def timing_cache_mismatch(recorded: dict[str, Any], here: dict[str, Any]) -> str | None:
    """Why a timing cache recorded with `recorded` must not seed a build `here` (None: it may).
    Tactic timings from another GPU or TensorRT version would pick kernels for the wrong hardware."""
    for key in TIMING_CACHE_KEYS:
        if recorded.get(key) != here.get(key):
            return f"timing cache from {key}={recorded.get(key)!r}, this build has {here.get(key)!r}"
    return None


def timing_cache_name(here: dict[str, Any]) -> str:
    """A file name unique to (GPU, compute capability, TensorRT version)."""
    raw = "-".join(str(here.get(key)) for key in TIMING_CACHE_KEYS)
    return re.sub(r"[^A-Za-z0-9.-]+", "_", raw).strip("_") + ".timing-cache"
