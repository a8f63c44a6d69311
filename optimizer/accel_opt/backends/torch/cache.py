"""Compiled AOTInductor packages kept by what they were compiled from, so that one program is compiled once.

Inductor's own caches (in the user's temp folder) speed a compile up; they do not skip it (a ResNet-50 still takes
minutes). A build folder's benchmark compiles the same backend's fp32 package as its baseline, and an fp32 build of
the same factory to the same `--out` compiled exactly that package already: keyed by the exported program, its
weights and the target, the second build copies it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

PACKAGE = "model.pt2"


def cached_package(torch: Any, program: Any, device: str, freezing: bool, cache_dir: Path | None) -> Path | None:
    """Where the package compiled from `program` for `device` is kept under `cache_dir` (None without a cache)."""
    if cache_dir is None:
        return None
    return cache_dir / "torch-packages" / package_key(torch, program, device, freezing) / PACKAGE


def package_key(torch: Any, program: Any, device: str, freezing: bool) -> str:
    """What an AOTInductor package depends on, as a hex digest: the exported program (its graph, signature and
    dynamic-shape constraints), every weight's and constant's bytes, the device it is compiled for (a GPU's name and
    compute capability; the CPU's vector ISA torch dispatches to), torch's release, freezing and TORCHINDUCTOR_*
    settings. Two builds of one factory (an fp32 build and another precision's fp32 baseline) share one compile."""
    digest = hashlib.sha256(str(program).encode())
    named = {**program.state_dict, **program.constants}
    for name in sorted(named):
        value = named[name]
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)
            digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
        else:  # a script object or a Python constant
            digest.update(repr(value).encode())
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        target = f"{torch.cuda.get_device_name(index)} {torch.cuda.get_device_capability(index)}"
    else:
        target = f"cpu {torch.backends.cpu.get_cpu_capability()}"
    settings = sorted((k, v) for k, v in os.environ.items() if k.startswith("TORCHINDUCTOR_"))
    digest.update(f"{target}|torch {torch.__version__}|freezing {freezing}|{settings}".encode())
    return digest.hexdigest()[:32]
