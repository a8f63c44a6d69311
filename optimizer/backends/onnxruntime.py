"""ONNX Runtime backend: the portable default (CPU EP), CUDA/TensorRT EPs with onnxruntime-gpu."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from pathlib import Path

from polygraphy.backend.onnxrt import OnnxrtRunner

from accel_opt.backends.base import Availability, CompiledModel
from accel_opt.errors import InputRejected, Unsupported, first_line
from accel_opt.hardware import available_cpus
from accel_opt.recipe import Precision, Recipe

log = logging.getLogger(__name__)

CPU_PROVIDER = "CPUExecutionProvider"


def create_session(path: Path, providers: list[str], threads: int, optimize: bool = True,
                   optimized_model_path: Path | None = None):
    """An InferenceSession with recorded options; fails if a requested provider is not active.

    onnxruntime-gpu silently falls back to CPU when CUDA is missing (ORT #17394), so the active
    providers are checked here, once, for every session the project creates. `optimized_model_path`:
    where ORT writes the graph it actually runs (after its fusions).
    """
    import onnxruntime as ort

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
    try:
        session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
    except Exception as exc:  # ORT raises its own exception types from C++
        message = first_line(exc)
        if "NOT_IMPLEMENTED" in message or "Could not find an implementation" in message:
            raise Unsupported(f"ONNX Runtime {providers[0]} cannot run this model: {message}") from None
        raise InputRejected(f"ONNX Runtime could not load the model: {message}") from None
    active = session.get_providers()
    if active[0] != providers[0]:
        raise Unsupported(f"ONNX Runtime fell back to {active[0]} although {providers[0]} was requested")
    return session


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
    name = "onnxruntime"
    extra = "core (onnxruntime); `gpu` for onnxruntime-gpu"

    def __init__(self, providers: list[str] | None = None):
        self.providers = providers or [CPU_PROVIDER]

    def available(self) -> Availability:
        try:
            import onnxruntime as ort
        except ImportError:
            return Availability(False, "onnxruntime is not installed (pip install accel-opt)")
        if self.providers[0] not in ort.get_available_providers():
            return Availability(False, f"{self.providers[0]} is not in this onnxruntime build")
        return Availability(True)

    def supports(self, precision: Precision) -> Availability:
        if precision is Precision.bf16 and self.providers[0] == CPU_PROVIDER:
            return Availability(
                False,
                "ONNX Runtime's CPU EP has no bfloat16 kernels (MatMul/Conv fail at session creation); "
                "run bf16 with --backend openvino on a CPU with AMX/AVX512-BF16, or --backend tensorrt on a GPU",
            )
        return Availability(True)

    def compile(self, onnx_path: Path, precision: Precision, recipe: Recipe, workdir: Path) -> CompiledModel:
        import onnxruntime as ort

        threads = recipe.benchmark.threads or available_cpus()
        optimized = Path(workdir) / f"{Path(onnx_path).stem}.ort-optimized.onnx" if precision is Precision.int8 else None
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
            device="cpu" if self.providers[0] == CPU_PROVIDER else "cuda:0",
            providers=providers,
            threads=threads,
            build_seconds=build_seconds,
            settings={
                "onnxruntime_version": ort.__version__,
                "graph_optimization_level": "ORT_ENABLE_ALL",
                "intra_op_num_threads": threads,
                "inter_op_num_threads": 1,
                "execution_mode": "ORT_SEQUENTIAL",
                **checked,
            },
        )

    def runner(self, compiled: CompiledModel) -> OnnxrtRunner:
        return _OrtRunner(
            lambda: create_session(compiled.path, self.providers, compiled.threads),
            name=f"{self.name}-{compiled.precision.value}",
        )

    def synchronize(self) -> None:
        return None


# What ORT's CPU EP runs quantized math with, once it has fused a DequantizeLinear -> op -> QuantizeLinear group.
INTEGER_KERNELS = {"QGemm", "MatMulInteger", "ConvInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul",
                   "QAttention", "QOrderedMatMul"}
FLOAT_COMPUTE = {"Conv", "ConvTranspose", "MatMul", "Gemm", "FusedConv", "FusedMatMul", "FusedGemm", "NhwcFusedConv"}


def integer_kernels(optimized_path: Path) -> dict[str, int]:
    """{op: count} of the integer kernels in the graph ORT runs; Unsupported (exit 4) when a quantized
    compute op still runs in float (its input dequantized first) that the fallback did not leave in float
    on purpose (the model's metadata lists those), naming them: ORT fuses a Q/DQ group
    into an integer kernel only when the pattern suits it (a Conv without a QuantizeLinear after it,
    for one, stays a float Conv fed by DequantizeLinear), and the build would then be int8 in name only."""
    import onnx

    from accel_opt.precision.fallback import float_by_design

    model = onnx.load(str(optimized_path), load_external_data=False)
    graph = model.graph
    in_float = [name for name in _float_run_quantized(graph) if name not in float_by_design(model)]
    if in_float:
        listed = ", ".join(in_float[:5]) + (f" (+{len(in_float) - 5} more)" if len(in_float) > 5 else "")
        raise Unsupported(f"ONNX Runtime runs {len(in_float)} quantized compute ops in float (not fused into integer "
                          f"kernels): {listed}")
    counts: dict[str, int] = {}
    for node in graph.node:
        if node.op_type.startswith("QLinear") or node.op_type in INTEGER_KERNELS:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items()))


def float_run_quantized_ops(model_path: Path, threads: int) -> list[str]:
    """Quantized compute nodes of a Q/DQ model that ORT's CPU EP would run in float (see integer_kernels)."""
    import tempfile

    import onnx

    with tempfile.TemporaryDirectory(prefix="accel-opt-ort-") as tmp:
        optimized = Path(tmp) / "optimized.onnx"
        create_session(model_path, [CPU_PROVIDER], threads, optimized_model_path=optimized)
        return _float_run_quantized(onnx.load(str(optimized), load_external_data=False).graph)


def _float_run_quantized(graph) -> list[str]:
    dequantized = {out for node in graph.node if node.op_type == "DequantizeLinear" for out in node.output}
    return [node.name or node.op_type for node in graph.node
            if node.op_type in FLOAT_COMPUTE and any(i in dequantized for i in node.input)]


def reference_runner(path: Path, threads: int) -> OnnxrtRunner:
    """The fp32 reference: the original model on the CPU EP with graph optimizations off."""
    return _OrtRunner(lambda: create_session(path, [CPU_PROVIDER], threads, optimize=False), name="reference-fp32")
