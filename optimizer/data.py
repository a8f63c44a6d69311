"""Samples: the one data contract of the project.

A sample is a feed dict `{input name: np.ndarray}`; a data set is a list of them. This is what
Polygraphy's data loaders, ORT's CalibrationDataReader and our benchmark all consume (adapted in
one place each). Sources: a folder of `.npz` feed dicts, a folder of images with the recipe's
preprocessing, or a seeded generator (the sign-off then says the data was synthetic).
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from accel_opt.artifacts import sha256_file
from accel_opt.errors import InputRejected, UsageError
from accel_opt.graph.inspect import TensorSpec
from accel_opt.recipe import Preprocessing

Sample = dict[str, np.ndarray]
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"}


class DataSummary(BaseModel):
    source: str  # "npz", "images" or "synthetic"
    path: str | None
    count: int
    sha256: str | None  # content hash of the files read (None for synthetic)
    seed: int | None = None


def load_samples(
    data_dir: str | Path, inputs: list[TensorSpec], preprocessing: Preprocessing | None
) -> tuple[list[Sample], DataSummary]:
    """Read every sample in `data_dir`, checked against the model inputs; sorted by file name."""
    root = Path(data_dir)
    if not root.is_dir():
        raise InputRejected(f"--data must be a folder of .npz files or images: {root}")
    npz_files = sorted(p for p in root.iterdir() if p.suffix == ".npz" and p.is_file())
    image_files = sorted(p for p in root.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if npz_files:
        samples = [_read_npz(path, inputs) for path in npz_files]
        files, source = npz_files, "npz"
    elif image_files:
        if preprocessing is None:
            raise UsageError(f"--data {root} holds images; the recipe must declare `preprocessing` to use them")
        samples = [_read_image(path, inputs, preprocessing) for path in image_files]
        files, source = image_files, "images"
    else:
        raise InputRejected(f"--data {root} holds no .npz files or images")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        digest.update(bytes.fromhex(sha256_file(path)))
    summary = DataSummary(source=source, path=str(root), count=len(samples), sha256=digest.hexdigest())
    return samples, summary


def _read_npz(path: Path, inputs: list[TensorSpec]) -> Sample:
    try:
        with np.load(path, allow_pickle=False) as archive:
            sample = {name: archive[name] for name in archive.files}
    except (ValueError, OSError, zipfile.BadZipFile) as exc:
        raise InputRejected(f"--data {path.name}: not a readable .npz without pickles ({exc})") from None
    check_sample(sample, inputs, where=path.name)
    return sample


def check_sample(sample: Sample, inputs: list[TensorSpec], where: str) -> None:
    """Names, dtypes, ranks, fixed dims and finiteness must match the model's inputs exactly."""
    expected = {spec.name: spec for spec in inputs}
    missing = sorted(set(expected) - set(sample))
    extra = sorted(set(sample) - set(expected))
    if missing or extra:
        raise InputRejected(
            f"--data {where}: arrays {sorted(sample)} do not match model inputs {sorted(expected)}"
            + (f" (missing {missing})" if missing else "")
            + (f" (unknown {extra})" if extra else "")
        )
    for name, array in sample.items():
        spec = expected[name]
        if array.dtype.name != spec.dtype:
            raise InputRejected(f"--data {where}: {name} has dtype {array.dtype.name}, the model expects {spec.dtype}")
        if array.ndim != len(spec.shape):
            raise InputRejected(f"--data {where}: {name} has rank {array.ndim}, the model expects {len(spec.shape)}")
        for axis, (have, want) in enumerate(zip(array.shape, spec.shape)):
            if isinstance(want, int) and want > 0 and have != want:
                raise InputRejected(f"--data {where}: {name} dim {axis} is {have}, the model fixes it at {want}")
        if array.dtype.kind in "fc" and not np.isfinite(array).all():
            raise InputRejected(f"--data {where}: {name} contains NaN or Inf")


