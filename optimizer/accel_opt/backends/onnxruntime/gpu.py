"""ONNX Runtime's CUDA and TensorRT execution providers: availability, strict provider lists, the TensorRT
EP's caches, and an I/O-binding runner that times host-to-device, compute and device-to-host apart.

Strictness. onnxruntime-gpu lists the CUDA and TensorRT EPs even on a machine without a GPU or CUDA
libraries, and then runs the model on the CPU EP with only a log line (ORT #17394). So: a CUDA device
is looked for first (machine/gpu.py, libcuda through ctypes), then the EP must be in this onnxruntime's
build, then the session is created with `session.disable_cpu_ep_fallback=1` (ORT then refuses a session
that would put any node on the CPU EP; the CPU EP must not be listed beside it, or ORT rejects the
configuration), and `session.get_providers()[0]` must be the requested EP. Where ORT's graph assignment
is readable (`session.record_ep_graph_assignment_info`, ORT >= 1.32 here), the nodes per EP are
recorded and a requested EP that took no node is refused.

Precision. No `trt_fp16_enable` / `trt_int8_enable` / `trt_bf16_enable`: the graph carries the precision
(fp16/bf16 casts, int8 Q/DQ). ORT's TensorRT EP source builds a *strongly typed* network on TensorRT >= 9
exactly when neither fp16 nor int8 is enabled (`network_flags |= (fp16_enable_ || int8_enable_) ? 0 :
kSTRONGLY_TYPED`), so TensorRT then keeps each tensor's type from the graph. The EP gives no engine
inspector, so the layer types it runs are recorded as not inspected (the native TensorRT backend checks them).

Nothing here imports onnxruntime at module level.
"""

from __future__ import annotations

import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from accel_opt.backends.base import INSTALL
from accel_opt.machine.gpu import (
    CudaDevices,
    cuda_devices,
    gpu_precision_support,  # noqa: F401 - onnxruntime.py takes it from here
)
from accel_opt.machine.support import Availability
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.types import Precision

log = logging.getLogger(__name__)

CPU_PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"
TENSORRT_PROVIDER = "TensorrtExecutionProvider"
GPU_PROVIDERS = (CUDA_PROVIDER, TENSORRT_PROVIDER)
ORT_GPU_INSTALL = INSTALL["onnxruntime-gpu"]  # pip uninstall -y onnxruntime, then the gpu extra

DISABLE_CPU_FALLBACK = "session.disable_cpu_ep_fallback"
RECORD_ASSIGNMENT = "session.record_ep_graph_assignment_info"
# ORT's refusal when disable_cpu_ep_fallback is set and some node would run on the CPU EP (checked here
# with onnxruntime 1.32: a CUDA EP that is not in the build, or that does not take every node, ends so).
STRICT_REFUSAL = "fallback to CPU EP has been explicitly disabled"
TRT_ENGINE_PREFIX = "ort-trt"  # trt_engine_cache_prefix: engine and profile files are named ort-trt_*
TRT_CACHE_SUFFIXES = (".engine", ".profile", ".timing")


def is_gpu_provider(provider: str) -> bool:
    return provider in GPU_PROVIDERS


