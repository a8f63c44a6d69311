"""The load stage's samples: --data (and --eval-data) read as the model and the artifact take them, and dealt into
disjoint roles (data.split_roles): calibration, steering, and the held-out verdict."""

from __future__ import annotations

import math
from pathlib import Path

from accel_opt.accuracy.metrics import samples_to_certify
from accel_opt.builder.context import BuildContext, Samples
from accel_opt.data import (
    DataSplit,
    DataSummary,
    Sample,
    check_sample,
    data_samples_for,
    load_samples,
    sample_key,
    shapes_of,
    split_roles,
    synthetic_samples,
)
from accel_opt.data.groups import sample_groups, split_groups
from accel_opt.data.labels import FOLDERS, class_folders, csv_labels, folder_labels, read_classes
from accel_opt.errors import InputRejected, TooFewToCertify, UsageError
from accel_opt.graph.inspect import TensorSpec, resolve_shapes
from accel_opt.preprocess.images import to_model_input
from accel_opt.recipe.types import Precision


def refuse_out_of_range_indices(samples: list[Sample], names: list[str], bounds: dict[str, int]) -> None:
    """InputRejected (exit 3) naming the first sample whose integer input indexes past the table it indexes (Gather
    takes [-size, size)): ONNX Runtime would stop inside a run with an error that reads as accel-opt's own bug."""
    for sample, name in zip(samples, names):
        for inp, size in bounds.items():
            values = sample.get(inp)
            if values is not None and values.size and (values.min() < -size or values.max() >= size):
                bad = values.max() if values.max() >= size else values.min()
                raise InputRejected(f"{name}: input {inp!r} holds the index {int(bad)}, outside the {size} rows of the "
                                    f"table it indexes (valid: {-size} to {size - 1})")


def read_and_split(ctx: BuildContext) -> list[Sample]:
    """Every sample read (--data, then --eval-data; synthetic without either), the shapes they resolve, and their
    split into roles (ctx.split, ctx.sample_names); sets ctx.data / ctx.eval_data. Returns the samples."""
    recipe = ctx.recipe
    accuracy = recipe.accuracy
    if accuracy.labels.gate == "labels" and accuracy.labels.source is None:
        raise UsageError("the recipe gates on the labels alone (accuracy.labels.gate: labels): give --labels")
    if ctx.data_dir is None and ctx.eval_data_dir is None:
        steering = min(accuracy.split.max_steering, accuracy.synthetic_samples)
        ctx.shapes = resolve_shapes(ctx.inputs, recipe.shapes, given_batch_axes=recipe.batch_axes)
        samples, ctx.data = synthetic_samples(ctx.inputs, ctx.shapes.shapes, steering + accuracy.synthetic_samples,
                                              accuracy.seed, ctx.loaded.index_bounds)
        ctx.sample_names = ctx.data.names
        ctx.split = DataSplit(seed=accuracy.seed, steering=list(range(steering)),
                              verdict=list(range(steering, len(samples))))
        ctx.notes.append(f"No --data given: {len(samples)} synthetic samples (seed {accuracy.seed}) were used: "
                         f"{accuracy.synthetic_samples} for the accuracy check, {steering} to steer choices.")
        return samples
    samples: list[Sample] = []
    held_out = None
    if ctx.data_dir is not None:
        samples, ctx.data = _read_data(ctx, ctx.data_dir, "--data")
        ctx.sample_names = list(ctx.data.names)
        ctx.sample_labels = _labels_of(ctx, ctx.data.names)
    if ctx.eval_data_dir is not None:
        held, ctx.eval_data = _read_data(ctx, ctx.eval_data_dir, "--eval-data")
        if ctx.data is not None and ctx.eval_data.source != ctx.data.source:
            raise UsageError(f"--eval-data holds {ctx.eval_data.source}, --data {ctx.data.source}: give the same kind")
        held_out = [sample_key(s) for s in held]
        ctx.sample_labels += _labels_of(ctx, ctx.eval_data.names, every_class=ctx.data_dir is None)
        ctx.sample_names += [f"{ctx.eval_data_dir.name}/{name}" for name in ctx.eval_data.names]
        samples = samples + held
        ctx.data = ctx.data or ctx.eval_data
    refuse_out_of_range_indices(samples, ctx.sample_names, ctx.loaded.index_bounds)
    ctx.shapes = resolve_shapes(ctx.inputs, recipe.shapes, shapes_of(samples), recipe.batch_axes)
    given = len(samples) - len(held_out or [])
    ctx.verdict_max = _verdict_memory_cap(ctx, accuracy.max_samples)
    eval_names = ctx.eval_data.names if ctx.eval_data_dir is not None else []  # as named under their own folder
    ctx.sample_groups = sample_groups(ctx.sample_names[:given] + eval_names, accuracy.split)
    keys = ctx.sample_keys = [sample_key(s) for s in samples[:given]]
    dealing = (accuracy.split, recipe.precision is Precision.int8, recipe.precision_options.calibration.samples,
               ctx.verdict_max, accuracy.seed, held_out)
    ctx.split = split_groups(keys, ctx.sample_groups, *dealing) if ctx.sample_groups else split_roles(keys, *dealing)
    if ctx.split.groups:
        counts = ", ".join(f"{len(ctx.split.groups[r])} {r}" for r in ("calibration", "steering", "verdict"))
        ctx.notes.append(f"Samples grouped by their source ({len(set(ctx.sample_groups))} groups, dealt whole: {counts}): "
                         "no group is in two roles, and the verdict's rates count held-out groups as their trials.")
    if not ctx.split.verdict:  # only copies of samples with another role: nothing is left to judge the build
        raise InputRejected("--eval-data holds no sample that --data does not: every one is a copy of a --data sample"
                            if held_out is not None else
                            f"--data holds only {len(ctx.split.calibration + ctx.split.steering)} distinct sample(s), "
                            "all taken to calibrate and steer: none is left to judge the build; give more distinct samples")
    return samples


