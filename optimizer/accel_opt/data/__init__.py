"""Samples: the one data contract of the project.

A sample is a feed dict `{input name: np.ndarray}`; a data set is a list of them. This is what
Polygraphy's data loaders, ORT's CalibrationDataReader and our benchmark all consume (adapted in
one place each). Sources: a folder of `.npz` feed dicts, a folder of images with the recipe's
preprocessing, or a seeded generator (the sign-off then says the data was synthetic).
"""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel

from accel_opt.data.labels import class_folders
from accel_opt.data.npz import read_npz, spec_problem
from accel_opt.data.summary import DataSummary, Sample  # DataSummary: also the documented import path
from accel_opt.data.synthetic import synthetic_samples  # noqa: F401 - the documented import path
from accel_opt.errors import InputRejected, UsageError
from accel_opt.files import sha256_file
from accel_opt.graph.inspect import TensorSpec
from accel_opt.preprocess.images import IMAGE_SUFFIXES, preprocess_image, read_image
from accel_opt.recipe.deployed import Preprocessing
from accel_opt.recipe.gate import SplitConfig

if TYPE_CHECKING:
    from accel_opt.preprocess.text import TextEncoder

log = logging.getLogger(__name__)



def load_samples(
    data_dir: str | Path, inputs: list[TensorSpec], preprocessing: Preprocessing | None,
    text: TextEncoder | None = None,
    flag: str = "--data", by_class: bool = False,
) -> tuple[list[Sample], DataSummary]:
    """Read every sample in `data_dir`, checked against the model inputs; sorted by file name. With `text` (a text
    stage's encoder), `data_dir` is a text file or a folder of them, and each text is a sample of its own length.
    `by_class`: an ImageFolder layout (data.labels): the samples are in its class folders, named CLASS/FILE.
    `flag`: the option that named the folder, for the errors (--data, --eval-data)."""
    if text is not None:
        return _load_texts(Path(data_dir), text, flag)
    root = Path(data_dir)
    if not root.is_dir():
        if not root.exists():
            kind = "not found"
        elif root.suffix.lower() in (".txt", ".jsonl", ".csv", ".parquet"):
            kind = "a text file: a recipe with a text stage reads it (--recipe text-encoder or text-classifier)"
        else:
            kind = "not a folder"
        raise InputRejected(f"{flag} {root}: {kind}; this recipe reads a folder of .npz feed dicts or images")
    folders = [root / name for name in class_folders(root)] if by_class else [root]
    npz_files = sorted(p for f in folders for p in f.iterdir() if p.suffix == ".npz" and p.is_file())
    image_files = sorted(p for f in folders for p in f.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if npz_files:
        samples = [_read_npz(path, inputs, flag) for path in npz_files]
        files, source = npz_files, "npz"
    elif image_files:
        if preprocessing is None:
            raise InputRejected(f"{flag} {root} holds images, and the recipe has no image preprocessing: use "
                                "--recipe image-classifier (or a recipe with `preprocessing`), or .npz feed dicts")
        samples = [_read_image(path, inputs, preprocessing, flag) for path in image_files]
        files, source = image_files, "images"
    else:
        raise InputRejected(f"{flag} {root} holds no .npz files or images")
    names = [p.relative_to(root).as_posix() for p in files]  # FILE, or CLASS/FILE by class
    digest = hashlib.sha256()
    for name, path in zip(names, files):
        digest.update(name.encode())
        digest.update(bytes.fromhex(sha256_file(path)))
    summary = DataSummary(source=source, path=str(root), count=len(samples), sha256=digest.hexdigest(), names=names)
    return samples, summary


def _load_texts(root: Path, encoder: TextEncoder, flag: str) -> tuple[list[Sample], DataSummary]:
    """The texts of a text file (or of a folder's text files, by name), tokenized one sample each; texts the job
    would reject are left out, with a warning."""
    from accel_opt.preprocess.text import TEXT_SUFFIXES, read_texts

    files = [root] if root.is_file() else sorted(p for p in root.iterdir() if p.is_file()
                                                 and p.suffix.lower() in TEXT_SUFFIXES) \
        if root.is_dir() else []
    if not files:
        images = root.is_dir() and any(p.suffix.lower() in IMAGE_SUFFIXES for p in root.iterdir())
        raise InputRejected(f"{flag} {root}: no text files ({', '.join(TEXT_SUFFIXES)}) for the recipe's text "
                            f"stage{'; it holds images, which a text model cannot read' if images else ''}")
    items = [item for path in files for item in read_texts(str(path), encoder.stage.field)]
    readable = [item for item in items if item.error is None]
    encoded = encoder.encode([item.text for item in readable])
    samples = [feed for feed, _, _ in encoded if feed is not None]
    names = [Path(item.id).name for item, (feed, _, _) in zip(readable, encoded) if feed is not None]
    if len(samples) < len(items):
        first = next((f"{i.id}: {i.error}" for i in items if i.error), None) or next(
            f"{i.id}: {reason}" for i, (_, reason, _) in zip(readable, encoded) if reason)
        log.warning("%s %s: %d of %d texts left out (first: %s)", flag, root, len(items) - len(samples),
                    len(items), first)
    if not samples:
        raise InputRejected(f"{flag} {root}: no text the text stage can take")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        digest.update(bytes.fromhex(sha256_file(path)))
    return samples, DataSummary(source="text", path=str(root), count=len(samples), sha256=digest.hexdigest(),
                                names=names)


def _read_npz(path: Path, inputs: list[TensorSpec], flag: str) -> Sample:
    try:
        sample = read_npz(path, inputs)
    except InputRejected as exc:
        raise InputRejected(f"{flag} {path.name}: {exc}") from None
    check_sample(sample, inputs, where=f"{flag} {path.name}")
    return sample


def check_sample(sample: Sample, inputs: list[TensorSpec], where: str | None = None) -> None:
    """Names, dtypes, ranks, fixed dims and finiteness must match the model's inputs exactly; a refusal
    starts with `where` (such as "--data x.npz") when given."""
    at = f"{where}: " if where else ""
    expected = {spec.name: spec for spec in inputs}
    missing = sorted(set(expected) - set(sample))
    extra = sorted(set(sample) - set(expected))
    if missing or extra:
        raise InputRejected(
            f"{at}arrays {sorted(sample)} do not match model inputs {sorted(expected)}"
            + (f" (missing {missing})" if missing else "")
            + (f" (unknown {extra})" if extra else "")
        )
    for name, array in sample.items():
        if problem := spec_problem(name, array.dtype, array.shape, expected[name]):
            raise InputRejected(f"{at}{problem}")
        if array.dtype.kind in "fc" and not np.isfinite(array).all():
            raise InputRejected(f"{at}{name} contains NaN or Inf")


def _read_image(path: Path, inputs: list[TensorSpec], pre: Preprocessing, flag: str) -> Sample:
    spec = next((s for s in inputs if s.name == pre.input), inputs[0]) if pre.input else inputs[0]
    if len(inputs) != 1 and pre.input is None:
        raise UsageError("preprocessing.input must name the image input of a model with several inputs")
    try:
        rgb = read_image(path, pre)
    except InputRejected as exc:
        raise InputRejected(f"{flag} {path.name}: {exc}") from None
    sample = {spec.name: preprocess_image(rgb, pre)}
    check_sample(sample, [spec], where=f"{flag} {path.name}")
    return sample


class DataSplit(BaseModel):
    """Which samples have which role, as indices into the samples read: `calibration` sets int8 ranges, `steering`
    steers choices (the fallback's search, auto's shortlist, the cleanup check), `verdict` only judges the final
    sign-off; `unused` were beyond accuracy.max_samples, or copies. No sample is in two roles, and identical inputs
    (the same image twice) count once: a copy in the verdict of a sample that calibrated or steered would be evidence
    the build has already seen, and two copies in the verdict would count one sample twice."""

    seed: int
    calibration: list[int] = []
    steering: list[int] = []
    verdict: list[int] = []
    unused: list[int] = []
    groups: dict[str, list[str]] = {}  # where samples were grouped (data.groups): each role's groups

    def counts(self) -> dict[str, int]:
        return {"calibration": len(self.calibration), "steering": len(self.steering), "verdict": len(self.verdict)}

    def names(self, names: list[str]) -> dict[str, list[str] | dict[str, list[str]]]:
        """The manifest's record: each role's sample names, and each role's groups where samples were grouped."""
        roles = {role: [names[i] for i in getattr(self,
                                                  role)] for role in ("calibration", "steering", "verdict", "unused")}
        return {**roles, "groups": self.groups} if self.groups else roles


def sample_key(sample: Sample) -> str:
    """A sample's content identity: equal inputs, equal keys (whatever file they came from)."""
    digest = hashlib.sha1()
    for name in sorted(sample):
        array = np.ascontiguousarray(sample[name])
        digest.update(f"{name}:{array.dtype}:{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def split_roles(keys: list[str], config: SplitConfig, calibrates: bool, calibration_max: int, verdict_max: int,
                seed: int, held_out: list[str] | None = None) -> DataSplit:
    """Deal the samples with content `keys` (sample_key) into disjoint roles, deterministically for `seed`.

    Calibration takes `config.calibration_fraction` of them (at most `calibration_max`) when the build `calibrates`,
    steering `config.steering_fraction` (at most `config.max_steering`), the verdict the rest (at most `verdict_max`).
    A build that does not calibrate gives that share to the verdict; steering is the same samples either way, so every
    candidate of one auto run is steered by the same ones. `held_out`: the keys of --eval-data, indexed after `keys`:
    they are the verdict, and --data only calibrates and steers. A sample equal to one dealt before is left unused."""
    count = len(keys)
    if calibrates and count < (1 if held_out else 2):
        raise InputRejected(f"--data needs at least 2 samples to calibrate and judge on disjoint sets, got {count}")
    order = [int(i) for i in np.random.default_rng(seed).permutation(count)]
    rest = "verdict" if held_out is None else "unused"
    n_calib, n_steer = _role_counts(count, config, calibrates, calibration_max, reserve=1 if held_out is None else 0,
                                    all_data=held_out is not None)
    # The calibration share goes to the rest when the build does not calibrate: steering is the same samples either way.
    dealt = [("calibration" if calibrates else rest, order[:n_calib]), ("steering", order[n_calib:n_calib + n_steer]),
             (rest, order[n_calib + n_steer:])]
    split, seen = DataSplit(seed=seed), set()
    for role, indices in dealt:
        for i in indices:
            (split.unused if keys[i] in seen else getattr(split, role)).append(i)
            seen.add(keys[i])
    for j, key in enumerate(held_out or []):
        (split.unused if key in seen else split.verdict).append(count + j)
        seen.add(key)
    split.verdict, beyond = split.verdict[:verdict_max], split.verdict[verdict_max:]
    split.unused += beyond
    for role in ("calibration", "steering", "verdict", "unused"):
        getattr(split, role).sort()
    return split


def _role_counts(count: int, config: SplitConfig, calibrates: bool, calibration_max: int,
                 reserve: int, all_data: bool = False) -> tuple[int, int]:
    """How many of `count` samples calibrate and steer (split_roles); `reserve` verdict samples are kept: steering
    gives way first, then calibration. `all_data` (the held-out samples come from --eval-data): --data is shared by
    calibration and steering alone, in the ratio of their shares, up to their caps."""
    if all_data:
        share = config.calibration_fraction / (config.calibration_fraction + config.steering_fraction)
        n_calib = min(calibration_max, math.ceil(share * count)) if calibrates else 0
        return n_calib, min(config.max_steering, count - n_calib)
    n_calib = min(calibration_max, math.ceil(config.calibration_fraction * count))
    n_calib = max(1, n_calib) if calibrates else n_calib
    n_steer = max(0, min(config.max_steering, math.ceil(config.steering_fraction * count),
                         count - reserve - (n_calib if calibrates else 0)))
    if calibrates:
        n_calib = min(n_calib, count - reserve - n_steer)
    return n_calib, n_steer


def data_samples_for(held_out: int, config: SplitConfig, calibrates: bool, calibration_max: int) -> int:
    """The fewest distinct --data samples that split_roles deals `held_out` verdict samples from (no --eval-data):
    what to tell a user whose held-out samples were too few."""
    count = max(held_out, 2 if calibrates else 1)  # calibrating needs one sample besides the verdict's
    while True:
        n_calib, n_steer = _role_counts(count, config, calibrates, calibration_max, reserve=1)
        if count - n_steer - (n_calib if calibrates else 0) >= held_out:
            return count
        count += 1


BatchAxes = dict[str, int | None]


def rows_of(sample: Sample, axes: BatchAxes) -> int:
    """How many batch rows `sample` holds (1 when none of its inputs is batched)."""
    return next((int(sample[n].shape[a]) for n, a in axes.items() if a is not None and n in sample), 1)


def leading_axes(sample: Sample) -> BatchAxes:
    """Batch axis 0 for every input with a dimension: the layout of most models' inputs."""
    return {name: 0 if np.ndim(array) else None for name, array in sample.items()}


def concat_samples(samples: list[Sample], axes: BatchAxes) -> Sample:
    """One feed from several samples: batched inputs concatenated along their batch axis; inputs
    without one (a scalar sample rate, a fixed table) must be equal in all samples and are taken once."""
    if not _concatenable(samples, axes):
        raise ValueError("the samples differ beyond their batch axis (an unbatched input, or another dim)")
    return _concat(samples, axes)


def _concatenable(samples: list[Sample], axes: BatchAxes) -> bool:
    """Whether the samples make one feed: unbatched inputs equal, batched ones of one shape but along the batch axis
    (a sequence model's samples of several lengths do not)."""
    return all(_fits(s, samples[0], axes) for s in samples[1:])


def _fits(sample: Sample, first: Sample, axes: BatchAxes) -> bool:
    for name, array in first.items():
        other, axis = sample[name], axes.get(name)
        if axis is None:
            if not np.array_equal(other, array):
                return False
        elif other.ndim != array.ndim or any(a != b for i,
                                             (a, b) in enumerate(zip(other.shape, array.shape)) if i != axis):
            return False
    return True


def _concat(samples: list[Sample], axes: BatchAxes) -> Sample:
    """Batched inputs concatenated; every other input as in the first sample."""
    return {name: first if axes.get(name) is None else
            np.ascontiguousarray(np.concatenate([s[name] for s in samples], axis=axes[name]))
            for name, first in samples[0].items()}


def batch_of(samples: list[Sample], batch: int, axes: BatchAxes | None = None) -> Sample:
    """A timing feed of exactly `batch` rows, taken from `samples` in order (cycling). Only inputs with a
    batch axis (default: axis 0 of every input that has one) are batched; the others come from the first
    sample. With no batched input, the first sample as it is. Samples whose other dims differ from the first's (other
    sequence lengths) are left out: one feed takes one shape."""
    axes = leading_axes(samples[0]) if axes is None else axes
    if all(a is None for a in axes.values()):
        return dict(samples[0])
    samples = [s for s in samples if _fits(s, samples[0], axes)]
    parts: list[Sample] = []
    have, index = 0, 0
    while have < batch:
        sample = samples[index % len(samples)]
        take = min(batch - have, rows_of(sample, axes))
        if take == 0:  # a sample without rows would loop forever
            raise ValueError("a sample has 0 rows along its batch axis")
        parts.append({n: (np.take(a, range(take), axis=axes[n]) if axes.get(n) is not None else a) for n,
                      a in sample.items()})
        have += take
        index += 1
    return _concat(parts, axes)


def pack_batches(samples: list[Sample], batch: int, axes: BatchAxes) -> list[list[int]] | None:
    """Group whole samples, in order, into batches of exactly `batch` rows; the last is padded by repeating
    its last sample (the padding's outputs are dropped). Returns sample indices per batch, or None when
    samples cannot be packed exactly (rows that do not add up to `batch`, or unbatched inputs that differ)."""
    if all(a is None for a in axes.values()):
        return None
    groups: list[list[int]] = []
    current: list[int] = []
    rows = 0
    for i, sample in enumerate(samples):
        rows += rows_of(sample, axes)
        current.append(i)
        if rows > batch:
            return None
        if rows == batch:
            groups.append(current)
            current, rows = [], 0
    if current:
        pad_rows = rows_of(samples[current[-1]], axes)
        if (batch - rows) % pad_rows:
            return None
        current += [current[-1]] * ((batch - rows) // pad_rows)
        groups.append(current)
    if not all(_concatenable([samples[i] for i in group], axes) for group in groups):
        return None
    return groups


UNBATCHED = -1  # an output axis value meaning: the output does not depend on the batch (same for every sample)


def output_batch_axis(shape: tuple[int, ...], per_sample_shapes: list[tuple[int, ...]]) -> int | None:
    """The axis along which a batch output holds its samples' outputs, found from each sample's output
    shape alone (from the reference): the one axis along which they add up to the batch output's, with
    every other axis equal. UNBATCHED when each sample's output has the batch output's shape (and there
    are several samples); None when no axis, or more than one, fits."""
    shape, first = tuple(shape), tuple(per_sample_shapes[0])
    if len(per_sample_shapes) == 1 and shape == first:
        return 0 if shape else UNBATCHED
    if any(len(s) != len(shape) for s in per_sample_shapes):
        return None
    if all(tuple(s) == shape for s in per_sample_shapes):
        return UNBATCHED
    fits = [axis for axis in range(len(shape))
            if sum(s[axis] for s in per_sample_shapes) == shape[axis]
            and all(s[b] == shape[b] for s in per_sample_shapes for b in range(len(shape)) if b != axis)]
    return fits[0] if len(fits) == 1 else None


def split_output(output: np.ndarray, axis: int, rows: list[int]) -> list[np.ndarray]:
    """Cut a batch output along `axis` into pieces of `rows` (UNBATCHED: every sample gets all of it)."""
    if axis == UNBATCHED:
        return [output] * len(rows)
    return np.split(output, np.cumsum(rows)[:-1], axis=axis)


def shapes_of(samples: list[Sample]) -> dict[str, list[int]]:
    return {name: list(array.shape) for name, array in samples[0].items()} if samples else {}
