"""Native TensorRT backend: a strongly typed engine built from the precision-transformed ONNX graph.

Precision is the graph's: fp16/bf16 arrive already cast by the precision stage, int8 as Q/DQ nodes;
no precision BuilderFlag is set (TensorRT 11 removed them) and TF32 is cleared, so fp32 layers stay
fp32. After the build, the engine inspector's per-layer types are compared with the graph's and a
layer running wider than asked fails the build (GateFailed, exit 1).

Safety: TensorRT is imported only after a CUDA device was found (machine/gpu.py, no TensorRT
needed), and the build runs in a child process (tensorrt_build.py), so a native crash is an
internal error (exit 70) with the child's log kept, not a dead CLI. A plan is deserialized only
from a verified artifact (the runtime checks its sha256 first) and only when the recorded TensorRT
version and GPU match this machine (trt_plan.check_engine_compatible, exit 4 otherwise).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import weakref
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import onnx
from polygraphy.backend.base import BaseRunner

from accel_opt.backends.base import INSTALL, CompiledModel
from accel_opt.backends.tensorrt.build_config import ShapeRange, derive_profiles, profile_bounds, trtexec_command
from accel_opt.backends.tensorrt.inspector import graph_tensor_dtypes, precision_counts, wider_layers
from accel_opt.backends.tensorrt.plan import (
    check_engine_compatible,
    plan_mismatch,
    read_plan_header,
    timing_cache_mismatch,
    timing_cache_name,
)
from accel_opt.errors import GateFailed, InputRejected, InternalError, ResourceExhausted, Unsupported, first_line
from accel_opt.files import copy_file, sha256_file, user_cache_dir, write_json, write_text
from accel_opt.graph.inspect import io_specs
from accel_opt.machine.gpu import cuda_devices, gpu_precision_support
from accel_opt.machine.support import Availability, version_tuple
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.types import Precision

log = logging.getLogger(__name__)

TENSORRT_INSTALL = INSTALL["tensorrt"]
ENGINE_FILE, LAYERS_FILE = "model.engine", "engine-layers.json"
TRTEXEC_FILE, TIMING_CACHE_FILE = "trtexec.txt", "timing.cache"
BUILD_MODULE = "accel_opt.backends.tensorrt.build"
BUILD_EXIT = {"built": 0, "failed": 1, "input": 3, "out_of_memory": 5, "crash": 70}  # tensorrt_build.EXIT_*


@dataclass(frozen=True)
class TensorRtOptions:
    """Build settings: the recipe's `tensorrt:` section (recipe.TensorRtConfig)."""

    workspace_mib: int = 4096  # builder scratch memory (MemoryPoolType.WORKSPACE)
    optimization_level: int = 3  # TensorRT's default builder_optimization_level (0-5)
    build_timeout_s: float = 3600.0
    min_shapes: dict[str, list[int]] = field(default_factory=dict)
    opt_shapes: dict[str, list[int]] = field(default_factory=dict)
    max_shapes: dict[str, list[int]] = field(default_factory=dict)
    timing_cache_dir: str | None = None  # default: $XDG_CACHE_HOME/accel-opt/tensorrt
    # recipe tensorrt.allow_host_code: host code in the plan may run (signed folders only)
    allow_host_code: bool = False


def options_from(recipe: Recipe) -> TensorRtOptions:
    section = getattr(recipe, "tensorrt", None)
    if section is None:
        return TensorRtOptions()
    data = section.model_dump() if hasattr(section, "model_dump") else dict(section)
    names = {f.name for f in dataclasses.fields(TensorRtOptions)}
    return TensorRtOptions(**{k: v for k, v in data.items() if k in names and v is not None})


@lru_cache(maxsize=1)
def _driver_version() -> str | None:
    from accel_opt.machine.gpu import find_gpus

    gpus, _ = find_gpus()
    return gpus[0].driver if gpus else None


def here_facts() -> dict[str, Any]:
    """What an engine depends on, for this machine: GPU 0, its driver, the TensorRT installed (imported
    only when a GPU was found). Keys as trt_plan.ENGINE_FACTS."""
    gpus = cuda_devices()
    facts: dict[str, Any] = {"gpu_name": None, "compute_capability": None, "tensorrt_version": None,
                             "cuda_driver_version": gpus.driver_cuda_version, "driver_version": None}
    if not gpus:
        return facts
    device = gpus.devices[0]
    facts.update(gpu_name=device.name, compute_capability=device.compute_capability, gpu_memory_mib=device.memory_mib,
                 driver_version=_driver_version())
    if importlib.util.find_spec("tensorrt") is not None:
        try:
            import tensorrt

            facts["tensorrt_version"] = tensorrt.__version__
        except Exception:  # the bindings without their libraries: no version to offer
            pass
    return facts


