"""The recipe: every section together, its content fingerprint (part of a build's identity) and the overrides the
command line gives (`with_overrides`: only flags the user gave; dotted keys)."""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import Field, ValidationError, model_validator

from accel_opt.errors import UsageError
from accel_opt.recipe.deployed import Postprocess, Preprocessing, TextStage
from accel_opt.recipe.gate import AccuracyConfig, Tolerance
from accel_opt.recipe.stages import (
    BenchmarkConfig,
    CleanupConfig,
    OnnxRuntimeConfig,
    PrecisionConfig,
    SelectionConfig,
    TensorRtConfig,
    TorchConfig,
)
from accel_opt.recipe.types import BackendName, Precision, _Strict

DEFAULT_RECIPE_NAME = "default"


class Recipe(_Strict):
    name: str = DEFAULT_RECIPE_NAME
    description: str = ""
    precision: Precision = Precision.fp32
    backend: BackendName = BackendName.onnxruntime
    shapes: dict[str, list[Annotated[int, Field(ge=1)]]] = Field(default_factory=dict)
    # The batch axis of each input, where the model's own dims do not tell (see graph/inspect.py
    # batch_axes): null for an input that is not batched (a scalar, a fixed table).
    batch_axes: dict[str, int | None] = Field(default_factory=dict)
    # Backends that compile faster kernels for fixed shapes (OpenVINO: dynamic batch costs 6-20% at
    # int8) compile one static model per batch size unless the deployment needs dynamic shapes.
    dynamic_shapes: bool = False
    preprocessing: Preprocessing | None = None
    text: TextStage | None = None  # text inputs: tokenized by the job (exclusive with image `preprocessing`)
    postprocess: Postprocess | None = None
    cleanup: CleanupConfig = Field(default_factory=CleanupConfig)
    precision_options: PrecisionConfig = Field(default_factory=PrecisionConfig)
    accuracy: AccuracyConfig = Field(default_factory=AccuracyConfig)
    benchmark: BenchmarkConfig = Field(default_factory=BenchmarkConfig)
    selection: SelectionConfig = Field(default_factory=SelectionConfig)
    tensorrt: TensorRtConfig = Field(default_factory=TensorRtConfig)
    onnxruntime: OnnxRuntimeConfig = Field(default_factory=OnnxRuntimeConfig)
    torch: TorchConfig = Field(default_factory=TorchConfig)

    @model_validator(mode="after")
    def _one_input_kind(self) -> Recipe:
        if self.text is not None and self.preprocessing is not None:
            raise ValueError("a recipe takes images (preprocessing) or text (text), not both")
        if self.precision_options.calibration.quantizer == "nncf" and self.preprocessing and self.preprocessing.fused:
            raise ValueError("preprocessing.fused rewrites the ONNX graph, and calibration.quantizer nncf ships an "
                             "OpenVINO IR: set one of them off")
        return self

    def fingerprint(self) -> str:
        """Content hash of the resolved recipe: part of a build's identity."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    def with_overrides(self, **overrides: Any) -> Recipe:
        """Return a copy with the given top-level or dotted keys replaced; None means 'not given'."""
        data = self.model_dump(mode="json")
        for key, value in overrides.items():
            if value is None:
                continue
            node = data
            *parents, leaf = key.split(".")
            for part in parents:
                node = node[part]
            node[leaf] = value.value if isinstance(value, enum.Enum) else value
        return _validate(data, source="command line")

    @property
    def tolerance(self) -> Tolerance:
        return self.accuracy.tolerances[self.precision]


def _validate(data: Any, source: str, lines: Callable[[], dict[tuple, int]] | None = None) -> Recipe:
    """The recipe, or UsageError naming every problem at once (`lines`: reads each key path's line in the YAML file,
    called only when there are problems to place)."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        from accel_opt.recipe.problems import describe

        raise UsageError(describe(exc, Recipe, source, lines() if lines else None)) from None
