"""What MODEL names, and the recipe fitted to it: an ONNX file, a PyTorch factory (FILE.py:FACTORY), or a Hugging Face
model folder (config.json and its weights), whose task, labels, longest input, tokenizer and image preprocessing
the folder itself says (backends/torch/huggingface.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accel_opt.backends import get_backend
from accel_opt.errors import AccelOptError, InputRejected, UsageError
from accel_opt.recipe.load import load_recipe
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.types import Precision

MODEL_SUFFIXES = {  # model files that are not ONNX: what to do with each, in one line
    ".pt": "a PyTorch checkpoint is pickled Python: give the factory that builds the module (FILE.py:FACTORY) or its "
           "folder",
    ".pth": "a PyTorch checkpoint is pickled Python: give the factory that builds the module (FILE.py:FACTORY) or its "
            "folder",
    ".bin": "pytorch_model.bin is one part of a Hugging Face folder: give the folder (with its config.json)",
    ".safetensors": "safetensors hold weights only: give the Hugging Face folder (with its config.json) they belong to",
    ".gguf": "GGUF files are not built here yet: export the model to ONNX",
}


def model_route_problem(model: str) -> str | None:
    """Why MODEL cannot be built as given, with the route that works; None when it can be read as given."""
    path = Path(model)
    if path.is_dir() and not (path / "config.json").is_file():
        return (f"{model} is a folder without config.json: give an .onnx file, a Hugging Face model folder "
                "(config.json "
                "and weights), or a factory FILE.py:FACTORY")
    if path.is_file() and (route := MODEL_SUFFIXES.get(path.suffix.lower())):
        return f"{path.name}: {route}"
    return None


def hf_folder_of(model: str | Path, task: str | None = None):
    """The Hugging Face folder MODEL names (HfFolder), or None for anything else."""
    from accel_opt.backends.torch.huggingface import is_hf_folder, read_hf_folder

    return read_hf_folder(model, task) if is_hf_folder(model) else None


def hf_config_of(model: str | Path, task: str | None = None):
    """What a Hugging Face config says of MODEL: its folder's, or for an ONNX model exported from one (Optimum's
    layout: model.onnx beside config.json and the tokenizer) the config beside it; None when there is none."""
    path = Path(model)
    if path.suffix.lower() == ".onnx" and path.is_file() and (path.parent / "config.json").is_file():
        from accel_opt.backends.torch.huggingface import read_hf_folder

        try:
            return read_hf_folder(path.parent, task, weights=False)
        except AccelOptError:  # a config.json of something else: the model is built as an ONNX file
            return None
    return hf_folder_of(model, task)


def factory_of(model: str, task: str | None = None, hints: dict | None = None):
    """A ModuleFactory for a factory spec or a Hugging Face folder, with the command line's export `hints`
    (input_dtypes, dynamic) over its own; None for an ONNX file."""
    factory = _factory(model, task)
    if hints and factory is None:
        raise UsageError("--input-dtypes and --dynamic are for PyTorch factories and Hugging Face folders: an ONNX "
                         "model's inputs say their own dtypes and dynamic dims")
    if factory is not None:
        factory.given_hints = dict(hints or {})
    return factory


def _factory(model: str, task: str | None):
    if problem := model_route_problem(model):
        raise InputRejected(problem)
    if (hf := hf_folder_of(model, task)) is not None:
        from accel_opt.backends.torch.huggingface import hf_factory

        return hf_factory(hf)
    from accel_opt.backends.torch.factory import load_factory, looks_like_factory

    if task is not None and hf_config_of(model, task) is None:
        raise UsageError("--task is for Hugging Face model folders, and ONNX models exported from one (beside its "
                         "config.json)")
    return load_factory(model) if looks_like_factory(model) else None


def default_recipe(model: str | Path, task: str | None = None) -> str | None:
    """The bundled recipe for MODEL when none is given: the task's, for a Hugging Face folder; else None (default)."""
    hf = hf_config_of(model, task)
    return hf.recipe_name if hf is not None else None