def provider_availability(provider: str, gpus: CudaDevices | None = None,
                          available: list[str] | None = None, version: str | None = None) -> Availability:
    """Whether `provider` can run here, with a one-line reason when not. A CUDA device is looked for
    before the build's provider list is believed (onnxruntime-gpu lists CUDA without a GPU).
    `gpus`, `available` and `version` default to this machine (injected in tests)."""
    if provider == CPU_PROVIDER:
        return Availability(True)
    if provider not in GPU_PROVIDERS:
        return Availability(False, f"execution provider {provider!r} is not supported by accel-opt "
                                   f"(use {CPU_PROVIDER}, {CUDA_PROVIDER} or {TENSORRT_PROVIDER})")
    if available is None or version is None:
        try:
            import onnxruntime as ort
        except ImportError:
            return Availability(False, f"onnxruntime is not installed: {ORT_GPU_INSTALL}")
        available = list(ort.get_available_providers()) if available is None else available
        version = ort.__version__ if version is None else version
    gpus = cuda_devices() if gpus is None else gpus
    cpu_build = provider not in available
    build_note = (f"; and onnxruntime {version} is the CPU build (providers: {', '.join(available)}): {ORT_GPU_INSTALL}"
                  if cpu_build else "")
    if not gpus:
        return Availability(False, f"{provider} needs an NVIDIA GPU: {gpus.reason}{build_note}")
    if cpu_build:
        return Availability(False, f"{provider} is not in this onnxruntime build ({version}, providers: "
                                   f"{', '.join(available)}): {ORT_GPU_INSTALL}")
    return Availability(True)


def cuda_ep_options(device_id: int = 0) -> dict[str, str]:
    """CUDA EP options: the device, and TF32 off so that fp32 layers compute in fp32 (TF32 rounds
    inputs to a 10-bit mantissa; a precision change nobody asked for)."""
    return {"device_id": str(device_id), "use_tf32": "0"}


def trt_ep_options(engine_dir: Path, timing_dir: Path, profile: dict[str, Any] | None = None, workspace_mib: int = 4096,
                   optimization_level: int = 3, device_id: int = 0) -> dict[str, str]:
    """TensorRT EP options: engine and timing caches in the given folders (they become artifact files),
    the workspace, the builder optimization level and the optimization profile (min/opt/max per dynamic
    input, `trt_build_config.ShapeRange`s). Never a precision flag (see the module docstring)."""
    options = {
        "device_id": str(device_id),
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(engine_dir),
        "trt_engine_cache_prefix": TRT_ENGINE_PREFIX,
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(timing_dir),
        "trt_max_workspace_size": str(workspace_mib * 2**20),
        "trt_builder_optimization_level": str(optimization_level),
    }
    if profile:
        for which in ("min", "opt", "max"):
            options[f"trt_profile_{which}_shapes"] = ",".join(
                f"{name}:{'x'.join(str(d) for d in getattr(r, which))}" for name, r in profile.items())
    return options


PRECISION_OPTIONS = ("trt_fp16_enable", "trt_int8_enable", "trt_bf16_enable")
PATH_OPTIONS = ("trt_engine_cache_path", "trt_timing_cache_path")
# The provider options a folder's resource_config.json may carry: what the build records (provider_entries,
# trt_ep_options), none of them a path. Others are refused (exit 3): some name libraries ONNX Runtime loads
# (trt_engine_decryption_lib_path, trt_extra_plugin_lib_paths) or files it writes.
FOLDER_PROVIDER_OPTIONS = frozenset({
    "device_id", "use_tf32", "trt_engine_cache_enable", "trt_engine_cache_prefix", "trt_timing_cache_enable",
    "trt_max_workspace_size", "trt_builder_optimization_level", "trt_profile_min_shapes", "trt_profile_opt_shapes",
    "trt_profile_max_shapes"})


def provider_option_problem(provider_options: dict) -> str | None:
    """Why provider options read from a folder ({provider: {option: value}}) must not reach a session, or None."""
    if not isinstance(provider_options, dict):
        return "resource_config.json: provider_options is not a table of providers"
    for provider, options in provider_options.items():
        if not isinstance(options, dict):
            return f"resource_config.json: provider_options of {provider} is not a table"
        if unknown := sorted(set(options) - FOLDER_PROVIDER_OPTIONS):
            return (f"resource_config.json: {provider} option {unknown[0]} is not one a build records (allowed: "
                    f"{', '.join(sorted(FOLDER_PROVIDER_OPTIONS))}); refusing options that name libraries or paths")
        for option, value in options.items():  # and only values a build writes: no path hides in a prefix
            if problem := _value_problem(option, str(value)):
                return f"resource_config.json: {provider} option {option} {value!r}: {problem}"
    return None


