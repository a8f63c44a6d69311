"""ONNX Runtime backend: the portable default (CPU EP), CUDA/TensorRT EPs with onnxruntime-gpu.

GPU execution providers are strict (ort_gpu.py): a CUDA device and the EP in this build are required
before a session is made, the session refuses to put nodes on the CPU EP, and the EP that actually runs
is checked, so a GPU build never runs on the CPU unnoticed. Their runner binds inputs and outputs on the
device and times host-to-device, compute and device-to-host apart (ort_gpu.OrtIoBindingRunner).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

from polygraphy.backend.base import BaseRunner
from polygraphy.backend.onnxrt import OnnxrtRunner

from accel_opt.backends.base import CompiledModel
from accel_opt.backends.onnxruntime.gpu import (
    CPU_PROVIDER,
    CUDA_PROVIDER,
    DISABLE_CPU_FALLBACK,
    ORT_GPU_INSTALL,
    PATH_OPTIONS,
    RECORD_ASSIGNMENT,
    STRICT_REFUSAL,
    TENSORRT_PROVIDER,
    TrtEpCache,
    gpu_facts,
    is_gpu_provider,
    nodes_by_provider,
    ops_by_provider,
    provider_availability,
    provider_entries,
    provider_option_problem,
    run_once,
    trt_cache_mismatch,
    trt_ep_setup,
)
from accel_opt.backends.onnxruntime.iobinding import OrtIoBindingRunner, SessionFactory
from accel_opt.backends.onnxruntime.kernels import float_run_quantized, integer_kernels
from accel_opt.errors import InputRejected, Unsupported, first_line
from accel_opt.machine.cpu import available_cpus
from accel_opt.machine.gpu import gpu_precision_support
from accel_opt.machine.support import Availability
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.types import Precision

log = logging.getLogger(__name__)

# ORT graph rewrites this project turns off in every session it opens (build, checks, timing, `run`).
# WeightBiasQuantization (ORT >= 1.20) quantizes the float weights of any Conv/Gemm fed by a DequantizeLinear to
# per-tensor int8 at session creation: a layer the precision transform left in float on purpose (the rescue search's
# fallback) would silently run on per-tensor int8 weights, coarser than the per-channel int8 it was kept from
# (EfficientNet-Lite0 with 5 layers kept: 87.9% top-1 agreement with fp32 as ORT rewrote it, 90.8% in float).
DISABLED_OPTIMIZERS = ("WeightBiasQuantization",)

__all__ = ["CPU_PROVIDER", "CUDA_PROVIDER", "TENSORRT_PROVIDER", "OnnxRuntimeBackend", "create_session", "open_session",
           "reference_runner"]


def create_session(path: Path, providers: list[str], threads: int, optimize: bool = True,
                   optimized_model_path: Path | None = None, *, provider_options: dict[str, str] | None = None,
                   allow_cpu_nodes: bool = False):
    """An InferenceSession with recorded options on `providers[0]`; Unsupported (exit 4, one line) when
    that EP cannot run here or is not the one that runs.

    onnxruntime-gpu silently falls back to CPU when CUDA is missing (ORT #17394), so for a GPU EP a CUDA
    device and the EP in this build are checked first (ort_gpu.provider_availability), then open_session
    makes the session strict and checks the active EP. Further entries of `providers` are not
    fallbacks: the TensorRT EP always gets the CUDA EP behind it, and the CPU EP takes nodes only with
    `allow_cpu_nodes`. `optimized_model_path`: where ORT writes the graph it actually runs (after its fusions).
    """
    provider = providers[0]
    if provider != CPU_PROVIDER:
        availability = provider_availability(provider)
        if not availability:
            raise Unsupported(f"ONNX Runtime's {provider} is unavailable here: {availability.reason}")
    return open_session(path, provider, threads, optimize, optimized_model_path, provider_options, allow_cpu_nodes)


def _session_options(ort, threads: int, optimize: bool, optimized_model_path: Path | None):
    options = ort.SessionOptions()
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 4  # fatal only: errors reach the caller as exceptions, not log lines
    if optimized_model_path is not None:
        options.optimized_model_filepath = str(optimized_model_path)
    return options


def open_session(path: Path, provider: str, threads: int, optimize: bool = True,
                 optimized_model_path: Path | None = None,
                 provider_options: dict[str, str] | None = None, allow_cpu_nodes: bool = False):
    """create_session after its availability check: the checks that hold even where that check is fooled
    (an EP listed by the build whose libraries do not load). For a GPU EP: `session.disable_cpu_ep_fallback=1`
    unless `allow_cpu_nodes` (ORT then refuses a session that would run any node on the CPU EP), ORT's
    own Python-level retry on the CPU disabled, `get_providers()[0]` must be `provider`, and where ORT
    records the graph assignment, `provider` must have taken at least one node."""
    import onnxruntime as ort

    options = _session_options(ort, threads, optimize, optimized_model_path)
    gpu = is_gpu_provider(provider)
    strict = gpu and not allow_cpu_nodes
    kwargs: dict[str, Any] = {"providers": [CPU_PROVIDER]}
    if gpu:
        if strict:
            options.add_session_config_entry(DISABLE_CPU_FALLBACK, "1")
        options.add_session_config_entry(RECORD_ASSIGNMENT, "1")
        kwargs = {"providers": provider_entries(provider, provider_options, allow_cpu_nodes), "enable_fallback": 0}
    try:
        with warnings.catch_warnings():
            # "Specified provider ... is not in available provider names": the active EP is checked below.
            warnings.simplefilter("ignore", UserWarning)
            session = ort.InferenceSession(str(path), sess_options=options,
                                           disabled_optimizers=list(DISABLED_OPTIMIZERS),
                                           **kwargs)
    except Exception as exc:  # ORT raises its own exception types from C++
        message = first_line(exc)
        if strict and STRICT_REFUSAL in message:
            raise Unsupported(_strict_refusal(path, provider, threads, optimize, provider_options)) from None
        if "NOT_IMPLEMENTED" in message or "Could not find an implementation" in message:
            raise Unsupported(f"ONNX Runtime {provider} cannot run this model: {message}") from None
        raise InputRejected(f"ONNX Runtime could not load the model: {message}") from None
    if gpu:
        session.disable_fallback()  # no re-creation on the CPU when a run fails (ORT's Python fallback)
    active = session.get_providers()
    if active[0] != provider:
        raise Unsupported(f"ONNX Runtime fell back to {active[0]} although {provider} was "
                          f"requested{_load_hint(provider)}")
    if gpu:
        counts = nodes_by_provider(session)
        if counts is not None and not counts.get(provider):
            raise Unsupported(f"ONNX Runtime's {provider} took none of the model's nodes (assigned: "
                              f"{', '.join(f'{k} {v}' for k, v in counts.items())})")
    return session


def _load_hint(provider: str) -> str:
    if not is_gpu_provider(provider):
        return ""
    import onnxruntime as ort

    if provider not in ort.get_available_providers():
        return f" (not in this onnxruntime build: {ORT_GPU_INSTALL})"
    return (" (the EP did not load: its CUDA, cuDNN or TensorRT libraries are missing or do not match this "
            "onnxruntime-gpu)")


def _strict_refusal(path: Path, provider: str, threads: int, optimize: bool,
                    provider_options: dict[str, str] | None) -> str:
    """Why ORT refused the strict session, in one line: the EP did not load, or it leaves nodes to the
    CPU EP (which, named by op, a second session with CPU nodes allowed tells)."""
    try:
        session = open_session(path, provider, threads, optimize, None, provider_options, allow_cpu_nodes=True)
    except Unsupported as exc:
        return str(exc)
    counts, ops = nodes_by_provider(session) or {}, ops_by_provider(session, CPU_PROVIDER)
    del session
    on_cpu = f"{counts[CPU_PROVIDER]} node(s)" if CPU_PROVIDER in counts else "some nodes"
    if ops:
        on_cpu += f" ({', '.join(ops)})"
    return (f"ONNX Runtime's {provider} does not take every node: {on_cpu} "
            f"would run on the CPU EP, which a GPU build refuses (session.disable_cpu_ep_fallback=1); "
            "allow it explicitly (OnnxRuntimeBackend(allow_cpu_nodes=True)) to run them there, with host copies "
            "between")


class _OrtRunner(OnnxrtRunner):
    """Polygraphy's OnnxrtRunner with a lean infer_impl.

    Polygraphy's own infer_impl is wrapped in `check_called_by`, which inspects the call stack on
    every call: ~100 us, 6% of a 1.6 ms model, more than the 5% the timing harness may add over a
    bare `session.run` loop (benchmarks/harness_overhead.py). Activation and metadata stay Polygraphy's.
    """

    def infer_impl(self, feed_dict):
        if self._output_names is None:
            self._output_names = [node.name for node in self.sess.get_outputs()]
        start = time.perf_counter()
        outputs = self.sess.run(self._output_names, feed_dict)
        self.inference_time = time.perf_counter() - start
        return OrderedDict(zip(self._output_names, outputs))

    _output_names: list[str] | None = None


class OnnxRuntimeBackend:
    """ONNX Runtime on `providers[0]`: CPUExecutionProvider (default), CUDAExecutionProvider or
    TensorrtExecutionProvider (onnxruntime-gpu). `allow_cpu_nodes`: let a GPU EP leave the nodes it
    does not take to the CPU EP (recorded, off by default). `compute_only_timing`: GPU runners report the
    compute stage as their `inference_time` instead of the whole call."""

    name = "onnxruntime"
    extra = "core (onnxruntime); `gpu` for onnxruntime-gpu"

    def __init__(self, providers: list[str] | tuple[str, ...] | None = None, allow_cpu_nodes: bool = False,
                 compute_only_timing: bool = False):
        self.providers = list(providers or [CPU_PROVIDER])
        self.provider = self.providers[0]
        self.allow_cpu_nodes, self.compute_only_timing = allow_cpu_nodes, compute_only_timing
        # The TensorRT EP builds its engine for an optimization profile: compile() takes the deployment's shapes.
        self.compiles_for_shapes = self.provider == TENSORRT_PROVIDER

    def available(self) -> Availability:
        try:
            import onnxruntime as ort
        except ImportError:
            return Availability(False, "onnxruntime is not installed (pip install onnxruntime)")
        if is_gpu_provider(self.provider):
            return provider_availability(self.provider)
        if self.provider not in ort.get_available_providers():
            return Availability(False, f"{self.provider} is not in this onnxruntime build")
        return Availability(True)

    def supports(self, precision: Precision) -> Availability:
        if precision is Precision.bf16 and self.provider == CPU_PROVIDER:
            return Availability(
                False,
                "ONNX Runtime's CPU EP has no bfloat16 kernels (MatMul/Conv fail at session creation); "
                "run bf16 with --backend openvino on a CPU with AMX/AVX512-BF16, or --backend tensorrt on a GPU",
            )
        if precision is Precision.int8 and self.provider == CUDA_PROVIDER:
            return Availability(
                False,
                "ONNX Runtime's CUDA EP does not fuse Q/DQ groups into int8 kernels (its QDQ fusions target the CPU "
                "EP): an int8 graph would run dequantized float math; use the TensorRT EP or --backend tensorrt",
            )
        if is_gpu_provider(self.provider):
            return gpu_precision_support(precision)
        return Availability(True)

    def compile(self, onnx_path: Path, precision: Precision, recipe: Recipe, workdir: Path, *,
                shapes: dict[str, list[int]] | None = None) -> CompiledModel:
        import onnxruntime as ort

        threads = recipe.benchmark.threads or available_cpus()
        if is_gpu_provider(self.provider):
            return self._compile_gpu(Path(onnx_path), precision, recipe, Path(workdir), threads, shapes)
        optimized = (Path(workdir) / f"{Path(onnx_path).stem}.ort-optimized.onnx" if precision is Precision.int8
                     else None)
        if optimized is not None:
            optimized.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        session = create_session(onnx_path, self.providers, threads, optimized_model_path=optimized)
        build_seconds = time.perf_counter() - start
        providers = session.get_providers()
        del session
        checked = {"integer_kernels_by_op": integer_kernels(optimized)} if optimized is not None else {}
        return CompiledModel(
            backend=self.name,
            path=onnx_path,
            precision=precision,
            device="cpu",
            providers=providers,
            threads=threads,
            build_seconds=build_seconds,
            settings={
                "onnxruntime_version": ort.__version__,
                "graph_optimization_level": "ORT_ENABLE_ALL",
                "disabled_optimizers": list(DISABLED_OPTIMIZERS),
                "intra_op_num_threads": threads,
                "inter_op_num_threads": 1,
                "execution_mode": "ORT_SEQUENTIAL",
                **checked,
            },
        )

    def _compile_gpu(self, onnx_path: Path, precision: Precision, recipe: Recipe, workdir: Path, threads: int,
                     shapes: dict[str, list[int]] | None) -> CompiledModel:
        """A session on the CUDA or TensorRT EP, checked strict; for the TensorRT EP its engine and timing
        caches are written under `workdir` and become the artifact's extra files."""
        import onnxruntime as ort

        support = self.supports(precision)
        if not support:
            raise Unsupported(f"ONNX Runtime {self.provider} {precision.value}: {support.reason}")
        provider_options, trt_dirs, trt_facts = None, None, {}
        if self.provider == TENSORRT_PROVIDER:
            provider_options, trt_dirs, trt_facts = trt_ep_setup(onnx_path, precision, recipe, workdir, shapes)
        start = time.perf_counter()
        session = create_session(onnx_path, [self.provider], threads, provider_options=provider_options,
                                 allow_cpu_nodes=self.allow_cpu_nodes)
        cache = None
        if trt_dirs is not None:
            cache = TrtEpCache.collect(*trt_dirs)
            if not any(p.suffix == ".engine" for p in cache.engine_files):  # the EP builds lazily without a profile
                run_once(session, onnx_path, shapes or recipe.shapes)
                cache = TrtEpCache.collect(*trt_dirs)
        build_seconds = time.perf_counter() - start
        active, counts = session.get_providers(), nodes_by_provider(session)
        del session
        entries = provider_entries(self.provider, provider_options, self.allow_cpu_nodes)
        settings: dict[str, Any] = {
            "onnxruntime_version": ort.__version__,
            "graph_optimization_level": "ORT_ENABLE_ALL",
            "disabled_optimizers": list(DISABLED_OPTIMIZERS),
            "intra_op_num_threads": threads,
            "inter_op_num_threads": 1,
            "execution_mode": "ORT_SEQUENTIAL",
            "execution_provider": self.provider,
            "providers_requested": [name for name, _ in entries],
            "provider_options": {name: {k: v for k, v in opts.items() if k not in PATH_OPTIONS} for name,
                                 opts in entries},
            "cpu_ep_fallback": "allowed" if self.allow_cpu_nodes else "disabled",
            "nodes_by_provider": counts,  # None: this onnxruntime does not report the assignment
            "io_binding": {"device": "cuda", "device_id": 0},
            "precision_flags": [],  # no trt_fp16/int8/bf16_enable: the graph carries the precision
            **gpu_facts(),
            **trt_facts,
        }
        if cache is not None:
            settings["trt_engine_cache"] = {"engine_files": [p.name for p in cache.engine_files],
                                            "timing_files": [p.name for p in cache.timing_files]}
            if not cache.engine_files:
                log.warning("the TensorRT EP wrote no engine cache for %s: each session will build its engine",
                            onnx_path.name)
        return CompiledModel(
            backend=self.name, path=onnx_path, precision=precision, device="cuda:0", providers=list(active),
            threads=threads, build_seconds=build_seconds, settings=settings,
            extra_files=cache.files if cache is not None else [],
        )

    def runner(self, compiled: CompiledModel) -> BaseRunner:
        """The deployed model's runner. The EP is the one the build recorded (a GPU artifact loaded by
        `runtime.load` runs on its GPU EP, or is refused, exit 4), not this object's default."""
        settings = compiled.settings
        if problem := provider_option_problem(settings.get("provider_options") or {}):
            raise InputRejected(problem)
        provider = settings.get("execution_provider", CPU_PROVIDER)
        name = f"{self.name}-{compiled.precision.value}"
        if not is_gpu_provider(provider):
            return _OrtRunner(lambda: create_session(compiled.path, [CPU_PROVIDER], compiled.threads), name=name)
        availability = provider_availability(provider)
        if not availability:  # refused now, not at activation: a GPU artifact never becomes a CPU run
            raise Unsupported(f"{compiled.path.name} was built for ONNX Runtime's {provider}: {availability.reason}")
        options = dict(settings.get("provider_options", {}).get(provider, {}))
        allow_cpu = settings.get("cpu_ep_fallback") == "allowed"
        cache = None
        if provider == TENSORRT_PROVIDER:
            reason = trt_cache_mismatch(settings, gpu_facts())
            if reason:
                raise Unsupported(f"the TensorRT EP engine cache of {compiled.path.name} cannot run here: {reason}")
            recorded = settings.get("trt_engine_cache", {})
            by_name = {p.name: p for p in compiled.extra_files}
            missing = [n for n in [*recorded.get("engine_files", []),
                                   *recorded.get("timing_files", [])] if n not in by_name]
            if missing:
                raise InputRejected(f"incomplete artifact: it lists TensorRT EP cache files it does not hold: "
                                    f"{', '.join(missing)}")
            cache = TrtEpCache([by_name[n] for n in recorded.get("engine_files", [])],
                               [by_name[n] for n in recorded.get("timing_files", [])])

        def create(trt_dirs):
            opts = dict(options)
            if trt_dirs is not None:
                opts.update(trt_engine_cache_path=str(trt_dirs[0]), trt_timing_cache_path=str(trt_dirs[1]))
            return create_session(compiled.path, [provider], compiled.threads, provider_options=opts,
                                  allow_cpu_nodes=allow_cpu)

        return OrtIoBindingRunner(SessionFactory(create, cache), name=name, device="cuda", device_id=0,
                                  compute_only=self.compute_only_timing)

    def synchronize(self) -> None:
        """Nothing queued: the CPU EP is synchronous and the I/O-binding runner synchronizes inside each call."""
        return None


def float_run_quantized_ops(model_path: Path, threads: int) -> list[str]:
    """Quantized compute nodes of a Q/DQ model that ORT's CPU EP would run in float (kernels.integer_kernels)."""
    import tempfile

    import onnx

    with tempfile.TemporaryDirectory(prefix="accel-opt-ort-") as tmp:
        optimized = Path(tmp) / "optimized.onnx"
        create_session(model_path, [CPU_PROVIDER], threads, optimized_model_path=optimized)
        return float_run_quantized(onnx.load(str(optimized), load_external_data=False).graph)


def reference_runner(path: Path, threads: int, optimize: bool = False) -> OnnxrtRunner:
    """The fp32 reference: the original model on the CPU EP with graph optimizations off (`optimize`: on, a second
    valid fp32 evaluation through fused kernels, whose distance to the first is the gate's float32 noise floor)."""
    return _OrtRunner(lambda: create_session(path, [CPU_PROVIDER], threads, optimize=optimize),
                      name="fp32-optimized" if optimize else "reference-fp32")