class EngineLoader:
    """Deserializes a plan when a TrtRunner activates, with host code refused unless allowed. Polygraphy's
    EngineFromBytes sets `engine_host_code_allowed = True` on every runtime it uses; TensorRT's own default is False,
    and a plan's host code is native code: it runs only from a folder whose signature was verified
    (runtime.load keeps the recipe's opt-in only then). `trt`: the tensorrt module (a stand-in in CPU tests)."""

    def __init__(self, engine_bytes: bytes, host_code_allowed: bool = False, trt=None):
        self.engine_bytes, self.host_code_allowed, self._trt = engine_bytes, host_code_allowed, trt
        self.runtime = None  # kept alive as long as the loader: TensorRT engines must not outlive their runtime

    def __call__(self):
        trt = self._trt
        if trt is None:
            import tensorrt as trt
            from polygraphy.backend.trt import util as trt_util

            logger = trt_util.get_trt_logger()  # Polygraphy's: TensorRT's messages go where its runner's go
        else:
            logger = trt.Logger()
        self.runtime = trt.Runtime(logger)
        self.runtime.engine_host_code_allowed = self.host_code_allowed
        engine = self.runtime.deserialize_cuda_engine(self.engine_bytes)
        if engine is None:
            raise InputRejected("the TensorRT plan does not deserialize here" + (
                "" if self.host_code_allowed else " (host code refused: a plan that carries it needs recipe "
                "tensorrt.allow_host_code and a signed folder)"))
        return engine


def _trt_runner(engine_bytes: bytes, name: str, host_code_allowed: bool = False) -> BaseRunner:
    """Polygraphy's TrtRunner on a serialized plan (deserialized when the runner is activated)."""
    from polygraphy.backend.trt import TrtRunner

    return TrtRunner(EngineLoader(engine_bytes, host_code_allowed), name=name, optimization_profile=0)


def header_check_level(plan: bytes, tensorrt_version: str) -> str:
    """How much of trt_plan's header layout a plan just built confirms: "version" (magic tag and version
    bytes), "magic" (the tag only) or "none". Later loads check only what the build confirmed."""
    try:
        header = read_plan_header(plan)
    except InputRejected:
        return "none"
    return "version" if plan_mismatch(header, {"tensorrt_version": tensorrt_version}) is None else "magic"


