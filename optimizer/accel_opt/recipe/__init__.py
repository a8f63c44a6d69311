"""Recipes: what to build and how to judge it, as YAML validated by pydantic (unknown keys refused, safe loading).
CLI flags the user actually gave override recipe values; nothing else does.

By concern: `types` (the enumerations), `gate` (tolerances, task metrics, the data split, the confidence), `deployed`
(what a folder records and `accel-opt run` reads: preprocessing, text stage, postprocess), `stages` (the build's keys
stage by stage), `schema` (the Recipe, its fingerprint and overrides) and `load` (YAML, the command line's shapes).
recipes/default.yaml lists every key with its default and why, in order.

The names below are the documented API (`from accel_opt.recipe import Recipe, Precision, load_recipe`); inside the
package, modules import from the concern modules.
"""

from accel_opt.recipe.load import load_recipe
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.types import BackendName, Precision

__all__ = ["BackendName", "Precision", "Recipe", "load_recipe"]
