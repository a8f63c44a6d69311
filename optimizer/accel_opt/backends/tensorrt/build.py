"""The TensorRT engine build, run in a child process: `python -m accel_opt.backends.tensorrt.build REQUEST.json`.

The parent (backends/tensorrt/backend.py) writes the request, runs this with a timeout and its output saved
to a log, and maps the outcome: exit 0 built; 3 the ONNX parser rejected the model; 5 out of GPU
memory; 1 the builder failed; 70 (or a signal) a crash, which is why this runs in its own process.
The result JSON says what was built. The network is strongly typed: precision comes from the
graph's types and Q/DQ nodes, and no precision BuilderFlag is ever set (TensorRT 11 removed them).
"""

from __future__ import annotations

import json
import re
import sys
import time
import traceback
from pathlib import Path

EXIT_BUILT, EXIT_FAILED, EXIT_INPUT, EXIT_OUT_OF_MEMORY, EXIT_CRASH = 0, 1, 3, 5, 70
# TensorRT's wording for allocation failures (its logger, "Error Code 2: OutOfMemory", CUDA's own).
OUT_OF_MEMORY = re.compile(r"out ?of ?memory|could not be allocated|cudaErrorMemoryAllocation|failed to allocate",
                           re.IGNORECASE)
# Version-specific names (see tests/backends/tensorrt/test_trt_conformance.py): each is read with getattr and a
# default, and the code works whichever way it resolves.
OPTIONAL_TRT_NAMES = {
    "NetworkDefinitionCreationFlag.STRONGLY_TYPED": "10.x opts in with it; 11.x networks are always strongly "
                                                    "typed (11.4 still accepts the flag)",
}


def _logger(trt):
    class Logger(trt.ILogger):
        """Prints warnings and errors to stderr (the parent's log file) and keeps the errors."""

        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, msg):
            if severity <= trt.ILogger.Severity.ERROR:
                self.errors.append(str(msg))
            if severity <= trt.ILogger.Severity.WARNING:
                print(f"[TensorRT] {msg}", file=sys.stderr, flush=True)

    return Logger()


def build(request: dict) -> tuple[int, dict]:
    """Build the engine `request` describes; (exit code, result)."""
    import tensorrt as trt

    logger = _logger(trt)
    trt.init_libnvinfer_plugins(logger, "")  # ONNX ops TensorRT implements as plugins
    builder = trt.Builder(logger)
    flags = 0
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if strongly_typed is not None:
        flags |= 1 << int(strongly_typed)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    result: dict = {"tensorrt_version": trt.__version__, "strongly_typed_flag": strongly_typed is not None}
    if not parser.parse_from_file(request["onnx"]):
        errors = [str(parser.get_error(i).desc()) for i in range(parser.num_errors)]
        return EXIT_INPUT, {**result, "message": f"the ONNX parser rejected the model: {'; '.join(errors[:3])}",
                            "errors": errors}

    config = builder.create_builder_config()
    config.clear_flag(trt.BuilderFlag.TF32)  # TF32 matmuls have a 10-bit mantissa: fp32 layers stay fp32
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(request["workspace_bytes"]))
    config.builder_optimization_level = int(request["optimization_level"])
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED  # the inspector then lists each layer's tensors
    if request["profile"]:
        profile = builder.create_optimization_profile()
        for name, shapes in request["profile"].items():
            profile.set_shape(name, shapes["min"], shapes["opt"], shapes["max"])
        config.add_optimization_profile(profile)
    seed = Path(request["timing_cache_in"]).read_bytes() if request.get("timing_cache_in") else b""
    cache = config.create_timing_cache(seed)
    config.set_timing_cache(cache, False)  # ignore_mismatch=False: TensorRT refuses a cache from other hardware

    start = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    result["build_seconds"] = time.perf_counter() - start
    if plan is None:
        errors = logger.errors or ["build_serialized_network returned None"]
        code = EXIT_OUT_OF_MEMORY if any(OUT_OF_MEMORY.search(e) for e in errors) else EXIT_FAILED
        return code, {**result, "message": errors[-1], "errors": errors}
    Path(request["engine"]).write_bytes(bytes(plan))
    Path(request["timing_cache_out"]).write_bytes(bytes(config.get_timing_cache().serialize()))
    result["hardware_compatibility_level"] = config.hardware_compatibility_level.name
    result["timing_cache_seeded"] = bool(seed)

    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(bytes(plan))
    if engine is None:
        return EXIT_FAILED, {**result, "message": "the engine just built does not deserialize", "errors": logger.errors}
    inspector = engine.create_engine_inspector()
    Path(request["layers_json"]).write_text(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
    result["device_memory_bytes"] = int(engine.device_memory_size_v2)
    io = []
    for index in range(engine.num_io_tensors):
        name = engine.get_tensor_name(index)
        io.append({"name": name, "mode": engine.get_tensor_mode(name).name, "dtype": engine.get_tensor_dtype(name).name,
                   "shape": list(engine.get_tensor_shape(name))})
    result["io"] = io
    return EXIT_BUILT, {**result, "message": "built"}


def main(argv: list[str]) -> int:
    request_path = Path(argv[0])
    request = json.loads(request_path.read_text())
    try:
        code, result = build(request)
    except Exception as exc:  # a Python-level failure inside TensorRT's bindings: report, exit as a crash
        traceback.print_exc()
        code, result = EXIT_CRASH, {"message": f"{type(exc).__name__}: {exc}"}
    Path(request["result"]).write_text(json.dumps(result, indent=2))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