class TensorRtBackend:
    name = "tensorrt"
    extra = "tensorrt"
    compiles_for_shapes = True  # compile() takes the deployment's shapes: they are the profile's opt shapes

    def __init__(self) -> None:
        self._runners: weakref.WeakSet = weakref.WeakSet()

    def available(self) -> Availability:
        gpus = cuda_devices()  # no TensorRT import before a GPU is known to be there
        if not gpus:
            return Availability(False,
                                f"{gpus.reason}; TensorRT needs an NVIDIA GPU and driver, then {TENSORRT_INSTALL}")
        if importlib.util.find_spec("tensorrt") is None:
            return Availability(False, f"tensorrt is not installed: {TENSORRT_INSTALL}")
        try:
            import tensorrt  # noqa: F401
        except Exception as exc:  # the PyPI bindings without NVIDIA's libraries raise here
            return Availability(False, f"tensorrt does not import ({first_line(exc, 120)}): {TENSORRT_INSTALL}")
        return Availability(True)

    def supports(self, precision: Precision) -> Availability:
        return gpu_precision_support(precision)

    def compile(self, onnx_path: Path, precision: Precision, recipe: Recipe, workdir: Path, *,
                shapes: dict[str, list[int]] | None = None) -> CompiledModel:
        """Build `onnx_path` into model.engine in a child process, check its layer types, and describe it."""
        support = self.supports(precision)
        if not support:
            raise Unsupported(f"TensorRT {precision.value}: {support.reason}")
        onnx_path, out = Path(onnx_path), Path(workdir) / f"tensorrt-{precision.value}"
        out.mkdir(parents=True, exist_ok=True)
        options = options_from(recipe)
        inputs, _ = io_specs(onnx.load(str(onnx_path), load_external_data=False))
        deployed = shapes or recipe.shapes
        low, high = profile_bounds(inputs, deployed, recipe.benchmark.batch_sizes, recipe.benchmark.max_shapes,
                                   recipe.batch_axes)
        profile = derive_profiles(inputs, deployed, {**low, **options.min_shapes}, options.opt_shapes,
                                  {**high, **options.max_shapes})
        here = here_facts()
        seed, seed_note = _timing_cache_seed(here, options)
        engine, layers, cache = out / ENGINE_FILE, out / LAYERS_FILE, out / TIMING_CACHE_FILE
        request = {
            "onnx": str(onnx_path), "engine": str(engine), "layers_json": str(layers),
            "result": str(out / "result.json"),
            "profile": {name: dataclasses.asdict(r) for name, r in profile.items()},
            "workspace_bytes": options.workspace_mib * 2**20, "optimization_level": options.optimization_level,
            "timing_cache_in": str(seed) if seed else None, "timing_cache_out": str(cache),
        }
        result = _run_build(request, out, options, profile, here)
        version = result["tensorrt_version"]
        header_level = header_check_level(engine.read_bytes(), version)
        if header_level != "version":  # the header layout is second-hand (see trt_plan.py): record, do not trust it
            log.warning("TensorRT %s plan header: only %r of the expected layout holds", version, header_level)

        info = layers.read_text()
        dtypes, dequantized, quantized = graph_tensor_dtypes(onnx_path)
        wider = wider_layers(info, dtypes, quantized=quantized, dequantized=dequantized)
        if wider:
            listed = "; ".join(f"{w.layer} ({w.layer_type}): {w.problem}" for w in wider[:5])
            more = f" (+{len(wider) - 5} more)" if len(wider) > 5 else ""
            raise GateFailed(f"TensorRT runs {len(wider)} layer(s) wider than the {precision.value} graph asks: "
                             f"{listed}{more}")
        major = version_tuple(version)[0]
        write_text(out / TRTEXEC_FILE, trtexec_command(onnx_path.name, ENGINE_FILE, profile, options.workspace_mib,
                                                       options.optimization_level, TIMING_CACHE_FILE, major) + "\n")
        cache_meta = {key: here[key] for key in ("gpu_name", "compute_capability")} | {
            "tensorrt_version": version, "sha256": sha256_file(cache), "seeded": seed_note}
        _keep_timing_cache(cache, cache_meta, options)
        device = cuda_devices().devices[0]
        settings = {
            **{key: here.get(key) for key in ("gpu_name", "compute_capability", "cuda_driver_version",
                                              "driver_version")},
            "tensorrt_version": version,
            "hardware_compatibility_level": result.get("hardware_compatibility_level", "NONE"),
            "strongly_typed": True, "strongly_typed_flag": result.get("strongly_typed_flag"), "tf32": False,
            "engine": ENGINE_FILE, "engine_sha256": sha256_file(engine), "plan_header_check": header_level,
            "profile": {name: dataclasses.asdict(r) for name, r in profile.items()},
            "workspace_mib": options.workspace_mib, "builder_optimization_level": options.optimization_level,
            "device_memory_mib": round(result.get("device_memory_bytes", 0) / 2**20, 1),
            "layer_precisions": precision_counts(info), "io": result.get("io", []),
            "timing_cache": {"file": TIMING_CACHE_FILE, **cache_meta},
            # The recipe's opt-in; runtime.load keeps it only for a signed folder (or the build's own staging).
            "engine_host_code_allowed": options.allow_host_code,
        }
        return CompiledModel(
            backend=self.name, path=onnx_path, precision=precision, device=f"cuda:{device.index}",
            providers=[f"TensorRT {version}"], threads=1, build_seconds=float(result.get("build_seconds", 0.0)),
            settings=settings, extra_files=[engine, layers, out / TRTEXEC_FILE, cache],
        )

    def runner(self, compiled: CompiledModel) -> BaseRunner:
        """A Polygraphy TrtRunner on the artifact's engine; refused (exit 4) on another GPU or TensorRT."""
        settings = compiled.settings
        engine = next((p for p in compiled.extra_files if p.name == settings.get("engine", ENGINE_FILE)), None)
        if engine is None:
            raise Unsupported(f"the TensorRT artifact lists no {ENGINE_FILE}")
        reason = check_engine_compatible(settings, here_facts())
        if reason:
            raise Unsupported(f"TensorRT engine {engine.name} cannot run here: {reason}")
        data = engine.read_bytes()
        level = settings.get("plan_header_check", "none")
        if level in ("magic", "version"):
            header = read_plan_header(data)  # InputRejected (exit 3): not a TensorRT plan
            if level == "version" and plan_mismatch(header, settings):
                raise Unsupported(f"TensorRT engine {engine.name}: {plan_mismatch(header, settings)}")
        runner = _trt_runner(data, name=f"{self.name}-{compiled.precision.value}",
                             host_code_allowed=bool(settings.get("engine_host_code_allowed")))
        self._runners.add(runner)
        return runner

    def synchronize(self) -> None:
        """Wait for the CUDA streams of this backend's runners (Polygraphy's infer already waits on its own)."""
        for runner in list(self._runners):
            stream = getattr(runner, "stream", None)
            if stream is not None:
                stream.synchronize()


