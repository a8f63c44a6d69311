"""A recipe's image preprocessing against the model it feeds: fitted at load, exercised after the gate.

An artifact records how it takes images (resize, crop, normalization, layout, dtype), and `accel-opt
run` applies exactly that. So the build must check it: a bundled recipe's 224 px crop cannot feed a
model fixed at 128x128, and a build whose --data are .npz feed dicts (or synthetic) never decodes an
image. Two steps close that gap:

- `fit_preprocessing` (load stage): a crop the model's fixed height/width contradict is fitted to the
  model (resize scaled by the same ratio, 256/224 at 224 -> 146 at 128), with a build note; what no
  crop can fix (rank not 4, not 3 channels where the layout puts them, another dtype, a fixed batch
  above 1) is refused in one line (UsageError).
- `builder.checks.exercise_image_path` (after the gate): `accel-opt run`'s own job runs the staged artifact on a few
  generated images, so a signed-off folder always takes the images it says it takes.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from accel_opt.errors import UsageError
from accel_opt.graph.inspect import TensorSpec
from accel_opt.recipe.deployed import Preprocessing
from accel_opt.recipe.schema import Recipe

log = logging.getLogger(__name__)

IMAGE_CHECK_COUNT = 3  # a landscape and a portrait JPEG, a PNG smaller than the crop (upscaled)


def image_input(pre: Preprocessing, inputs: list[TensorSpec]) -> TensorSpec:
    """The input images feed: `pre.input`, or the model's only input."""
    names = [spec.name for spec in inputs]
    if pre.input is not None:
        if pre.input not in names:
            raise UsageError(f"preprocessing.input {pre.input!r} is not a model input (inputs: {', '.join(names)})")
        return next(spec for spec in inputs if spec.name == pre.input)
    if len(inputs) != 1:
        raise UsageError("preprocessing.input must name the image input of a model with several inputs "
                         f"({', '.join(names)})")
    return inputs[0]


def _axes(layout: str) -> tuple[int, int, int]:
    """(channel, height, width) axes of a batch of images in `layout`."""
    return (1, 2, 3) if layout == "NCHW" else (3, 1, 2)


def fit_preprocessing(recipe: Recipe, inputs: list[TensorSpec], notes: list[str]) -> Recipe:
    """`recipe` with a preprocessing that can feed the model's image input (unchanged when it already
    does, or when the recipe declares none); what was changed and why is appended to `notes`.

    The crop is fitted whether it came from a bundled recipe or the user's: a square crop other than
    the model's fixed size cannot feed it at all, and keeping the resize/crop ratio keeps the same
    field of view. Raises UsageError where no crop can feed the model."""
    pre = recipe.preprocessing
    if pre is None:
        return recipe
    spec = image_input(pre, inputs)
    at = f"preprocessing ({pre.layout}, {pre.dtype}) cannot feed input {spec.name} {_fmt(spec.shape)}"
    if len(spec.shape) != 4:
        raise UsageError(f"{at}: images are rank 4, the input has rank {len(spec.shape)}; set `preprocessing: null`")
    channel, height, width = _axes(pre.layout)
    if isinstance(spec.shape[channel], int) and spec.shape[channel] != 3:
        other = "NHWC" if pre.layout == "NCHW" else "NCHW"
        hint = (f"set preprocessing.layout: {other}" if spec.shape[_axes(other)[0]] == 3
                else "images have 3 channels (RGB)")
        raise UsageError(f"{at}: dim {channel} ({pre.layout} channels) is {spec.shape[channel]}; {hint}")
    if spec.dtype != pre.dtype:
        hint = (f"set preprocessing.dtype: {spec.dtype}" if spec.dtype in ("float32", "float16", "uint8")
                else f"image preprocessing makes float32, float16 or uint8, not {spec.dtype}")
        raise UsageError(f"{at}: the input is {spec.dtype}; {hint}")
    if isinstance(spec.shape[0], int) and spec.shape[0] != 1:
        raise UsageError(f"{at}: its batch is fixed at {spec.shape[0]}, and each image is a batch of 1")
    fixed = {d for d in (spec.shape[height], spec.shape[width]) if isinstance(d, int)}
    if len(fixed) > 1:
        raise UsageError(f"{at}: it is {spec.shape[height]}x{spec.shape[width]} and the center crop is square")
    if not fixed or fixed == {pre.crop}:
        return recipe
    size = fixed.pop()
    resize = max(size, round(pre.resize * size / pre.crop))
    fitted = pre.model_copy(update={"crop": size, "resize": resize})
    note = (f"Preprocessing fitted to input {spec.name} {_fmt(spec.shape)}: crop {pre.crop} -> {size}, resize "
            f"{pre.resize} -> {resize} (the same resize/crop ratio): a {pre.crop} px crop cannot feed a model fixed at "
            f"{size}x{size}. The artifact records and applies the fitted values; set preprocessing.resize and .crop "
            "in a recipe to choose others.")
    log.warning("%s", note)
    notes.append(note)
    return recipe.model_copy(update={"preprocessing": fitted})


def generated_images(folder: Path, pre: Preprocessing, count: int = IMAGE_CHECK_COUNT, seed: int = 0) -> list[Path]:
    """`count` seeded smooth RGB images (random colour fields, bicubic-upscaled) of different sizes and
    formats around `pre`'s resize: landscape and portrait JPEGs larger than it, a PNG smaller than the crop."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    sizes = [(round(pre.resize * 1.5), pre.resize), (pre.resize, round(pre.resize * 1.25)),
             (max(8, pre.crop // 2), max(8, pre.crop // 2))]
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        width, height = sizes[index % len(sizes)]
        field = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
        path = folder / f"generated_{index:02d}.{'png' if index % len(sizes) == 2 else 'jpg'}"
        field.save(path)
        paths.append(path)
    return paths


def _fmt(shape: list) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def image_path_agreement(reference, job_samples: list[dict], reference_outputs: list[dict], output: str) -> str:
    """The sign-off's line on an image path that is not the host's (the torch backend's tensor path): the fp32
    reference run on the path's inputs agrees with itself on the host path's inputs on this share of top-1 classes.
    The gate judges the candidate on the path's inputs; this isolates what the path alone changes."""
    agree = 0
    with reference:
        for sample, expected in zip(job_samples, reference_outputs):
            got = reference.infer(sample, check_inputs=False)[output]
            agree += int(np.argmax(got) == np.argmax(expected[output]))
    total = len(job_samples)
    return (f"Image path: the artifact's job decodes and preprocesses with tensor ops on its device, not Pillow; the "
            f"fp32 reference agrees with itself across the two paths on {agree} of {total} top-1 classes "
            f"({agree / total:.1%}) of the evaluation images.")
