"""accel-opt: a model optimization compiler with an accuracy sign-off.

Public API: `build(model, recipe, data_dir=..., out_dir=...) -> BuildResult`, `load_recipe`,
`Recipe`, `Precision`. Heavy modules load on first use so `accel-opt --help` stays fast.

`optimizer/` is the source root and this folder, `optimizer/accel_opt/`, the package: `accel_opt.runtime.probe` is
`optimizer/accel_opt/runtime/probe.py`. The import name is not `optimizer` because ONNX Runtime's quantization
package puts a folder holding an `optimizer.py` on sys.path, which would shadow it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["BuildResult", "Precision", "Recipe", "__version__", "build", "load_recipe"]

if TYPE_CHECKING:
    from accel_opt.builder.pipeline import build
    from accel_opt.recipe.load import load_recipe
    from accel_opt.recipe.schema import Recipe
    from accel_opt.recipe.types import Precision
    from accel_opt.report.results import BuildResult


def __getattr__(name: str) -> Any:
    if name == "build":
        from accel_opt.builder.pipeline import build

        return build
    if name == "BuildResult":
        from accel_opt.report.results import BuildResult

        return BuildResult
    if name in ("Recipe", "Precision", "load_recipe"):
        from accel_opt import recipe

        return getattr(recipe, name)
    raise AttributeError(f"module 'accel_opt' has no attribute {name!r}")
