"""Module-level precision transforms for the torch backend: a reduced-precision copy of a module with float32 at its
boundary and a block list kept in float32. Imports torch at module level: import this module only where torch is
needed (torch is an optional extra)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

from accel_opt.errors import UsageError
from accel_opt.recipe.types import Precision

REDUCED_DTYPES = {Precision.fp16: torch.float16, Precision.bf16: torch.bfloat16}


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """Every floating tensor in `value` (a tensor, or tuples/lists/dicts of them) cast to `dtype`."""
    return tree_map(lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v, value)


class CastIO(torch.nn.Module):
    """A reduced-precision model with the caller's dtypes at its boundary: float inputs cast to `dtype`, float outputs
    cast back to float32, inside the exported program."""

    def __init__(self, inner: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, *args: Any) -> Any:
        return cast_floats(self.inner(*cast_floats(args, self.dtype)), torch.float32)


class KeptFloat32(torch.nn.Module):
    """A submodule kept in float32 inside a reduced-precision model: its inputs cast up, its outputs back down."""

    def __init__(self, inner: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return cast_floats(self.inner(*cast_floats(args, torch.float32),
                                      **cast_floats(kwargs, torch.float32)), self.dtype)


def precision_module(module: torch.nn.Module, precision: Precision, keep_fp32: Sequence[str] = ()) -> torch.nn.Module:
    """`module` (not modified) transformed for a reduced float precision: a copy in that dtype, float32 in and out,
    the submodules named in `keep_fp32` kept in float32. fp32 returns the module itself."""
    if precision is Precision.fp32:
        return module
    dtype = REDUCED_DTYPES[precision]
    inner = copy.deepcopy(module).to(dtype)
    for name in keep_fp32:
        parent_name, _, child = name.rpartition(".")
        try:
            parent = inner.get_submodule(parent_name)
            sub = parent.get_submodule(child)
        except AttributeError:
            raise UsageError(f"keep in fp32: the module has no submodule {name!r}") from None
        setattr(parent, child, KeptFloat32(sub.float(), dtype))
    return CastIO(inner, dtype).eval()


def leaf_modules(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The submodules holding parameters and no children with parameters: the units a block list can keep."""
    return [(name, sub) for name, sub in module.named_modules()
            if name and any(True for _ in sub.parameters(recurse=False))]
