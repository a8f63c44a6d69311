"""The load stage's samples: --data (and --eval-data) read as the model and the artifact take them, and dealt into
disjoint roles (data.split_roles): calibration, steering, and the held-out verdict."""

from __future__ import annotations

import math
from pathlib import Path

from accel_opt.accuracy.metrics import samples_to_certify
from accel_opt.builder.context import BuildSoFar, Dealt, Samples
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
from accel_opt.graph.inspect import ResolvedShapes, TensorSpec, resolve_shapes
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


def read_and_split(ctx: BuildSoFar) -> Dealt:
    """Every sample read (--data, then --eval-data; synthetic without either) for the loaded model, the shapes they
    resolve, their split into roles and the samples dealt by it (its max_feed is the load stage's to add)."""
    recipe, notes = ctx.recipe, []
    accuracy, index_bounds = recipe.accuracy, ctx.loaded.model.index_bounds
    if accuracy.labels.gate == "labels" and accuracy.labels.source is None:
        raise UsageError("the recipe gates on the labels alone (accuracy.labels.gate: labels): give --labels")
    data_dir, eval_data_dir = ctx.setup.data_dir, ctx.setup.eval_data_dir
    if data_dir is None and eval_data_dir is None:
        steering = min(accuracy.split.max_steering, accuracy.synthetic_samples)
        shapes = resolve_shapes(ctx.loaded.inputs, recipe.shapes, given_batch_axes=recipe.batch_axes)
        samples, data = synthetic_samples(ctx.loaded.inputs, shapes.shapes, steering + accuracy.synthetic_samples,
                                          accuracy.seed, index_bounds)
        split = DataSplit(seed=accuracy.seed, steering=list(range(steering)),
                          verdict=list(range(steering, len(samples))))
        notes.append(f"No --data given: {len(samples)} synthetic samples (seed {accuracy.seed}) were used: "
                     f"{accuracy.synthetic_samples} for the accuracy check, {steering} to steer choices.")
        return _dealt(ctx, samples, [], shapes, notes, data=data, eval_data=None, split=split, sample_names=data.names,
                      sample_keys=[], sample_groups=None, sample_labels=[], verdict_max=None)
    samples: list[Sample] = []
    deployed: list[Sample] = []  # as the folder takes them, where that differs (_read_data)
    held_out, data, eval_data, names, labels = None, None, None, [], []
    if data_dir is not None:
        samples, data, deployed = _read_data(ctx, data_dir, "--data")
        names, labels = list(data.names), _labels_of(ctx, data.names)
    if eval_data_dir is not None:
        held, eval_data, held_deployed = _read_data(ctx, eval_data_dir, "--eval-data")
        if data is not None and eval_data.source != data.source:
            raise UsageError(f"--eval-data holds {eval_data.source}, --data {data.source}: give the same kind")
        held_out = [sample_key(s) for s in held]
        labels += _labels_of(ctx, eval_data.names, every_class=data_dir is None)
        names += [f"{eval_data_dir.name}/{name}" for name in eval_data.names]
        samples, deployed = samples + held, deployed + held_deployed
        data = data or eval_data
    refuse_out_of_range_indices(samples, names, index_bounds)
    shapes = resolve_shapes(ctx.loaded.inputs, recipe.shapes, shapes_of(samples), recipe.batch_axes)
    given = len(samples) - len(held_out or [])
    verdict_max = _verdict_memory_cap(ctx, accuracy.max_samples, notes)
    eval_names = eval_data.names if eval_data_dir is not None else []  # as named under their own folder
    groups = sample_groups(names[:given] + eval_names, accuracy.split)
    keys = [sample_key(s) for s in samples[:given]]
    dealing = (accuracy.split, recipe.precision is Precision.int8, recipe.precision_options.calibration.samples,
               verdict_max, accuracy.seed, held_out)
    split = split_groups(keys, groups, *dealing) if groups else split_roles(keys, *dealing)
    if split.groups:
        counts = ", ".join(f"{len(split.groups[r])} {r}" for r in ("calibration", "steering", "verdict"))
        notes.append(f"Samples grouped by their source ({len(set(groups))} groups, dealt whole: {counts}): "
                     "no group is in two roles, and the verdict's rates count held-out groups as their trials.")
    if not split.verdict:  # only copies of samples with another role: nothing is left to judge the build
        raise InputRejected("--eval-data holds no sample that --data does not: every one is a copy of a --data sample"
                            if held_out is not None else
                            f"--data holds only {len(split.calibration + split.steering)} distinct sample(s), "
                            "all taken to calibrate and steer: none is left to judge the build; give more distinct "
                            "samples")
    return _dealt(ctx, samples, deployed, shapes, notes, data=data, eval_data=eval_data, split=split,
                  sample_names=names, sample_keys=keys, sample_groups=groups, sample_labels=labels,
                  verdict_max=verdict_max)


