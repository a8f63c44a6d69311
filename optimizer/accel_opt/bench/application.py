"""The application around the model: where a batch's time goes, and the whole job, naive against accel-opt's.

`stage_times` splits one batch into read, decode, preprocess, host-to-device, compute, device-to-host
and postprocess, each measured on its own: the host stages per input on the real files (one core,
median), summed over the batch; compute is the harness's p50 for that batch; h2d/d2h are zero on CPU
backends, where the model reads host memory. `job_times` runs the whole job twice on the same files,
in this process: the naive one (read, decode, preprocess and the fp32 model one input at a time) and
`accel-opt run`'s pipeline on the deployed artifact, timed end to end, not derived from a latency.
"""

from __future__ import annotations

import io
import statistics
import time
from pathlib import Path

import numpy as np
from polygraphy.backend.base import BaseRunner
from pydantic import BaseModel

from accel_opt.preprocess.images import IMAGE_SUFFIXES, decode_image, preprocess_image
from accel_opt.recipe.deployed import Postprocess, Preprocessing

STAGE_FILES = 32  # files the host stages are timed on
JOB_FILES = 64  # files the naive and the accel-opt job each process
CPU_NOTE = "h2d and d2h are 0 on a CPU backend: the model reads and writes host memory"
DEVICE_STAGE_CALLS = 10
DEVICE_NOTE = f"h2d / compute / d2h: medians of {DEVICE_STAGE_CALLS} calls, each stage ended by a synchronization"


class StageTimes(BaseModel):
    batch_size: int
    read_ms: float
    decode_ms: float
    preprocess_ms: float
    h2d_ms: float
    compute_ms: float
    d2h_ms: float
    postprocess_ms: float
    bottleneck: str  # the largest stage


class JobTiming(BaseModel):
    pipeline: str  # "naive" or "accel-opt run"
    description: str
    inputs: int
    seconds: float  # the whole job, measured
    per_input_ms: float
    inputs_per_s: float
    bottleneck: str


def data_files(data_dir: Path) -> list[Path]:
    """The files a build read its samples from (images, .npz or text files), sorted as it read them."""
    from accel_opt.preprocess.text import is_text_file

    if data_dir.is_file():
        return [data_dir]
    npz = sorted(p for p in data_dir.iterdir() if p.suffix == ".npz" and p.is_file())
    return npz or sorted(p for p in data_dir.iterdir() if p.is_file() and (
        p.suffix.lower() in IMAGE_SUFFIXES or is_text_file(p)))


def text_host_stage_ms(files: list[Path], encoder) -> dict[str, float]:
    """Median ms per text of reading it (its share of its file's read) and tokenizing it alone (one core)."""
    from accel_opt.preprocess.text import read_texts

    start = time.perf_counter()
    texts = [item.text for path in files for item in read_texts(str(path), encoder.stage.field) if item.error is None]
    read_ms = (time.perf_counter() - start) * 1e3 / max(1, len(texts))
    tokenize = []
    for text in texts[:STAGE_FILES]:
        begin = time.perf_counter()
        encoder.encode([text])
        tokenize.append(time.perf_counter() - begin)
    return {"read": read_ms / 1e3, "decode": 0.0, "preprocess": statistics.median(tokenize) if tokenize else 0.0}


def naive_text_job(files: list[Path], runner: BaseRunner, encoder, batch: int) -> JobTiming:
    """What a script does: read the texts, then per batch of `batch` in input order tokenize them padded to max_length,
    run the fp32 model (the embeddings are the first output: pooling is the model's or costs the same on both sides)."""
    from accel_opt.preprocess.text import pad_batch, read_texts

    start = time.perf_counter()
    texts = [item.text for path in files for item in read_texts(str(path), encoder.stage.field) if item.error is None]
    length = encoder.stage.max_length
    with runner:
        for first in range(0, len(texts), batch):
            rows = [feed for feed, _, _ in encoder.encode(texts[first:first + batch]) if feed is not None]
            # every row to max_length
            runner.infer(pad_batch(rows, encoder.padding.values, (length,)), check_inputs=False)
    seconds = time.perf_counter() - start
    return timing("naive", f"texts tokenized per batch of {batch} and padded to max_length {length}, the fp32 model on "
                   "ONNX Runtime, in input order", len(texts), seconds, "compute on padding")