def _value_problem(option: str, value: str) -> str | None:
    if option == "trt_engine_cache_prefix":
        return None if value == TRT_ENGINE_PREFIX else f"a build writes {TRT_ENGINE_PREFIX!r} (the engines' names)"
    if option in ("use_tf32", "trt_engine_cache_enable", "trt_timing_cache_enable"):
        return None if value in ("0", "1", "True", "False", "true", "false") else "not a switch"
    if option.startswith("trt_profile_"):  # name:AxBxC,name:...
        return None if re.fullmatch(r"[\w.:/-]+:\d+(x\d+)*(,[\w.:/-]+:\d+(x\d+)*)*", value) and ".." not in value \
            else "not a list of NAME:DIMS"
    return None if value.isdigit() else "not a count"


def provider_entries(provider: str, options: dict[str, str] | None = None, allow_cpu_nodes: bool = False,
                     device_id: int = 0) -> list[tuple[str, dict[str, str]]]:
    """The `providers=` list for InferenceSession. The TensorRT EP is followed by the CUDA EP (nodes
    TensorRT does not take run there, as ORT recommends). The CPU EP is listed only with
    `allow_cpu_nodes`: listing it together with disable_cpu_ep_fallback is a configuration error in ORT."""
    options = dict(options or {})
    forbidden = sorted(set(options) & set(PRECISION_OPTIONS))
    if forbidden:  # a programming error: precision is the graph's
        raise ValueError(f"precision flags {forbidden} must not be set: the ONNX graph carries the precision")
    if provider == CPU_PROVIDER:
        return [(CPU_PROVIDER, options)]
    if provider == CUDA_PROVIDER:
        options = {**cuda_ep_options(device_id), **options}
    entries = [(provider, options)]
    if provider == TENSORRT_PROVIDER:
        entries.append((CUDA_PROVIDER, cuda_ep_options(device_id)))
    if allow_cpu_nodes:
        entries.append((CPU_PROVIDER, {}))
    return entries


def nodes_by_provider(session: Any) -> dict[str, int] | None:
    """{EP name: nodes assigned}, from ORT's recorded graph assignment; None where this ORT cannot tell
    (no get_provider_graph_assignment_info, or the session did not record it)."""
    getter = getattr(session, "get_provider_graph_assignment_info", None)
    if getter is None:
        return None
    try:
        subgraphs = getter()
    except Exception:  # recording not enabled, or an ORT without the C API behind it
        return None
    counts: dict[str, int] = {}
    for subgraph in subgraphs:
        counts[subgraph.ep_name] = counts.get(subgraph.ep_name, 0) + len(subgraph.get_nodes())
    return counts or None


def ops_by_provider(session: Any, provider: str) -> list[str]:
    """Op types ORT assigned to `provider` (sorted, unique); [] where not recorded."""
    getter = getattr(session, "get_provider_graph_assignment_info", None)
    if getter is None:
        return []
    try:
        return sorted({node.op_type for sg in getter() if sg.ep_name == provider for node in sg.get_nodes()})
    except Exception:
        return []


@dataclass
class TrtEpCache:
    """The TensorRT EP's engine and timing caches of one build: file lists, kept flat in the artifact."""

    engine_files: list[Path] = field(default_factory=list)  # ort-trt_*.engine / .profile
    timing_files: list[Path] = field(default_factory=list)  # TensorrtExecutionProvider_cache_sm*.timing

    @classmethod
    def collect(cls, engine_dir: Path, timing_dir: Path) -> TrtEpCache:
        def files(folder: Path) -> list[Path]:
            return sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix in TRT_CACHE_SUFFIXES) \
                if Path(folder).is_dir() else []

        engine = files(engine_dir)
        timing = [p for p in files(timing_dir) if p not in engine]
        return cls(engine, timing)

    @property
    def files(self) -> list[Path]:
        return [*self.engine_files, *self.timing_files]