def too_few_to_certify(ctx: BuildSoFar) -> TooFewToCertify | None:
    """For auto: the error that drops a candidate when no result on its held-out samples could certify it."""
    hopeless = ctx.steering_gate()[2]
    if not hopeless:
        return None
    accuracy = ctx.recipe.accuracy
    needed = samples_to_certify(ctx.recipe.tolerance, list(accuracy.task_metrics), accuracy.confidence)
    return TooFewToCertify(f"not built: {hopeless[0]}", needed, data_samples_needed(ctx, needed))


def data_samples_needed(ctx: BuildSoFar, held_out_needed: int | None) -> int | None:
    """The distinct --data samples this recipe's split deals `held_out_needed` held-out samples from (None: nothing
    needed, or the held-out samples come from --eval-data)."""
    if held_out_needed is None or ctx.setup.eval_data_dir is not None:
        return None
    recipe = ctx.recipe
    return data_samples_for(held_out_needed, recipe.accuracy.split, recipe.precision is Precision.int8,
                            recipe.precision_options.calibration.samples)


VERDICT_MEMORY_MIB = 4096  # what the judged outputs may take: the reference's and the candidate's, in float64 copies
JUDGE_BYTES_PER_ELEMENT = 56  # float32 outputs of both, and about six float64 copies while judging