def fit_recipe(model: str | Path, recipe: Recipe, hf) -> tuple[Recipe, list[str]]:
    """The recipe fitted to what MODEL's Hugging Face config says (`hf`, from hf_config_of; None: unchanged), and
    notes saying what."""
    if hf is None:
        return recipe, []
    overrides: dict[str, Any] = {}
    notes = [f"Hugging Face folder {Path(model).name}: {hf.architecture}, {hf.task}"
             + (f", labels {', '.join(hf.labels[:5])}{', ...' if len(hf.labels) > 5 else ''}" if hf.labels else "")]
    if hf.is_text:
        if recipe.text is None:
            raise UsageError(f"{Path(model).name} is a text model ({hf.task}); the recipe {recipe.name!r} has no text "
                             f"stage: use --recipe {hf.recipe_name}")
        limit = hf.max_length
        if limit is not None and recipe.text.max_length > limit:
            overrides["text.max_length"] = limit
            overrides["text.length_buckets"] = sorted({b for b in recipe.text.length_buckets if b < limit} | {limit})
            notes.append(f"texts cut at {limit} tokens, the most the model takes (recipe: {recipe.text.max_length})")
    else:
        if recipe.preprocessing is None:
            raise UsageError(f"{Path(model).name} is an image model; the recipe {recipe.name!r} has no preprocessing: "
                             f"use --recipe {hf.recipe_name}")
        pre = hf.image_preprocessing()
        overrides["preprocessing"] = {**recipe.preprocessing.model_dump(mode="json"), **pre}
        if not recipe.shapes and _takes_pixel_values(model):
            overrides["shapes"] = {"pixel_values": [1, 3, pre["crop"], pre["crop"]]}
        notes.append(f"images resized to {pre['resize']} px, centre-cropped to {pre['crop']} px, normalized with the "
                     "folder's image processor's mean and std")
    post = recipe.postprocess
    if post is not None and post.topk is not None:
        overrides["postprocess.topk"] = min(post.topk, hf.num_labels)
        overrides["postprocess.labels"] = hf.labels
        # top-k agreement with k beyond the number of classes says nothing
        overrides["accuracy.task_metrics"] = [
            {**m, "min_agreement": {k: v for k, v in m["min_agreement"].items() if int(k) < hf.num_labels}
             or {1: m["min_agreement"].get(1, 0.97)}}
            if m.get("kind") == "topk" else m for m in recipe.model_dump(mode="json")["accuracy"]["task_metrics"]]
    return recipe.with_overrides(**overrides), notes


def _takes_pixel_values(model: str | Path) -> bool:
    """A folder's exported module does; an ONNX model where its graph has that input."""
    if Path(model).suffix.lower() != ".onnx":
        return True
    import onnx

    return "pixel_values" in {i.name for i in onnx.load(str(model), load_external_data=False).graph.input}


def fit_defaults(recipe: Recipe, has_data: bool) -> tuple[dict[str, str], str | None]:
    """For a model built with its task's bundled recipe and neither --precision nor --backend: the recipe's own when
    they run here with what was given, else fp32 on ONNX Runtime (portable, needs no data); a note says why."""
    try:
        backend = get_backend(recipe.backend)
        support = backend.supports(recipe.precision)
    except AccelOptError as exc:
        support, why = False, str(exc)
    else:
        why = support.reason if not support else None
    if support and (has_data or recipe.precision is not Precision.int8):
        return {}, None
    why = why or f"--precision {recipe.precision.value} needs --data to calibrate"
    return ({"precision": "fp32", "backend": "onnxruntime"},
            f"the recipe {recipe.name!r} builds {recipe.precision.value} on {recipe.backend.value}, which cannot run "
            f"here as given ({why}): built fp32 on onnxruntime instead")


def recipe_for(model: str | Path, recipe: Recipe | None, task: str | None, has_data: bool) -> tuple[Recipe, list[str]]:
    """The recipe a build of MODEL uses when given `recipe` (None: the task's bundled one, fitted to run here)."""
    hf, notes = hf_config_of(model, task), []  # the config read once
    if recipe is None:
        recipe = load_recipe(hf.recipe_name if hf is not None else None)
        overrides, note = fit_defaults(recipe, has_data) if hf is not None else ({}, None)
        recipe = recipe.with_overrides(**overrides)
        notes += [note] if note else []
    fitted, fit_notes = fit_recipe(model, recipe, hf)
    return fitted, fit_notes + notes