def gpu_facts() -> dict[str, Any]:
    gpus = cuda_devices()
    device = gpus.devices[0] if gpus else None
    return {"gpu_name": device.name if device else None,
            "compute_capability": device.compute_capability if device else None,
            "cuda_driver_version": gpus.driver_cuda_version}


def trt_cache_mismatch(recorded: dict[str, Any], here: dict[str, Any]) -> str | None:
    """An engine cache is tied to the GPU (compute capability) and, for its sign-off, to the GPU model."""
    for key in ("compute_capability", "gpu_name"):
        if recorded.get(key) != here.get(key):
            return f"built on {recorded.get('gpu_name')} (compute capability {recorded.get('compute_capability')}), " \
                   f"this machine has {here.get('gpu_name') or 'no GPU'} ({here.get('compute_capability')}): " \
                   "rebuild here"
    return None


def trt_ep_setup(onnx_path: Path, precision: Precision, recipe: Recipe, workdir: Path,
                 shapes: dict[str, list[int]] | None) -> tuple[dict[str, str], tuple[Path, Path], dict[str, Any]]:
    """TensorRT EP options for a build: a profile from the deployment's shapes (as the native TensorRT
    backend derives it, and from the recipe's `tensorrt:` section), fresh cache folders under `workdir`."""
    import onnx

    from accel_opt.backends.tensorrt.backend import options_from
    from accel_opt.backends.tensorrt.build_config import derive_profiles, profile_bounds
    from accel_opt.graph.inspect import io_specs

    trt = options_from(recipe)
    inputs, _ = io_specs(onnx.load(str(onnx_path), load_external_data=False))
    deployed = shapes or recipe.shapes
    low, high = profile_bounds(inputs, deployed, recipe.benchmark.batch_sizes, recipe.benchmark.max_shapes,
                               recipe.batch_axes)
    profile = derive_profiles(inputs, deployed, {**low, **trt.min_shapes}, trt.opt_shapes, {**high, **trt.max_shapes})
    root = workdir / f"ort-tensorrt-{precision.value}"
    shutil.rmtree(root, ignore_errors=True)  # a cache left by an earlier build in this folder is not this build's
    engine_dir, timing_dir = root / "engines", root / "timing"
    engine_dir.mkdir(parents=True)
    timing_dir.mkdir()
    options = trt_ep_options(engine_dir, timing_dir, profile, trt.workspace_mib, trt.optimization_level)
    facts = {
        "strongly_typed": "expected: ORT's TensorRT EP builds strongly typed networks on TensorRT >= 9 when no "
                          "precision flag is set (not inspectable through the EP)",
        "layer_precisions": "not inspected (the TensorRT EP exposes no engine inspector; --backend tensorrt checks "
                            "them)",
        # TensorRT enables TF32 math for fp32 layers by default and the EP has no option to clear it (the
        # native TensorRT backend clears it): fp32 builds on the TensorRT EP rest on the accuracy gate.
        "tf32": "TensorRT's default (on; the TensorRT EP offers no switch)",
    }
    return options, (engine_dir, timing_dir), facts


def run_once(session, onnx_path: Path, shapes: dict[str, list[int]]) -> None:
    """One run on zeros at the deployment's shapes, so that the TensorRT EP builds (and caches) its engine
    during the build rather than in the first timed call. Skipped when a shape is not known."""
    import onnx

    from accel_opt.graph.inspect import io_specs

    inputs, _ = io_specs(onnx.load(str(onnx_path), load_external_data=False))
    feed = {}
    for spec in inputs:
        shape = shapes.get(spec.name) or (spec.shape if not spec.dynamic_axes else None)
        if shape is None:
            log.info("no shape for %s: the TensorRT EP engine is built on the first run", spec.name)
            return
        feed[spec.name] = np.zeros([int(d) for d in shape], dtype=np.dtype(spec.dtype))
    session.run(None, feed)
