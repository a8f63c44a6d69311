"""`accel-opt run` on a torch artifact that takes images: the whole job on the artifact's device.

Reader threads read each file's bytes; on a CPU, and for files the device decoder does not take (not JPEG, or
rejected by it), they decode them with Pillow, the host path's decoder, into pinned memory when the device is a GPU.
On a CPU the readers also resize and crop (the same tensor code, run where the cores are: the main thread would
otherwise resize every image alone).
The job thread then runs each batch through the stages of preprocess/tensor_images on the artifact's device:
- decode: JPEGs in one call on the device (nvJPEG through torchvision, CUDA only);
- h2d: host-decoded pixels copied on a side stream from pinned memory, issued for the next batch before the
  previous batch's results are waited for, so the copies overlap its compute;
- preprocess: resize, crop, normalize as tensor ops where the model runs;
- compute: the package;
- d2h: only what is written comes back, the top-k pairs for a classifier (else every output).
Each device stage is timed with CUDA events on the stream it runs on (synchronized before reading; perf_counter on a
CPU, where every op is synchronous), and the slowest stage is named in the summary.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from accel_opt.errors import InputRejected, Unsupported, UsageError
from accel_opt.machine.cpu import available_cpus
from accel_opt.preprocess.postprocess import labeled
from accel_opt.runtime import Deployment
from accel_opt.runtime.inputs import NPZ, local_path
from accel_opt.runtime.output import Outputs, Writer

DEVICE_STAGES = ("decode", "h2d", "preprocess", "compute", "d2h")


def takes_device_path(deployment: Deployment) -> bool:
    """A torch artifact with one input, whose recorded preprocessing takes images (not fused into a graph)."""
    config = deployment.config
    return config.backend == "torch" and config.preprocessing is not None and not config.preprocessing.fused \
        and len(config.inputs) == 1


@dataclass
class _Item:
    path: str
    name: str
    blob: bytes | None  # for the device decoder
    pixels: Any = None  # host-decoded uint8 HWC tensor (pinned on a GPU), when the device does not decode it
    cropped: bool = False  # `pixels` is the crop already (readers crop on a CPU)
    host_reason: str | None = None  # why the host decoded it


@dataclass
class _Staged:
    items: list[_Item]
    images: list[Any]  # decoded uint8 HWC, on the device (or on their way there on the copy stream)
    ready: Any = None  # the copy stream's event the compute stream waits for
    rejected: dict[int, str] = field(default_factory=dict)


class _Clock:
    """Seconds per stage: CUDA events on the stream each stage runs on (read once the batch is synchronized), or
    perf_counter on a CPU."""

    def __init__(self, torch: Any, cuda: bool):
        self.torch, self.cuda = torch, cuda
        self.seconds = {stage: 0.0 for stage in DEVICE_STAGES}
        self._open: list[tuple[str, Any, Any]] = []

    def run(self, stage: str, stream: Any, work: Callable[[], Any]) -> Any:
        if not self.cuda:
            start = time.perf_counter()
            result = work()
            self.seconds[stage] += time.perf_counter() - start
            return result
        begin, end = (self.torch.cuda.Event(enable_timing=True) for _ in range(2))
        begin.record(stream)
        with self.torch.cuda.stream(stream):
            result = work()
        end.record(stream)
        self._open.append((stage, begin, end))
        return result

    def settle(self) -> None:
        """Add the elapsed times of every recorded stage (after their events have completed)."""
        for stage, begin, end in self._open:
            end.synchronize()
            self.seconds[stage] += begin.elapsed_time(end) / 1e3
        self._open = []


@dataclass
class DeviceJob:
    """What predict_on_device did: counts, stage seconds, reader threads, batch size, and the inputs the host decoded
    instead of the device, by reason (a GPU job's summary says so: nothing silent)."""

    predicted: int
    rejected: int
    stages: dict[str, float]
    workers: int
    batch_size: int
    host_decoded: dict[str, int]


def refuse_host_decoding(deployment: Deployment) -> None:
    """--strict-device, before anything is written: the artifact must run images on a device that decodes them (exit 2
    for an artifact without the device path, exit 4 for a device without a decoder)."""
    from accel_opt.preprocess.tensor_images import device_decoder_available, no_device_decoder

    device = deployment.config.device
    if not takes_device_path(deployment):
        raise UsageError(f"--strict-device: {deployment.folder.name} does not run images on a device (a torch artifact "
                         "with image preprocessing does)")
    if not device_decoder_available(device):
        raise Unsupported(f"--strict-device: {deployment.folder.name} runs on {device}, {no_device_decoder(device)}: "
                          "every image would be decoded on the host")


def predict_on_device(deployment: Deployment, remaining: list[str], outputs: Outputs, workers: int | None,
                      on_progress: Callable[[int, int], None] | None, strict: bool = False) -> DeviceJob:
    """The job over `remaining`. `strict` (--strict-device; refuse_host_decoding first): an image the device does not
    decode (not a JPEG, refused by nvJPEG) is rejected into the errors file instead of decoded on the host."""
    import torch

    from accel_opt.preprocess.tensor_images import (
        JPEG_SUFFIXES,
        NOT_JPEG,
        TensorImagePath,
        host_decode,
        no_device_decoder,
        top_k_on_device,
    )


    config = deployment.config
    pre, device = config.preprocessing, config.device
    cuda = device.startswith("cuda")
    path = TensorImagePath(pre, device, strict=strict)
    writer = Writer(outputs, config.postprocess, config.outputs[0].name)
    batch_size = config.batch_size if config.output_batch_axes else 1
    workers = workers or max(1, available_cpus())
    clock = _Clock(torch, cuda)
    compute_stream = torch.cuda.current_stream(device) if cuda else None
    copy_stream = torch.cuda.Stream(device) if cuda else None
    read_seconds: list[float] = []
    host_decoded: dict[str, int] = {}

    def read(item_path: str) -> _Item:  # a reader thread
        start = time.perf_counter()
        try:
            file = Path(local_path(item_path) or item_path)
            if not file.is_file():
                raise InputRejected("not found" if not file.exists() else "not a regular file")
            if file.suffix == NPZ:
                raise InputRejected(".npz feed dicts go to this artifact without its image path: run them apart")
            blob = file.read_bytes()
            if path.on_device_decoder and file.suffix.lower() in JPEG_SUFFIXES:
                return _Item(item_path, file.name, blob)
            why = NOT_JPEG if path.on_device_decoder else no_device_decoder(device)
            if strict:
                raise InputRejected(f"decoded on the host, not the device: {why} (--strict-device)")
            pixels = torch.from_numpy(np.array(host_decode(blob, pre)))
            if not cuda:
                return _Item(item_path, file.name, None, path.crop(pixels), cropped=True, host_reason=why)
            return _Item(item_path, file.name, None, pixels.pin_memory(), host_reason=why)
        finally:
            read_seconds.append(time.perf_counter() - start)

    def stage(items: list[_Item]) -> _Staged:
        """Decode on the device what it decodes; copy the host-decoded rest on the side stream."""
        staged = _Staged(items, [None] * len(items))
        reasons = [item.host_reason for item in items if item.host_reason]
        on_device = [i for i, item in enumerate(items) if item.blob is not None]
        if on_device:
            decoded = clock.run("decode", compute_stream, lambda: path.decode([items[i].blob for i in on_device],
                                                                                 [items[i].name for i in on_device]))
            reasons += decoded.host_reasons.values()
            for j, i in enumerate(on_device):
                if j in decoded.rejected:
                    staged.rejected[i] = decoded.rejected[j]
                else:
                    staged.images[i] = decoded.images[j]
        for why in reasons:
            host_decoded[why] = host_decoded.get(why, 0) + 1
        host = [i for i, item in enumerate(items) if item.blob is None]
        if host:
            copied = clock.run("h2d", copy_stream,
                               lambda: [items[i].pixels.to(device, non_blocking=True) for i in host])
            for i, image in zip(host, copied):
                staged.images[i] = image
            if cuda:
                staged.ready = torch.cuda.Event()
                staged.ready.record(copy_stream)
        return staged

    def launch(staged: _Staged, runner: Any) -> tuple[_Staged, list[int], Any]:
        """Preprocess and run one staged batch on the compute stream, padded to the deployed batch; returns the
        rows' outputs (or top-k) still on the device."""
        if staged.ready is not None:
            compute_stream.wait_event(staged.ready)
            for image in staged.images:  # made on the copy stream, used on this one: not reused before it is done
                if image is not None:
                    image.record_stream(compute_stream)
        good = [i for i in range(len(staged.items)) if i not in staged.rejected]
        if not good:
            return staged, good, None
        images = [staged.images[i] for i in good]
        images += [images[-1]] * (batch_size - len(images))  # static batch, as the gate ran it
        cropped = staged.items[good[0]].cropped
        batch = clock.run("preprocess", compute_stream, lambda: path.batch(images, cropped=cropped))
        outs = clock.run("compute", compute_stream, lambda: runner.infer_tensors([batch]))
        return staged, good, outs

    def finish(launched: tuple[_Staged, list[int], Any]) -> tuple[int, int]:
        """Copy back what is written, write it; (predicted, rejected) of the batch."""
        nonlocal written
        staged, good, outs = launched
        for i, reason in staged.rejected.items():
            writer.reject(staged.items[i].path, reason)
        if not good:
            return 0, len(staged.rejected)
        paths = [staged.items[i].path for i in good]
        post = config.postprocess
        if post is not None and post.topk is not None:
            scores = outs[[o.name for o in config.outputs].index(post.output or config.outputs[0].name)]
            indices, values = clock.run("d2h", compute_stream, lambda: top_k_on_device(scores, post.topk, post.softmax))
            clock.settle()
            records = [labeled(post, {"top1": int(ix[0]), "topk": [[int(c), round(float(s), 6)] for c,
                                                                   s in zip(ix, vs)]})
                       for ix, vs in zip(indices[: len(good)], values[: len(good)])]
            start = time.perf_counter()
            count = writer.predict_records(paths, records)
        else:
            arrays = clock.run("d2h", compute_stream, lambda: [o.cpu().numpy() for o in outs])
            clock.settle()
            per_input = [{o.name: a[row:row + 1] for o, a in zip(config.outputs, arrays)} for row in range(len(good))]
            start = time.perf_counter()
            count = writer.predict(paths, per_input)
        written += time.perf_counter() - start
        return count, len(staged.rejected)

    predicted = rejected = 0
    waited = written = 0.0
    window = 4 * workers + 2 * batch_size
    with ThreadPoolExecutor(workers, thread_name_prefix="accel-opt-read") as pool, writer:
        pending: deque[tuple[str, Future]] = deque()
        queue = iter(remaining)

        def refill() -> None:
            for item_path in queue:
                pending.append((item_path, pool.submit(read, item_path)))
                if len(pending) >= window:
                    return

        def batches() -> Iterator[list[_Item]]:
            nonlocal rejected, waited
            items: list[_Item] = []
            while pending:
                item_path, future = pending.popleft()
                refill()
                start = time.perf_counter()
                try:
                    items.append(future.result())
                except InputRejected as exc:
                    writer.reject(item_path, str(exc))
                    rejected += 1
                waited += time.perf_counter() - start
                if len(items) == batch_size or (not pending and items):
                    yield items
                    items = []

        refill()  # the first files are read while the package loads
        with deployment.runner() as runner:
            previous = None
            for items in itertools.chain(batches(), [None]):  # None: the last launched batch is finished after it
                staged = stage(items) if items else None  # its copies and decoding overlap the previous compute
                if previous is not None:
                    done, bad = finish(previous)
                    predicted, rejected = predicted + done, rejected + bad
                    if on_progress:
                        on_progress(predicted + rejected, len(remaining))
                previous = launch(staged, runner) if staged is not None else None
    stages = {"read": sum(read_seconds), "wait_for_inputs": waited, **clock.seconds, "write": written}
    return DeviceJob(predicted, rejected, stages, workers, batch_size, host_decoded)
