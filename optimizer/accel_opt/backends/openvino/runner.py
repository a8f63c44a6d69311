"""A Polygraphy runner over OpenVINO compiled models (a compile per static input-shape set, LRU-bounded), and the
streams x async requests throughput probe behind the concurrency sweep."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata

from accel_opt.backends.base import CompiledModel
from accel_opt.backends.openvino.compile import StaticCompiler, _compile, _verify_precision

log = logging.getLogger(__name__)

MAX_STATIC_COMPILES = 8  # per runner; the least recently used compile goes first beyond this

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