def too_few_to_certify(ctx: BuildContext) -> TooFewToCertify | None:
    """For auto: the error that drops a candidate when no result on its held-out samples could certify it."""
    hopeless = ctx.steering_gate()[2]
    if not hopeless:
        return None
    accuracy = ctx.recipe.accuracy
    needed = samples_to_certify(ctx.recipe.tolerance, list(accuracy.task_metrics), accuracy.confidence)
    return TooFewToCertify(f"not built: {hopeless[0]}", needed, data_samples_needed(ctx, needed))


def data_samples_needed(ctx: BuildContext, held_out_needed: int | None) -> int | None:
    """The distinct --data samples this recipe's split deals `held_out_needed` held-out samples from (None: nothing
    needed, or the held-out samples come from --eval-data)."""
    if held_out_needed is None or ctx.eval_data_dir is not None:
        return None
    recipe = ctx.recipe
    return data_samples_for(held_out_needed, recipe.accuracy.split, recipe.precision is Precision.int8,
                            recipe.precision_options.calibration.samples)


VERDICT_MEMORY_MIB = 4096  # what the judged outputs may take: the reference's and the candidate's, in float64 copies
JUDGE_BYTES_PER_ELEMENT = 56  # float32 outputs of both, and about six float64 copies while judging


def _verdict_memory_cap(ctx: BuildContext, max_samples: int) -> int:
    """accuracy.max_samples, lowered where every judged sample's outputs would not fit VERDICT_MEMORY_MIB (outputs
    with static dims only: a 640x640 detector head of 705,600 values takes ~38 MiB per sample to judge)."""
    elements = 0
    for spec in ctx.outputs:
        if not all(isinstance(d, int) for d in spec.shape[1:]):
            return max_samples  # a dynamic dim besides the batch: the size is not known before the model runs
        batch = spec.shape[0] if spec.shape and isinstance(spec.shape[0], int) else 1
        elements += batch * math.prod(spec.shape[1:])
    cap = max(1, VERDICT_MEMORY_MIB * 2**20 // max(1, elements * JUDGE_BYTES_PER_ELEMENT))
    if cap < max_samples:
        ctx.notes.append(f"Held-out samples judged at most {cap} (not accuracy.max_samples {max_samples}): each sample's "
                         f"outputs take {elements * JUDGE_BYTES_PER_ELEMENT / 2**20:.1f} MiB to judge, within "
                         f"{VERDICT_MEMORY_MIB} MiB.")
    return min(cap, max_samples)


def _labels_of(ctx: BuildContext, names: list[str], every_class: bool = True) -> list[int]:
    """The class of each sample named `names` (--labels: by its class folder, or from the CSV); [] without labels."""
    config = ctx.recipe.accuracy.labels
    if config.source is None:
        return []
    if config.source == FOLDERS:  # one class list for --data and --eval-data: the first folder's, sorted
        return folder_labels(names, class_folders(ctx.data_dir or ctx.eval_data_dir), every_class)
    return csv_labels(Path(config.source), names, read_classes(Path(config.classes)) if config.classes else None)


def _read_data(ctx: BuildContext, folder: Path, flag: str) -> tuple[list[Sample], DataSummary]:
    """The samples of `folder` as the model takes them. With fused preprocessing the images are decoded once,
    to the host's uint8 crops (appended to ctx.host_crops: what the fused artifact takes), and normalized from those;
    where the job's inputs differ from the reference's (draft decoding, the torch backend's tensor path) they are
    appended to ctx.job_samples (so both stay aligned with the samples when --eval-data follows --data)."""
    pre = ctx.recipe.preprocessing
    by_class = ctx.recipe.accuracy.labels.source == FOLDERS
    draft = pre is not None and pre.draft_decode and not any(folder.glob("*.npz"))
    reference_pre = pre.model_copy(update={"draft_decode": False}) if draft else pre
    if not ctx.fused:
        samples, data = load_samples(folder, ctx.inputs, reference_pre, text=ctx.text_encoder, flag=flag,
                                     by_class=by_class)
        if ctx.torch and data.source == "images":  # the candidate takes what its job's tensor path makes
            from accel_opt.preprocess.tensor_images import tensor_path_samples

            files = [folder / name for name in data.names]
            ctx.job_samples += tensor_path_samples(files, pre, ctx.image_input, ctx.backend.device, flag)
        elif draft:  # the candidate takes what `accel-opt run` will feed it; the reference, full decodes
            ctx.job_samples += load_samples(folder, ctx.inputs, pre, flag=flag, by_class=by_class)[0]
        return samples, data
    name = ctx.image_input
    spec = TensorSpec(name=name, dtype="uint8", shape=["batch", pre.crop, pre.crop, 3])
    crops, data = load_samples(folder, [spec], pre.host_part().model_copy(update={"input": name}), flag=flag,
                               by_class=by_class)
    ctx.host_crops += crops
    if draft:
        crops = load_samples(folder, [spec], reference_pre.host_part().model_copy(update={"input": name}), flag=flag,
                             by_class=by_class)[0]
    samples = [{name: to_model_input(c[name], pre)} for c in crops]
    for sample, where in zip(samples, data.names):
        check_sample(sample, ctx.inputs, f"{flag} {where}")
    return samples, data


def dealt(ctx: BuildContext, samples: list[Sample]) -> Samples:
    """The samples read (in index order) dealt into their roles by ctx.split, each also as the folder takes it: fused
    preprocessing takes the host's uint8 crops; draft decoding and the torch device path, the job's own inputs."""
    split, deployed = ctx.split, (ctx.host_crops if ctx.fused else ctx.job_samples) or samples

    def pick(indices: list[int], source: list[Sample]) -> list[Sample]:
        return [source[i] for i in indices]

    held_out, held_out_deployed = pick(split.verdict, samples), pick(split.verdict, deployed)
    # Texts are timed in batches of one shape, padded to the longest; the gate judges them as they are.
    timed = ctx.text_encoder.padding.same_length(held_out) if ctx.text_encoder is not None else None
    return Samples(calibration=pick(split.calibration, samples), steering=pick(split.steering, samples),
                   steering_deployed=pick(split.steering, deployed), steering_names=[ctx.sample_names[i] for i in split.steering],
                   held_out=held_out, held_out_deployed=held_out_deployed,
                   held_out_names=[ctx.sample_names[i] for i in split.verdict],
                   timed=timed or held_out, timed_deployed=timed or held_out_deployed)
