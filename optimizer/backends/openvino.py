"""OpenVINO backend: the fastest CPU runtime on x86 (bf16 on AMX, int8 from the same Q/DQ ONNX).

The backend compiles exactly the ONNX graph it is given. Its one precision knob is the
INFERENCE_PRECISION_HINT, which is always set: on AMX CPUs OpenVINO silently runs an fp32 model
in bf16 unless told f32. After compiling, the hint and every layer's runtime precision are read
back and recorded, so the report says what actually ran, not what was asked for.

Shapes: unless the recipe asks for `dynamic_shapes`, every input-shape set runs on a model compiled
for exactly those static shapes (a dynamic batch costs 6-20% at int8 here). The runner compiles one
per shape signature on first use, each verified like the saved one; the saved blob is the compile
for the deployment's shapes (the pipeline passes them, at the deployed batch size).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata

from accel_opt.artifacts import sha256_file, write_bytes, write_json
from accel_opt.backends.base import Availability, CompiledModel
from accel_opt.errors import InputRejected, Unsupported, first_line
from accel_opt.hardware import available_cpus, cpu_flags
from accel_opt.recipe import Precision, Recipe

log = logging.getLogger(__name__)

DEVICE = "CPU"
# The hint per precision. int8: quantized ops run int8 as the Q/DQ nodes say; the rest stays f32,
# because a bf16 remainder would be a precision change the graph does not ask for.
HINTS = {Precision.fp32: "f32", Precision.bf16: "bf16", Precision.fp16: "f16", Precision.int8: "f32"}
NATIVE_FLAGS = {
    Precision.bf16: ("amx_bf16", "avx512_bf16"),
    Precision.fp16: ("amx_fp16", "avx512_fp16"),
}
CAPABILITY = {Precision.bf16: "BF16", Precision.fp16: "FP16"}
ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4")  # flags that change which kernels a blob holds
READ_BACK = ("PERFORMANCE_HINT", "NUM_STREAMS", "INFERENCE_NUM_THREADS", "EXECUTION_MODE_HINT", "ENABLE_CPU_PINNING")
COMPUTE_LAYERS = ("Convolution", "FullyConnected", "MatMul", "Deconvolution", "GroupConvolution")
MAX_STATIC_COMPILES = 8  # per runner; the least recently used compile goes first beyond this


def isa_flags(flags: frozenset[str]) -> list[str]:
    return sorted(f for f in flags if f.startswith(ISA_PREFIXES))


def precision_support(precision: Precision, flags: frozenset[str], capabilities: tuple[str, ...] = ()) -> Availability:
    """Whether `precision` runs natively here, from CPU flags and OpenVINO's OPTIMIZATION_CAPABILITIES.

    bf16/fp16 need the CPU instructions (emulation would be slower than fp32) and the runtime's
    agreement; where flags are unknown (not Linux), the runtime's capabilities decide alone.
    """
    if precision in (Precision.fp32, Precision.int8):
        return Availability(True)
    wanted = NATIVE_FLAGS[precision]
    has_flag = bool(flags & set(wanted)) if flags else CAPABILITY[precision] in capabilities
    runtime_ok = not capabilities or CAPABILITY[precision] in capabilities
    if has_flag and runtime_ok:
        return Availability(True)
    what = " or ".join(f.upper().replace("_", "-") for f in wanted)
    if not has_flag:
        reason = f"this CPU has no native {precision.value} ({what} missing); OpenVINO would emulate it, slower than fp32"
    else:
        reason = f"this OpenVINO CPU plugin does not offer {CAPABILITY[precision]} here (capabilities: {', '.join(capabilities)})"
    hint = "use --precision int8 or fp32" if precision is Precision.bf16 else "fp16 is a GPU precision; use bf16 or int8"
    return Availability(False, f"{reason}; {hint}")


@lru_cache(maxsize=1)
def _core():
    import openvino as ov

    return ov.Core()


def capabilities() -> tuple[str, ...]:
    return tuple(_core().get_property(DEVICE, "OPTIMIZATION_CAPABILITIES"))


def environment() -> dict[str, Any]:
    """What a compiled blob depends on: OpenVINO version and the CPU (model name and ISA flags)."""
    import openvino as ov

    return {
        "openvino_version": ov.get_version(),
        "cpu_model": str(_core().get_property(DEVICE, "FULL_DEVICE_NAME")),
        "cpu_isa_flags": isa_flags(cpu_flags()),
    }


def blob_mismatch(meta: dict[str, Any], blob: bytes | None = None) -> str | None:
    """Why a blob recorded with `meta` must not be loaded here (None: it may be)."""
    here = environment()
    for key in ("openvino_version", "cpu_model", "cpu_isa_flags"):
        if meta.get(key) != here[key]:
            return f"blob built for {key}={meta.get(key)!r}, this machine has {here[key]!r}"
    if blob is not None and hashlib.sha256(blob).hexdigest() != meta.get("sha256"):
        return "blob content does not match its recorded sha256"
    return None


def load_cached_blob(blob_path: Path, meta: dict[str, Any] | None = None):
    """The openvino.CompiledModel in `blob_path`, or None (rebuild) if it was built elsewhere or altered."""
    blob_path = Path(blob_path)
    meta_path = blob_path.with_suffix(blob_path.suffix + ".json")
    try:
        meta = json.loads(meta_path.read_text()) if meta is None else meta
        blob = blob_path.read_bytes()
    except (OSError, ValueError):
        return None
    reason = blob_mismatch(meta, blob)
    if reason:
        log.info("not reusing %s: %s", blob_path, reason)
        return None
    try:  # the import config matters: a blob imported without its hint runs bf16 on AMX CPUs
        compiled = _core().import_model(blob, DEVICE, meta.get("config") or {})
    except Exception as exc:  # OpenVINO refuses blobs of other versions with a RuntimeError
        log.info("not reusing %s: %s", blob_path, first_line(exc))
        return None
    ran = execution_precisions(compiled)
    if ran != meta.get("execution_precision_by_layer_type"):
        log.info("not reusing %s: it runs %s, recorded %s", blob_path, ran, meta.get("execution_precision_by_layer_type"))
        return None
    return compiled


def _read(onnx_path: Path):
    """The openvino.Model of an ONNX file (or OpenVINO IR)."""
    try:
        return _core().read_model(str(onnx_path))
    except Exception as exc:  # OpenVINO raises RuntimeError subclasses from C++
        raise InputRejected(f"OpenVINO could not read {Path(onnx_path).name}: {first_line(exc)}") from None


def _compile_model(model, config: dict[str, str], static_shapes: dict[str, list[int]] | None):
    """Compile `model` (left unchanged) on the CPU; with `static_shapes`, a reshaped copy of it."""
    if static_shapes:
        names = {n for i in model.inputs for n in i.get_names()}
        unknown = sorted(set(static_shapes) - names)
        if unknown:
            raise InputRejected(f"shapes given for unknown inputs {unknown}; the model has {sorted(names)}")
        model = model.clone()
        try:
            model.reshape({name: list(dims) for name, dims in static_shapes.items()})
        except Exception as exc:
            raise InputRejected(f"OpenVINO cannot reshape the model to {static_shapes}: {first_line(exc)}") from None
    try:
        return _core().compile_model(model, DEVICE, config)
    except Exception as exc:
        raise Unsupported(f"OpenVINO CPU cannot compile this model: {first_line(exc)}") from None


def _compile(onnx_path: Path, config: dict[str, str], static_shapes: dict[str, list[int]] | None):
    return _compile_model(_read(onnx_path), config, static_shapes)


def execution_precisions(compiled) -> dict[str, dict[str, int]]:
    """{layer type: {runtime precision: count}} from the executed graph (constants left out)."""
    return _runtime_counts(compiled, "runtimePrecision")


def compute_kernels(compiled) -> dict[str, dict[str, int]]:
    """{compute layer type: {kernel: count}}, e.g. brgconv_avx512_amx_I8: which ISA really runs the math."""
    return _runtime_counts(compiled, "primitiveType", COMPUTE_LAYERS)


def _runtime_counts(compiled, key: str, layers: tuple[str, ...] | None = None) -> dict[str, dict[str, int]]:
    counts: dict[str, Counter] = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        layer = info["layerType"].astype(str)
        if layer == "Const" or (layers is not None and layer not in layers):
            continue
        counts.setdefault(layer, Counter())[info[key].astype(str)] += 1
    return {layer: dict(sorted(c.items())) for layer, c in sorted(counts.items())}


def _onnx_io_names(compiled, onnx_path: Path) -> tuple[list[str], list[str]]:
    """Input/output names as the ONNX graph spells them (an OpenVINO port may carry several names)."""
    import onnx

    wanted: set[str] = set()
    if onnx_path.suffix == ".onnx":  # an OpenVINO IR (.xml) keeps its own names
        graph = onnx.load(str(onnx_path), load_external_data=False).graph
        wanted = {v.name for v in graph.input} | {v.name for v in graph.output}

    def pick(port) -> str:
        return next((n for n in sorted(port.get_names()) if n in wanted), port.get_any_name())

    return [pick(p) for p in compiled.inputs], [pick(p) for p in compiled.outputs]


def _verify_precision(compiled, precision: Precision) -> dict[str, dict[str, int]]:
    """Read back what runs; refuse an fp32 build with non-f32 compute or an int8 build without int8."""
    actual = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
    if actual != HINTS[precision]:
        raise Unsupported(f"OpenVINO runs {actual} although {HINTS[precision]} was requested for {precision.value}")
    by_layer = execution_precisions(compiled)
    compute = {k: v for k, v in by_layer.items() if k in COMPUTE_LAYERS}
    if precision is Precision.fp32 and any(set(v) - {"f32"} for v in compute.values()):
        raise Unsupported(f"OpenVINO fp32 build runs compute layers in other precisions: {compute}")
    if precision is Precision.int8 and not any(set(v) & {"u8", "i8"} for v in compute.values()):
        raise Unsupported(f"OpenVINO ran no compute layer in int8 (Q/DQ pattern not recognised): {compute}")
    return by_layer


def _save_blob(compiled, blob_path: Path, meta: dict[str, Any]) -> tuple[Path, Path]:
    """Write the exported blob, then its meta (with the blob's sha256); both atomically."""
    blob_path.parent.mkdir(parents=True, exist_ok=True)
    blob = compiled.export_model()
    blob = blob.getvalue() if isinstance(blob, io.BytesIO) else bytes(blob)
    write_bytes(blob_path, blob)
    meta_path = blob_path.with_suffix(".blob.json")
    write_json(meta_path, {**meta, "sha256": hashlib.sha256(blob).hexdigest()})
    return blob_path, meta_path


@dataclass(frozen=True)
class StaticCompiler:
    """Builds one static compile per input-shape signature, with the build's config, each verified."""

    path: Path
    config: dict[str, str]
    precision: Precision

    def read(self):
        return _read(self.path)

    def compile(self, model, shapes: dict[str, list[int]]):
        compiled = _compile_model(model, self.config, shapes)
        _verify_precision(compiled, self.precision)
        return compiled


class OpenVinoBackend:
    name = "openvino"
    extra = "openvino"
    compiles_for_shapes = True  # compile() takes the deployment's resolved input shapes (see base.Backend)

    def available(self) -> Availability:
        try:
            import openvino  # noqa: F401
        except ImportError:
            return Availability(False, "openvino is not installed (pip install 'accel-opt[openvino]')")
        if DEVICE not in _core().available_devices:
            return Availability(False, "OpenVINO sees no CPU device")
        return Availability(True)

    def supports(self, precision: Precision) -> Availability:
        return precision_support(precision, cpu_flags(), capabilities())

    def compile(
        self,
        onnx_path: Path,
        precision: Precision,
        recipe: Recipe,
        workdir: Path,
        performance_hint: str = "LATENCY",
        num_streams: int = 1,
        *,
        shapes: dict[str, list[int]] | None = None,
    ) -> CompiledModel:
        """Compile on the CPU with the precision hint set, verify what runs, and save the blob.

        `shapes`: the deployment's input shapes at its batch size (the pipeline passes them). Unless
        `recipe.dynamic_shapes`, the build is static: the saved blob is compiled for exactly `shapes`,
        and the runner compiles every other input-shape set it is fed for exactly that set (so one
        runner still sweeps batch sizes). Without `shapes` the blob keeps the model's own shapes
        (static only where the model fixes them). With `recipe.dynamic_shapes` one dynamic compile
        serves every shape.
        """
        support = self.supports(precision)
        if not support:
            raise Unsupported(f"OpenVINO {precision.value}: {support.reason}")
        onnx_path = Path(onnx_path)
        threads = recipe.benchmark.threads or available_cpus()
        config = {
            "INFERENCE_PRECISION_HINT": HINTS[precision],
            "PERFORMANCE_HINT": performance_hint,
            "NUM_STREAMS": str(num_streams),
            "INFERENCE_NUM_THREADS": str(threads),
        }
        start = time.perf_counter()
        model = _read(onnx_path)
        shape_mode = "dynamic" if recipe.dynamic_shapes else "static"
        blob_shapes = None if recipe.dynamic_shapes or not shapes else {name: list(dims) for name, dims in shapes.items()}
        compiled = _compile_model(model, config, blob_shapes)
        build_seconds = time.perf_counter() - start

        by_layer = _verify_precision(compiled, precision)
        inputs, outputs = _onnx_io_names(compiled, onnx_path)
        if blob_shapes is None and all(port.get_partial_shape().is_static for port in compiled.inputs):
            blob_shapes = {name: list(port.get_shape()) for name, port in zip(inputs, compiled.inputs)}  # fixed by the model
        meta = {
            **environment(),
            "precision": precision.value,
            "config": config,
            "static_shapes": blob_shapes,
            "execution_precision_by_layer_type": by_layer,
            "source_sha256": sha256_file(onnx_path),
        }
        blob_path, meta_path = _save_blob(compiled, Path(workdir) / f"{onnx_path.stem}.openvino-{precision.value}.blob", meta)
        settings = {
            "compile_config": config,
            "properties": {key: str(compiled.get_property(key)) for key in READ_BACK},
            "inference_precision": HINTS[precision],
            "execution_precision_by_layer_type": by_layer,
            "kernels_by_layer_type": compute_kernels(compiled),
            # static: one compile per input-shape set (the runner compiles each on first use);
            # dynamic: one compile for every shape. static_shapes: what the saved blob was compiled for.
            "shape_mode": shape_mode,
            "static_shapes": blob_shapes,
            "input_names": inputs,
            "output_names": outputs,
            "optimization_capabilities": list(capabilities()),
            **{key: meta[key] for key in ("openvino_version", "cpu_model", "cpu_isa_flags")},
            "blob": blob_path.name,
        }
        return CompiledModel(
            backend=self.name,
            path=onnx_path,
            precision=precision,
            device="cpu",
            providers=[f"OpenVINO {DEVICE}"],
            threads=threads,
            build_seconds=build_seconds,
            settings=settings,
            extra_files=[blob_path, meta_path],
        )

    def runner(self, compiled: CompiledModel) -> OpenVinoRunner:
        settings = compiled.settings
        static = None
        if settings["shape_mode"] == "static":
            static = StaticCompiler(compiled.path, settings["compile_config"], compiled.precision)
        # A static runner starts from the saved blob only where that blob is static (its own shapes).
        has_start = static is None or settings["static_shapes"]
        return OpenVinoRunner(
            (lambda: load_compiled(compiled)) if has_start else (lambda: None),
            settings["input_names"],
            settings["output_names"],
            name=f"{self.name}-{compiled.precision.value}",
            static=static,
        )

    def synchronize(self) -> None:
        return None

    def concurrency_sweep(self, compiled: CompiledModel, feed: dict[str, np.ndarray], seconds: float) -> list[dict[str, Any]]:
        """Threads x streams x performance hint: LATENCY with one stream at 1..threads threads, then
        THROUGHPUT with 1..threads streams (one async request in flight per stream)."""
        cores = max(1, compiled.threads)
        configs = [("LATENCY", 1, t) for t in range(1, cores + 1)] + [("THROUGHPUT", s, cores) for s in range(1, cores + 1)]
        return [throughput(compiled, feed, streams, seconds, hint, threads) for hint, streams, threads in configs]


def load_compiled(compiled: CompiledModel):
    """The openvino.CompiledModel in the saved blob, the model that was checked. A blob compiled for another CPU
    (model, ISA flags, or a oneDNN ISA cap here) is not imported: the folder's model.onnx, the graph the blob was
    compiled from, is compiled here with the recorded config instead, and said so; on another CPU class the
    runtime re-checks that build on the folder's probe set before it runs (runtime.probe). Another OpenVINO
    version is refused earlier, by runtime.check."""
    blob = next((p for p in compiled.extra_files if p.suffix == ".blob"), None)
    model = None
    if blob is not None:
        meta_path = blob.with_suffix(blob.suffix + ".json")
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as exc:
            raise Unsupported(f"OpenVINO blob {blob.name} cannot run here: its description {meta_path.name} is "
                              f"unreadable ({exc})") from None
        if hashlib.sha256(blob.read_bytes()).hexdigest() != meta.get("sha256"):  # altered: what was checked is gone
            raise Unsupported(f"OpenVINO blob {blob.name} cannot run here: its content does not match its recorded "
                              "sha256; rebuild the artifact")
        reason = blob_mismatch(meta)
        threads = compiled.settings.get("compile_config", {}).get("INFERENCE_NUM_THREADS")
        if threads is not None:  # the deployment's thread count (runtime.load may override the build's) wins
            meta = {**meta, "config": {**(meta.get("config") or {}), "INFERENCE_NUM_THREADS": threads}}
        model = load_cached_blob(blob, meta) if reason is None else None
        if model is None:
            log.warning("OpenVINO blob %s was compiled for another CPU (%s): compiling %s here with its recorded config",
                        blob.name, reason or "it does not import as recorded", compiled.path.name)
    if model is None:
        model = _compile(compiled.path, compiled.settings["compile_config"], compiled.settings["static_shapes"])
        _verify_precision(model, compiled.precision)
    return model


class OpenVinoRunner(BaseRunner):
    """A Polygraphy runner; outputs keyed by the ONNX output names.

    Dynamic (`static` None): the model from `load()` serves every input shape through one InferRequest.
    Static: each distinct input-shape set runs on a model compiled for exactly those shapes by
    `static` on first use and kept (at most MAX_STATIC_COMPILES, least recently used dropped);
    `load()` (None: nothing yet) gives the saved build, used for its own shapes. `compiled_shapes`
    lists the shape sets this runner compiled. Compile time is not part of `inference_time`.
    """

    def __init__(
        self,
        load: Callable[[], Any],
        input_names: list[str],
        output_names: list[str],
        name: str | None = None,
        static: StaticCompiler | None = None,
    ):
        super().__init__(name=name, prefix="openvino-runner")
        self._load = load
        self._input_names = input_names
        self._output_names = output_names
        self._static = static
        self.compiled_shapes: list[dict[str, list[int]]] = []

    def activate_impl(self):
        self.compiled = self._load()
        self._requests: OrderedDict[tuple, Any] = OrderedDict()
        if self._static is None:
            self.request = self.compiled.create_infer_request()
            return
        self._source = self._static.read()
        if self.compiled is not None:
            key = tuple(tuple(port.get_shape()) for port in self.compiled.inputs)
            self._requests[key] = self.compiled.create_infer_request()

    def get_input_metadata_impl(self):
        ports = self._source.inputs if self._static is not None else self.compiled.inputs
        meta = TensorMetadata()
        for name, port in zip(self._input_names, ports, strict=True):
            shape = [None if d.is_dynamic else d.get_length() for d in port.get_partial_shape()]
            meta.add(name, dtype=port.get_element_type().to_dtype(), shape=shape)
        return meta

    def _request_for(self, feed_dict):
        if self._static is None:
            return self.request
        key = tuple(tuple(np.shape(feed_dict[name])) for name in self._input_names)
        request = self._requests.get(key)
        if request is None:
            shapes = {name: list(dims) for name, dims in zip(self._input_names, key)}
            log.debug("%s: compiling for %s", self.name, shapes)
            request = self._static.compile(self._source, shapes).create_infer_request()
            self.compiled_shapes.append(shapes)
            self._requests[key] = request
            while len(self._requests) > MAX_STATIC_COMPILES:
                self._requests.popitem(last=False)
        self._requests.move_to_end(key)
        return request

    def infer_impl(self, feed_dict):
        request = self._request_for(feed_dict)
        start = time.perf_counter()
        results = request.infer(feed_dict, share_inputs=True, share_outputs=False)
        self.inference_time = time.perf_counter() - start
        return dict(zip(self._output_names, results.to_tuple(), strict=True))

    def deactivate_impl(self):
        self.request = None
        self._requests.clear()
        self._source = None
        self.compiled = None


def throughput(
    compiled: CompiledModel, feed: dict[str, np.ndarray], streams: int, seconds: float,
    hint: str = "THROUGHPUT", threads: int | None = None,
) -> dict[str, Any]:
    """Samples/s and latency percentiles with `streams` streams and as many requests in flight."""
    from openvino import AsyncInferQueue

    threads = threads or compiled.threads
    config = {**compiled.settings["compile_config"], "PERFORMANCE_HINT": hint, "NUM_STREAMS": str(streams),
              "INFERENCE_NUM_THREADS": str(threads)}
    static = compiled.settings["shape_mode"] == "static"
    model = _compile(compiled.path, config, {name: list(a.shape) for name, a in feed.items()} if static else None)
    _verify_precision(model, compiled.precision)
    queue = AsyncInferQueue(model, streams)
    latencies: list[float] = []
    queue.set_callback(lambda _request, started: latencies.append(time.perf_counter() - started))
    for _ in range(streams):  # warm-up: one pass per request
        queue.start_async(feed, time.perf_counter(), share_inputs=True)
    queue.wait_all()
    latencies.clear()
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        queue.start_async(feed, time.perf_counter(), share_inputs=True)
    queue.wait_all()
    wall = time.perf_counter() - start
    batch = int(next(iter(feed.values())).shape[0])
    ms = np.asarray(latencies) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {
        "hint": hint,
        "threads": threads,
        "streams": int(model.get_property("NUM_STREAMS")),
        "requests": streams,
        "batch_size": batch,
        "iterations": len(ms),
        "samples_per_s": len(ms) * batch / wall,
        "p50_ms": float(p50),
        "p90_ms": float(p90),
        "p99_ms": float(p99),
    }