def host_stage_ms(files: list[Path], pre: Preprocessing | None) -> dict[str, float]:
    """Median ms per input of reading the file's bytes, decoding them, and preprocessing (one core)."""
    from PIL import Image

    read, decode, prep = [], [], []
    clock = time.perf_counter
    for path in files[:STAGE_FILES]:
        start = clock()
        data = path.read_bytes()
        read_end = clock()
        if path.suffix == ".npz":
            with np.load(io.BytesIO(data), allow_pickle=False) as archive:
                [archive[name] for name in archive.files]  # npz members load lazily: read them all
            decode_end = prep_end = clock()
        else:
            with Image.open(io.BytesIO(data)) as img:
                rgb = decode_image(img, pre)
            decode_end = clock()
            preprocess_image(rgb, pre)
            prep_end = clock()
        read.append(read_end - start)
        decode.append(decode_end - read_end)
        prep.append(prep_end - decode_end)
    return {k: statistics.median(v) * 1e3 for k, v in (("read", read), ("decode", decode), ("preprocess", prep))}


def postprocess_ms(outputs: dict[str, np.ndarray], post: Postprocess | None, first_output: str, batch: int) -> float:
    """ms to turn one batch's outputs into per-input answers (top-k, an embedding, or one .npz each)."""
    from accel_opt.preprocess.postprocess import embedding_record, topk_record

    rows = [{name: np.asarray(a)[i:i + 1] if np.ndim(a) and np.shape(a)[0] == batch else a for name,
             a in outputs.items()}
            for i in range(batch)]
    start = time.perf_counter()
    for row in rows:
        if post is not None and post.embedding is not None:  # pooling costs little next to writing the vector
            embedding_record(row[post.embedding.output or first_output])
        elif post is not None:
            topk_record(post, row, first_output)
        else:
            np.savez(io.BytesIO(), **row)
    return (time.perf_counter() - start) * 1e3


def stage_times(host_ms: dict[str, float], compute_ms: float, post_ms: float, batch: int,
                device_ms: dict[str, float] | None = None) -> StageTimes:
    """One batch's stages; `device_ms` (a GPU runner's h2d_ms / compute_ms / d2h_ms) replaces the CPU's 0 / p50 / 0."""
    device = device_ms or {"h2d_ms": 0.0, "compute_ms": compute_ms, "d2h_ms": 0.0}
    stages = {"read_ms": host_ms["read"] * batch, "decode_ms": host_ms["decode"] * batch,
              "preprocess_ms": host_ms["preprocess"] * batch, "h2d_ms": device["h2d_ms"],
              "compute_ms": device["compute_ms"],
              "d2h_ms": device["d2h_ms"], "postprocess_ms": post_ms}
    return StageTimes(batch_size=batch, bottleneck=max(stages, key=stages.get).removesuffix("_ms"), **stages)


def naive_job(files: list[Path], runner: BaseRunner, pre: Preprocessing | None, input_name: str) -> JobTiming:
    """One input after another: read, decode, preprocess, the fp32 model at batch 1."""
    from PIL import Image

    start = time.perf_counter()
    with runner:
        for path in files:
            if path.suffix == ".npz":
                with np.load(path, allow_pickle=False) as archive:
                    feed = {name: archive[name] for name in archive.files}
            else:
                with Image.open(path) as img:
                    feed = {input_name: preprocess_image(img.convert("RGB"), pre)}
            runner.infer(feed, check_inputs=False)
    seconds = time.perf_counter() - start
    return timing("naive", "read, decode, preprocess and the fp32 model at batch 1, one input after another",
                   len(files), seconds, "compute and host stages in series")


def timing(pipeline: str, description: str, inputs: int, seconds: float, bottleneck: str) -> JobTiming:
    return JobTiming(pipeline=pipeline, description=description, inputs=inputs, seconds=seconds,
                     per_input_ms=seconds / inputs * 1e3, inputs_per_s=inputs / seconds, bottleneck=bottleneck)