def _fmt_profile(profile: dict[str, ShapeRange]) -> str:
    return ", ".join(f"{name} max {'x'.join(map(str, r.max))}" for name, r in profile.items()) or "static shapes"


def _saved_log(log_path: Path) -> str:
    """Copy the child's log out of the build folder (removed when the build ends); return its path."""
    fd, kept = tempfile.mkstemp(prefix="accel-opt-tensorrt-build-", suffix=".log")
    os.close(fd)
    shutil.copyfile(log_path, kept)
    return kept


def _run_build(request: dict, out: Path, options: TensorRtOptions, profile: dict[str, ShapeRange],
               here: dict[str, Any]) -> dict:
    """Run tensorrt_build in a child process; its result, or the typed error its exit status means."""
    request_path, log_path = out / "request.json", out / "tensorrt-build.log"
    write_json(request_path, request)
    with open(log_path, "wb") as log_file:
        try:
            done = subprocess.run([sys.executable, "-m", BUILD_MODULE, str(request_path)], stdout=log_file,
                                  stderr=subprocess.STDOUT, timeout=options.build_timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise ResourceExhausted(f"the TensorRT build ran past {options.build_timeout_s:.0f} s; log: "
                                    f"{_saved_log(log_path)}") from None
    try:
        result = json.loads(Path(request["result"]).read_text())
    except (OSError, ValueError):
        result = {}
    message = result.get("message", "no result written")
    if done.returncode == BUILD_EXIT["built"]:
        return result
    if done.returncode < 0:
        raise InternalError(f"TensorRT crashed while building the engine ({signal.Signals(-done.returncode).name}); "
                            f"log: {_saved_log(log_path)}")
    if done.returncode == BUILD_EXIT["out_of_memory"]:
        raise ResourceExhausted(
            f"out of GPU memory building the TensorRT engine for {_fmt_profile(profile)} with a "
            f"{options.workspace_mib} MiB workspace on {here.get('gpu_name')} ({here.get('gpu_memory_mib')} MiB): "
            f"lower --max-shapes, the batch sizes or the workspace; log: {_saved_log(log_path)}")
    if done.returncode == BUILD_EXIT["input"]:
        raise Unsupported(f"TensorRT cannot parse this model: {message}")
    if done.returncode == BUILD_EXIT["failed"]:
        raise Unsupported(f"TensorRT could not build an engine: {message}; log: {_saved_log(log_path)}")
    raise InternalError(f"the TensorRT build failed ({message}); log: {_saved_log(log_path)}")


def _cache_dir(options: TensorRtOptions) -> Path:
    return Path(options.timing_cache_dir) if options.timing_cache_dir else user_cache_dir("tensorrt")


def _timing_cache_seed(here: dict[str, Any], options: TensorRtOptions) -> tuple[Path | None, str]:
    """A timing cache of this GPU, compute capability and TensorRT version, if one was kept; and why (not)."""
    path = _cache_dir(options) / timing_cache_name(here)
    if not path.is_file():
        return None, "none kept for this GPU and TensorRT version"
    try:
        recorded = json.loads(path.with_name(path.name + ".json").read_text())
    except (OSError, ValueError) as exc:
        return None, f"{path.name}: its description is unreadable ({exc})"
    reason = timing_cache_mismatch(recorded, here)
    if reason is None and recorded.get("sha256") != sha256_file(path):
        reason = "its content does not match its recorded sha256"
    return (None, f"{path.name} not reused: {reason}") if reason else (path, f"reused {path.name}")


def _keep_timing_cache(cache: Path, meta: dict[str, Any], options: TensorRtOptions) -> None:
    """Keep the build's timing cache for the next build on this GPU (best effort: a read-only home is fine)."""
    target = _cache_dir(options) / timing_cache_name(meta)
    try:
        copy_file(cache, target)
        write_json(target.with_name(target.name + ".json"), meta)
    except OSError as exc:
        log.info("timing cache not kept in %s: %s", target.parent, exc)
