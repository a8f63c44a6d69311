"""Recipes from YAML (safe loading; a path or a bundled name from recipes/) and the command line's trtexec-style
shapes and batch axes."""

from __future__ import annotations

from pathlib import Path

import yaml

from accel_opt.errors import UsageError, first_line
from accel_opt.recipe.problems import key_lines
from accel_opt.recipe.schema import DEFAULT_RECIPE_NAME, Recipe, _validate

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"  # package data: in the wheel; recipes/ at the top of the
# repository is a link to it


def load_recipe(path_or_name: str | Path | None = None) -> Recipe:
    """Load a recipe from a YAML path or a bundled name (`recipes/<name>.yaml`); None: the default. A recipe may start
    from another with `extends: NAME` (a bundled name, or a path beside it): its keys are laid over that recipe's,
    mappings merged key by key, anything else replaced."""
    path = _recipe_path(path_or_name)
    # Where each key is, read only for an error: this file's own keys (an extended recipe's are not located)
    return _validate(_read_extended(path, []), source=str(path),
                     lines=lambda: key_lines(path.read_text(encoding="utf-8")))


def _recipe_path(path_or_name: str | Path | None, beside: Path | None = None) -> Path:
    if path_or_name is None:
        path_or_name = DEFAULT_RECIPE_NAME
    path = Path(path_or_name)
    if beside is not None and not path.is_absolute() and (beside / path).is_file():
        path = beside / path
    if not path.suffix and not path.is_file():  # a bundled name, even beside a folder of that name
        path = RECIPES_DIR / f"{path_or_name}.yaml"
    if not path.is_file():
        bundled = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
        raise UsageError(f"recipe not found: {path_or_name} (bundled: {', '.join(bundled)})")
    return path


MAX_EXTENDS = 8  # recipes extending recipes: deeper than this is a loop or a mistake


def _read_extended(path: Path, chain: list[Path]) -> dict:
    """The recipe document at `path` laid over the one it extends (recursively); a loop is refused."""
    if path.resolve() in chain or len(chain) >= MAX_EXTENDS:
        names = " -> ".join(p.stem for p in [*chain, path.resolve()])
        raise UsageError(f"recipe {path}: `extends` loops or nests too deep ({names})")
    data = _read_document(path)
    base_name = data.pop("extends", None)
    if base_name is None:
        return data
    if not isinstance(base_name, str) or not base_name:
        raise UsageError(f"recipe {path}: extends: expected a recipe name or path, got {base_name!r}")
    base = _read_extended(_recipe_path(base_name, beside=path.parent), [*chain, path.resolve()])
    return _laid_over(base, data)


def _laid_over(base: dict, data: dict) -> dict:
    merged = dict(base)
    for key, value in data.items():
        merged[key] = _laid_over(base[key], value) if isinstance(value,
                                                                 dict) and isinstance(base.get(key), dict) else value
    return merged


def _read_document(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise UsageError(f"recipe {path}: not valid YAML: {first_line(exc)}") from None
    except RecursionError:  # yaml's parser recurses per level: a document nested hundreds deep
        raise UsageError(f"recipe {path}: nested too deeply to be a recipe") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UsageError(f"recipe {path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def parse_batch_axes(text: str) -> dict[str, int | None]:
    """Parse 'state:1,sr:none': the batch axis per input, `none` for an input that is not batched."""
    axes: dict[str, int | None] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, axis = item.rpartition(":")
        if not sep or not name or not (axis.isdigit() or axis.lower() == "none"):
            raise UsageError(f"--batch-axes: expected NAME:AXIS or NAME:none, got {item!r}")
        axes[name] = None if axis.lower() == "none" else int(axis)
    if not axes:
        raise UsageError("--batch-axes: no axes given")
    return axes


MAX_DIM = 2**31 - 1


def parse_shapes(text: str) -> dict[str, list[int]]:
    """Parse trtexec-style shapes: 'input:1x3x224x224,mask:1x128'. Input names may contain ':'."""
    shapes: dict[str, list[int]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, dims = item.rpartition(":")
        if not sep or not name:
            raise UsageError(f"--shapes: expected NAME:DIMxDIM..., got {item!r}")
        try:
            values = [int(d) for d in dims.lower().split("x")]
        except ValueError:
            raise UsageError(f"--shapes: dimensions of {name!r} must be integers, got {dims!r}") from None
        if any(v < 1 for v in values):
            raise UsageError(f"--shapes: dimensions of {name!r} must be >= 1, got {dims!r}")
        if any(v > MAX_DIM for v in values):  # ONNX Runtime and TensorRT index a dim with 32 bits
            raise UsageError(f"--shapes: dimensions of {name!r} must be <= {MAX_DIM}, got {dims!r}")
        shapes[name] = values
    if not shapes:
        raise UsageError("--shapes: no shapes given")
    return shapes