def _read_image(path: Path, inputs: list[TensorSpec], pre: Preprocessing) -> Sample:
    from PIL import Image, UnidentifiedImageError

    spec = next((s for s in inputs if s.name == pre.input), inputs[0]) if pre.input else inputs[0]
    if len(inputs) != 1 and pre.input is None:
        raise UsageError("preprocessing.input must name the image input of a model with several inputs")
    try:
        with Image.open(path) as img:
            rgb = img.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise InputRejected(f"--data {path.name}: not a readable image ({exc})") from None
    sample = {spec.name: preprocess_image(rgb, pre)}
    check_sample(sample, [spec], where=path.name)
    return sample


def preprocess_image(img, pre: Preprocessing) -> np.ndarray:
    """Resize the shorter side, center-crop, normalize, lay out; returns a batch of one."""
    from PIL import Image

    width, height = img.size
    scale = pre.resize / min(width, height)
    img = img.resize((max(pre.crop, round(width * scale)), max(pre.crop, round(height * scale))), Image.BILINEAR)
    width, height = img.size
    left, top = (width - pre.crop) // 2, (height - pre.crop) // 2
    img = img.crop((left, top, left + pre.crop, top + pre.crop))
    pixels = np.asarray(img, dtype=np.float32)
    if pre.dtype != "uint8":
        pixels = (pixels / 255.0 - np.asarray(pre.mean, np.float32)) / np.asarray(pre.std, np.float32)
    if pre.layout == "NCHW":
        pixels = pixels.transpose(2, 0, 1)
    return np.ascontiguousarray(pixels[None].astype(pre.dtype))


def synthetic_samples(
    inputs: list[TensorSpec], shapes: dict[str, list[int]], count: int, seed: int
) -> tuple[list[Sample], DataSummary]:
    """Seeded inputs: N(0,1) floats; masks all ones, type ids zeros, other integers in [0, 100)."""
    rng = np.random.default_rng(seed)
    samples = [{spec.name: _random_array(spec, shapes[spec.name], rng) for spec in inputs} for _ in range(count)]
    return samples, DataSummary(source="synthetic", path=None, count=count, sha256=None, seed=seed)


def _random_array(spec: TensorSpec, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(spec.dtype) if spec.dtype != "bfloat16" else np.dtype("float32")
    lowered = spec.name.lower()
    if dtype.kind == "f":
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if "mask" in lowered:
        return np.ones(shape, dtype=dtype)
    if "type" in lowered:
        return np.zeros(shape, dtype=dtype)
    return rng.integers(0, 100, size=shape).astype(dtype)


def split_samples(samples: list[Sample], calibration_count: int, seed: int) -> tuple[list[Sample], list[Sample]]:
    """Deterministic disjoint split into (calibration, evaluation); evaluation never reuses calibration."""
    if len(samples) < 2:
        raise InputRejected(f"--data needs at least 2 samples to calibrate and evaluate on disjoint sets, got {len(samples)}")
    order = np.random.default_rng(seed).permutation(len(samples))
    # Keep at least a quarter of the data (and one sample) for evaluation.
    n_calib = min(calibration_count, len(samples) - max(1, len(samples) // 4))
    calib = [samples[i] for i in sorted(order[:n_calib])]
    evaluation = [samples[i] for i in sorted(order[n_calib:])]
    return calib, evaluation


def batch_of(samples: list[Sample], batch: int) -> Sample:
    """Concatenate samples along axis 0 (cycling) until each input has `batch` rows."""
    names = list(samples[0])
    rows: dict[str, list[np.ndarray]] = {name: [] for name in names}
    have, index = 0, 0
    while have < batch:
        sample = samples[index % len(samples)]
        take = min(batch - have, sample[names[0]].shape[0])
        for name in names:
            rows[name].append(sample[name][:take])
        have += take
        index += 1
    return {name: np.ascontiguousarray(np.concatenate(parts, axis=0)) for name, parts in rows.items()}


def shapes_of(samples: list[Sample]) -> dict[str, list[int]]:
    return {name: list(array.shape) for name, array in samples[0].items()} if samples else {}