def _verdict_memory_cap(ctx: BuildSoFar, max_samples: int, notes: list[str]) -> int:
    """accuracy.max_samples, lowered where every judged sample's outputs would not fit VERDICT_MEMORY_MIB (outputs
    with static dims only: a 640x640 detector head of 705,600 values takes ~38 MiB per sample to judge)."""
    elements = 0
    for spec in ctx.loaded.outputs:
        if not all(isinstance(d, int) for d in spec.shape[1:]):
            return max_samples  # a dynamic dim besides the batch: the size is not known before the model runs
        batch = spec.shape[0] if spec.shape and isinstance(spec.shape[0], int) else 1
        elements += batch * math.prod(spec.shape[1:])
    cap = max(1, VERDICT_MEMORY_MIB * 2**20 // max(1, elements * JUDGE_BYTES_PER_ELEMENT))
    if cap < max_samples:
        notes.append(f"Held-out samples judged at most {cap} (not accuracy.max_samples {max_samples}): each sample's "
                         f"outputs take {elements * JUDGE_BYTES_PER_ELEMENT / 2**20:.1f} MiB to judge, within "
                         f"{VERDICT_MEMORY_MIB} MiB.")
    return min(cap, max_samples)


def _labels_of(ctx: BuildSoFar, names: list[str], every_class: bool = True) -> list[int]:
    """The class of each sample named `names` (--labels: by its class folder, or from the CSV); [] without labels."""
    config = ctx.recipe.accuracy.labels
    if config.source is None:
        return []
    if config.source == FOLDERS:  # one class list for --data and --eval-data: the first folder's, sorted
        return folder_labels(names, class_folders(ctx.setup.data_dir or ctx.setup.eval_data_dir), every_class)
    return csv_labels(Path(config.source), names, read_classes(Path(config.classes)) if config.classes else None)


def _read_data(ctx: BuildSoFar, folder: Path, flag: str) -> tuple[list[Sample], DataSummary, list[Sample]]:
    """The samples of `folder` as the model takes them, their summary, and the same samples as the folder takes them
    where that differs ([] where not). With fused preprocessing the images are decoded once, to the host's uint8 crops
    (what the fused artifact takes), and normalized from those; draft decoding and the torch backend's tensor path
    give the job's own inputs."""
    pre = ctx.recipe.preprocessing
    by_class = ctx.recipe.accuracy.labels.source == FOLDERS
    draft = pre is not None and pre.draft_decode and not any(folder.glob("*.npz"))
    reference_pre = pre.model_copy(update={"draft_decode": False}) if draft else pre
    if not ctx.fused:
        samples, data = load_samples(folder, ctx.loaded.inputs, reference_pre, text=ctx.loaded.text_encoder, flag=flag,
                                     by_class=by_class)
        if ctx.torch and data.source == "images":  # the candidate takes what its job's tensor path makes
            from accel_opt.preprocess.tensor_images import tensor_path_samples

            files = [folder / name for name in data.names]
            return samples, data, tensor_path_samples(files, pre, ctx.image_input, ctx.setup.backend.device, flag)
        if draft:  # the candidate takes what `accel-opt run` will feed it; the reference, full decodes
            return samples, data, load_samples(folder, ctx.loaded.inputs, pre, flag=flag, by_class=by_class)[0]
        return samples, data, []
    name = ctx.image_input
    spec = TensorSpec(name=name, dtype="uint8", shape=["batch", pre.crop, pre.crop, 3])
    host_crops, data = load_samples(folder, [spec], pre.host_part().model_copy(update={"input": name}), flag=flag,
                                    by_class=by_class)
    crops = host_crops
    if draft:
        crops = load_samples(folder, [spec], reference_pre.host_part().model_copy(update={"input": name}), flag=flag,
                             by_class=by_class)[0]
    samples = [{name: to_model_input(c[name], pre)} for c in crops]
    for sample, where in zip(samples, data.names):
        check_sample(sample, ctx.loaded.inputs, f"{flag} {where}")
    return samples, data, host_crops


def _dealt(ctx: BuildSoFar, samples: list[Sample], deployed: list[Sample], shapes: ResolvedShapes, notes: list[str],
           **record) -> Dealt:
    """The samples read (in index order) dealt into their roles by `record`'s split, each also as the folder takes it
    (`deployed`, where that differs from the reference's: fused preprocessing's host crops, draft decoding and the
    torch device path's job inputs); `record`: the rest of Dealt's fields."""
    deployed = deployed or samples
    split, names = record["split"], record["sample_names"]

    def pick(indices: list[int], source: list[Sample]) -> list[Sample]:
        return [source[i] for i in indices]

    held_out, held_out_deployed = pick(split.verdict, samples), pick(split.verdict, deployed)
    # Texts are timed in batches of one shape, padded to the longest; the gate judges them as they are.
    encoder = ctx.loaded.text_encoder
    timed = encoder.padding.same_length(held_out) if encoder is not None else None
    roles = Samples(calibration=pick(split.calibration, samples), steering=pick(split.steering, samples),
                    steering_deployed=pick(split.steering, deployed), steering_names=[names[i] for i in split.steering],
                    held_out=held_out, held_out_deployed=held_out_deployed,
                    held_out_names=[names[i] for i in split.verdict],
                    timed=timed or held_out, timed_deployed=timed or held_out_deployed)
    deploy_batch = ctx.recipe.selection.target_batch_size if shapes.batch_dynamic else shapes.batch_size
    return Dealt(samples=roles, shapes=shapes, deploy_batch=deploy_batch, notes=(*notes, *shapes.notes), **record)
