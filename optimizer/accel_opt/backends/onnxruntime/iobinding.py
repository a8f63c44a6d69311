"""The I/O-binding runner for ONNX Runtime's GPU execution providers, and the session it activates.

`OrtIoBindingRunner` times host-to-device, compute and device-to-host apart (gpu_timing.StageClock),
each stage ended by ONNX Runtime's own synchronizing call; `SessionFactory` creates its session on
activate, giving the TensorRT EP a private copy of the artifact's engine caches. Nothing here imports
onnxruntime at module level.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata
from polygraphy.datatype import DataType

from accel_opt.backends.gpu_timing import StageClock
from accel_opt.backends.onnxruntime.gpu import TrtEpCache


@contextlib.contextmanager
def private_trt_cache(engine_files: list[Path], timing_files: list[Path]):
    """(engine_dir, timing_dir): a private copy of an artifact's TensorRT EP caches. The EP rewrites its
    engine and profile when inputs leave the profile's range, and would write into the artifact (whose
    files are hashed) if pointed at it; it gets a copy instead. The copy is made after the runtime has
    verified the files' sha256 (runtime.load), and removed when the session closes."""
    root = Path(tempfile.mkdtemp(prefix="accel-opt-ort-trt-"))
    try:
        engine_dir, timing_dir = root / "engines", root / "timing"
        for folder, names in ((engine_dir, engine_files), (timing_dir, timing_files)):
            folder.mkdir()
            for path in names:
                shutil.copy2(path, folder / Path(path).name)
        yield engine_dir, timing_dir
    finally:
        shutil.rmtree(root, ignore_errors=True)


class SessionFactory:
    """A runner's session, created on activate; `close()` (on deactivate) releases what it set up.

    `create(trt_dirs)` makes the session; `trt_dirs` is (engine_dir, timing_dir) of a private copy of
    `trt_cache`'s files when the build has a TensorRT EP cache, else None.
    """

    def __init__(self, create: Callable[[tuple[Path, Path] | None], Any], trt_cache: TrtEpCache | None = None):
        self._create, self._trt_cache = create, trt_cache
        self._stack: contextlib.ExitStack | None = None

    def __call__(self) -> Any:
        self.close()
        self._stack = contextlib.ExitStack()
        dirs = None
        if self._trt_cache is not None:
            dirs = self._stack.enter_context(private_trt_cache(self._trt_cache.engine_files,
                                                               self._trt_cache.timing_files))
        try:
            return self._create(dirs)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None


class OrtIoBindingRunner(BaseRunner):
    """Runs an ONNX Runtime session through I/O binding on `device` ("cuda", or "cpu" where the EP reads
    host memory), timing each stage of a call apart:

    - h2d: `OrtValue.ortvalue_from_numpy(array, device, device_id)` per input, bound with
      `bind_ortvalue_input`, then `io_binding.synchronize_inputs()`;
    - compute: `run_with_iobinding` (outputs bound to the device with `bind_output(name, device, id)`),
      then `io_binding.synchronize_outputs()`;
    - d2h: `copy_outputs_to_cpu()` (numpy arrays, what `infer()` returns).

    `last_stage_ms` holds the last call's {"h2d_ms", "compute_ms", "d2h_ms"} (gpu_timing.StageClock);
    `inference_time` is the whole call (what an application waits for), or only the compute stage with
    `compute_only=True`. `session` is a session or a zero-argument callable returning one (called on
    activate); a callable with a `close()` (SessionFactory) is closed on deactivate.
    """

    def __init__(self, session: Any, name: str | None = None, device: str = "cuda", device_id: int = 0,
                 compute_only: bool = False):
        super().__init__(name=name, prefix="ort-iobinding-runner")
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
        self._session, self.device, self.device_id, self.compute_only = session, device, device_id, compute_only
        self.last_stage_ms: dict[str, float] = {}

    def activate_impl(self) -> None:
        import onnxruntime as ort

        self._ort = ort
        self.sess = self._session() if callable(self._session) else self._session
        self._output_names = [node.name for node in self.sess.get_outputs()]
        self._binding = self.sess.io_binding()
        self._clock = StageClock.host()  # each lap follows ORT's own synchronizing call

    def get_input_metadata_impl(self) -> TensorMetadata:
        meta = TensorMetadata()
        for node in self.sess.get_inputs():
            meta.add(node.name, dtype=DataType.from_dtype(node.type, "onnxruntime"), shape=node.shape)
        return meta

    def infer_impl(self, feed_dict: dict[str, Any]) -> OrderedDict[str, np.ndarray]:
        binding, clock, from_numpy = self._binding, self._clock, self._ort.OrtValue.ortvalue_from_numpy
        start = time.perf_counter()
        # Outputs are bound afresh each call: a binding keeps the previous run's output buffers, which
        # the next run would have to fill at their old shape (ORT refuses another batch size then).
        binding.clear_binding_outputs()
        for name in self._output_names:
            binding.bind_output(name, self.device, self.device_id)  # ORT allocates them on the device
        clock.start()
        bound = []  # the device copies stay alive until the run has read them
        for name, array in feed_dict.items():
            value = from_numpy(np.ascontiguousarray(array), self.device, self.device_id)
            binding.bind_ortvalue_input(name, value)
            bound.append(value)
        binding.synchronize_inputs()
        clock.lap("h2d")
        self.sess.run_with_iobinding(binding)
        binding.synchronize_outputs()
        clock.lap("compute")
        outputs = binding.copy_outputs_to_cpu()
        clock.lap("d2h")
        self.last_stage_ms = clock.finish()
        wall = time.perf_counter() - start
        self.inference_time = self.last_stage_ms["compute_ms"] / 1e3 if self.compute_only else wall
        del bound
        return OrderedDict(zip(self._output_names, outputs))

    def deactivate_impl(self) -> None:
        del self._binding
        del self.sess
        close = getattr(self._session, "close", None)
        if close is not None:
            close()
