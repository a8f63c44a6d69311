"""The PyTorch runner: a module (or a factory of one) on the CPU or a CUDA GPU, eager or compiled,
fp32 or autocast fp16/bf16, each call split into host-to-device, compute and device-to-host.

torch is an optional extra: it is imported inside functions only, and its absence (or the absence of
CUDA where a GPU is asked for) is an `Unsupported` error (exit 4) naming what to install.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections import OrderedDict
from typing import Any

import numpy as np
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata
from polygraphy.datatype import DataType

from accel_opt.backends.gpu_timing import StageClock
from accel_opt.errors import InputRejected, Unsupported, UsageError
from accel_opt.files import install_line
from accel_opt.graph.inspect import TensorSpec

TORCH_EXTRA = install_line("torch", "torch==2.13.0")


def require_torch() -> Any:
    """Import torch or raise Unsupported (exit 4) naming the extra to install."""
    try:
        import torch
    except ImportError:
        raise Unsupported(f"PyTorch models need torch: {TORCH_EXTRA}") from None
    return torch


def flatten_outputs(result: Any) -> list[Any]:
    """The tensors of a forward() result in order (tuples, lists, dicts flattened as torch.export does)."""
    import torch
    from torch.utils._pytree import tree_leaves

    return [leaf for leaf in tree_leaves(result) if isinstance(leaf, torch.Tensor)]


AUTOCAST_DTYPES = {"fp32": None, "fp16": "float16", "bf16": "bfloat16"}
TORCH_CUDA_HINT = ("install a CUDA build of torch on a machine with an NVIDIA GPU and driver (PyTorch's CUDA wheel "
                   "index, e.g. pip install torch --index-url https://download.pytorch.org/whl/cu126)")


def require_cuda(torch: Any, device: str = "cuda") -> None:
    """Unsupported (exit 4) naming what is missing when torch cannot run on `device`: a CPU-only torch
    build, no GPU or driver (machine/gpu.py's gpus says which), or a device index beyond those visible."""
    if torch.cuda.is_available():
        index = torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            raise Unsupported(f"PyTorch sees {torch.cuda.device_count()} CUDA device(s); {device} is not one of them "
                              "(check CUDA_VISIBLE_DEVICES)")
        return
    from accel_opt.machine.gpu import cuda_devices

    build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
    gpus = cuda_devices()
    if not gpus:
        seen = gpus.reason
    else:
        seen = (f"the driver sees {gpus.devices[0].name} (driver supports CUDA {gpus.driver_cuda_version}) but "
                "torch cannot use it")
    raise Unsupported(f"PyTorch on {device}: torch.cuda.is_available() is False: torch {torch.__version__} is {build}; "
                      f"{seen}; {TORCH_CUDA_HINT}")


class TorchRunner(BaseRunner):
    """Runs an nn.Module under torch.inference_mode; numpy in, numpy out, keyed like the ONNX model.

    `model` is a module or a factory (called on activate). Positional forward() arguments follow
    `inputs` order; tuple/dict results are flattened in order onto `output_names`.
    `torch.set_num_threads` is process-wide: it is set on activate and restored on deactivate.

    `device`: "cpu" or "cuda[:N]" (Unsupported, exit 4, when torch has no CUDA). `precision`: "fp32"
    (eager; on CUDA with TF32 off, restored on deactivate), "fp16" or "bf16" through
    `torch.autocast(device_type, dtype=...)`; reduced-precision outputs are returned as float32.
    `compile`: wrap the module in `torch.compile(backend=compile_backend)` (compiled on the first call,
    which the benchmark's warm-up absorbs).

    Every call is split into h2d / compute / d2h (gpu_timing.StageClock, `last_stage_ms`). On CUDA: inputs
    are staged into pinned host buffers (`pin_memory()`, reused per shape), copied with
    `non_blocking=True` on the runner's own stream, and each stage is bracketed by CUDA events read after
    the last one has completed; outputs are copied into pinned buffers the same way. `peak_memory_mib`:
    `torch.cuda.max_memory_allocated()` since activation (reset there). On the CPU the stages are
    perf_counter intervals (h2d and d2h are the zero-copy numpy <-> tensor views). `inference_time` is the
    whole call, or only the compute stage with `compute_only=True`.
    """

    def __init__(
        self,
        model: Any,
        inputs: list[TensorSpec],
        output_names: list[str],
        threads: int | None = None,
        name: str | None = None,
        device: str = "cpu",
        precision: str = "fp32",
        compile: bool = False,
        compile_backend: str = "inductor",
        compute_only: bool = False,
    ):
        super().__init__(name=name, prefix="torch-runner")
        precision = getattr(precision, "value", precision)
        if precision not in AUTOCAST_DTYPES:
            raise UsageError(f"PyTorch precision must be one of {', '.join(AUTOCAST_DTYPES)}, got {precision!r}")
        if not (device == "cpu" or re.fullmatch(r"cuda(:\d+)?", device)):
            raise UsageError(f"PyTorch device must be 'cpu' or 'cuda[:N]', got {device!r}")
        self._model, self.inputs, self.output_names, self.threads = model, list(inputs), list(output_names), threads
        self.device, self.precision, self.compile, self.compile_backend = device, precision, compile, compile_backend
        self.compute_only = compute_only
        self.last_stage_ms: dict[str, float] = {}
        self.peak_memory_mib: float | None = None

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def activate_impl(self) -> None:
        torch = require_torch()
        if self.on_cuda:
            require_cuda(torch, self.device)
        self._return_to_cpu = None
        self.model = self._load_model(torch)
        self._previous_threads = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        dtype = AUTOCAST_DTYPES[self.precision]
        self._autocast_dtype = getattr(torch, dtype) if dtype else None
        self._host_in: dict[str, Any] = {}
        self._host_out: dict[int, Any] = {}
        if self.on_cuda:
            self._previous_tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
            torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: TF32 rounds to a 10-bit mantissa
            torch.backends.cudnn.allow_tf32 = False
            self._stream = torch.cuda.Stream(device=self.device)
            torch.cuda.synchronize(self.device)  # the weights' copies are done before the first timed call
            torch.cuda.reset_peak_memory_stats(self.device)
            self._clock = StageClock.cuda_events(torch, self._stream)
        else:
            self._clock = StageClock.host()

    def _load_model(self, torch: Any) -> Any:
        """The callable the runner times: the module on its device (compiled when asked). A subclass loads another
        (runtime-compiled) form, such as an AOTInductor package."""
        model = self._model
        given = isinstance(model, torch.nn.Module)
        if not given:
            model = model()
        # Module.to() moves in place: a module the caller handed over goes back to the CPU on deactivate.
        self._return_to_cpu = model if given and self.on_cuda else None
        model = model.eval().to(self.device)
        return torch.compile(model, backend=self.compile_backend) if self.compile else model

    def get_input_metadata_impl(self) -> TensorMetadata:
        meta = TensorMetadata()
        for spec in self.inputs:
            meta.add(spec.name, dtype=DataType.from_dtype(np.dtype(spec.dtype)), shape=spec.shape)
        return meta

    def infer_impl(self, feed_dict: dict[str, Any]) -> OrderedDict[str, np.ndarray]:
        start = time.perf_counter()
        arrays = self._infer_cuda(feed_dict) if self.on_cuda else self._infer_cpu(feed_dict)
        wall = time.perf_counter() - start
        self.inference_time = self.last_stage_ms["compute_ms"] / 1e3 if self.compute_only else wall
        return OrderedDict(zip(self.output_names, arrays, strict=True))

    def _autocast(self, torch: Any) -> Any:
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast("cuda" if self.on_cuda else "cpu", dtype=self._autocast_dtype)

    def infer_tensors(self, args: list[Any]) -> list[Any]:
        """The outputs for inputs already on the runner's device, left there (float32): for a job that copies back
        only what it writes, such as a classifier's top-k. Runs on the current stream; nothing is synchronized."""
        import torch

        with torch.inference_mode(), self._autocast(torch):
            return self._outputs(torch, self.model(*args))

    def _outputs(self, torch: Any, result: Any) -> list[Any]:
        outputs = flatten_outputs(result)
        if len(outputs) != len(self.output_names):
            raise InputRejected(
                f"the PyTorch model returned {len(outputs)} tensors, the ONNX model has {len(self.output_names)} "
                "outputs"
            )
        return [t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in outputs]

    def _infer_cpu(self, feed_dict: dict[str, Any]) -> list[np.ndarray]:
        import torch

        clock = self._clock
        clock.start()
        args = [self._tensor(feed_dict[spec.name]) for spec in self.inputs]
        clock.lap("h2d")
        with torch.inference_mode(), self._autocast(torch):
            outputs = self._outputs(torch, self.model(*args))
        clock.lap("compute")
        arrays = [t.detach().cpu().numpy() for t in outputs]
        clock.lap("d2h")
        self.last_stage_ms = clock.finish()
        return arrays

    def _infer_cuda(self, feed_dict: dict[str, Any]) -> list[np.ndarray]:
        import torch

        clock, stream = self._clock, self._stream
        host = [self._pinned_input(torch, spec.name, feed_dict[spec.name]) for spec in self.inputs]
        with torch.cuda.stream(stream), torch.inference_mode():
            clock.start()
            args = [h.to(self.device, non_blocking=True) for h in host]
            clock.lap("h2d")
            with self._autocast(torch):
                outputs = self._outputs(torch, self.model(*args))
            clock.lap("compute")
            host_out = [self._pinned_output(torch, i, t) for i, t in enumerate(outputs)]
            for buffer, t in zip(host_out, outputs):
                buffer.copy_(t, non_blocking=True)
            clock.lap("d2h")
            self.last_stage_ms = clock.finish()  # waits for the last event: every copy has landed
        self.peak_memory_mib = torch.cuda.max_memory_allocated(self.device) / 2**20
        return [buffer.numpy().copy() for buffer in host_out]  # the pinned buffers are reused by the next call

    def _pinned_input(self, torch: Any, name: str, array: Any) -> Any:
        """`array` copied into this input's pinned host buffer (one per shape and dtype, reused); a tensor already
        on the runner's device (the device image path's output) is used as it is, with no round trip."""
        if isinstance(array, torch.Tensor) and array.device == torch.device(self.device):
            return array
        source = array if isinstance(array, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(array))
        buffer = self._host_in.get(name)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = self._host_in[name] = torch.empty(source.shape, dtype=source.dtype).pin_memory()
        buffer.copy_(source)
        return buffer

    def _pinned_output(self, torch: Any, index: int, tensor: Any) -> Any:
        buffer = self._host_out.get(index)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._host_out[index] = torch.empty(tensor.shape, dtype=tensor.dtype).pin_memory()
        return buffer

    @staticmethod
    def _tensor(array: Any) -> Any:
        import torch

        return array if isinstance(array, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(array))

    def deactivate_impl(self) -> None:
        import torch

        del self.model
        self._host_in, self._host_out = {}, {}
        torch.set_num_threads(self._previous_threads)
        if self.on_cuda:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self._previous_tf32
            del self._stream
            if self._return_to_cpu is not None:
                self._return_to_cpu.to("cpu")
                self._return_to_cpu = None
