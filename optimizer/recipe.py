"""Recipe schema: what to build and how to judge it.

A recipe is YAML validated by pydantic (unknown keys rejected, safe loading). CLI flags the user
actually gave override recipe values; nothing else does.
"""

from __future__ import annotations

import enum
import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from accel_opt.errors import UsageError, first_line

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
DEFAULT_RECIPE_NAME = "default"


class Precision(str, enum.Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"
    int8 = "int8"


class BackendName(str, enum.Enum):
    onnxruntime = "onnxruntime"
    openvino = "openvino"
    tensorrt = "tensorrt"


class CalibrationMethod(str, enum.Enum):
    minmax = "minmax"
    entropy = "entropy"
    percentile = "percentile"


class QuantTarget(str, enum.Enum):
    """Which hardware the Q/DQ graph is tuned for (see optimizer/precision/int8.py presets)."""

    auto = "auto"  # follows the backend
    ort_cpu = "ort_cpu"
    openvino = "openvino"
    tensorrt = "tensorrt"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Tolerance(_Strict):
    """Numeric gate for one precision, applied per output over all evaluation samples together.

    An output passes when every element satisfies |cand - ref| <= atol + rtol * |ref| after
    `error_stat` aggregation (Polygraphy's SimpleCompareFunc semantics), its cosine similarity
    with the reference is at least `min_cosine`, and it holds no NaN or Inf.
    """

    atol: float = Field(ge=0)
    rtol: float = Field(ge=0)
    min_cosine: float = Field(ge=-1, le=1)
    error_stat: Literal["elemwise", "max", "mean", "median"] = "elemwise"


def _default_tolerances() -> dict[Precision, Tolerance]:
    return {
        # fp32: only graph rewrites and kernel choice differ from the reference.
        Precision.fp32: Tolerance(atol=1e-4, rtol=1e-3, min_cosine=0.99999),
        # fp16: 10-bit mantissa, ~1e-3 relative per op, accumulating through depth.
        Precision.fp16: Tolerance(atol=1e-2, rtol=1e-2, min_cosine=0.999, error_stat="mean"),
        # bf16: 7-bit mantissa, ~8x coarser than fp16.
        Precision.bf16: Tolerance(atol=5e-2, rtol=5e-2, min_cosine=0.99, error_stat="mean"),
        # int8: per-element error is bounded by the scales; judge the mean error and the direction.
        Precision.int8: Tolerance(atol=1e-1, rtol=1e-1, min_cosine=0.99, error_stat="mean"),
    }


class TopKMetric(_Strict):
    """Classifier agreement: fraction of samples whose reference top-1 class is in the candidate's top-k."""

    kind: Literal["topk"] = "topk"
    output: str | None = None  # default: the first output
    min_agreement: dict[int, float] = Field(default_factory=lambda: {1: 0.99, 5: 0.999})


class CosineMetric(_Strict):
    """Embedding agreement: per-sample cosine similarity between reference and candidate rows."""

    kind: Literal["cosine"] = "cosine"
    output: str | None = None
    min_mean_cosine: float = 0.99
    min_worst_cosine: float = 0.95


TaskMetric = Annotated[TopKMetric | CosineMetric, Field(discriminator="kind")]


class AccuracyConfig(_Strict):
    tolerances: dict[Precision, Tolerance] = Field(default_factory=_default_tolerances)
    task_metrics: list[TaskMetric] = Field(default_factory=list)
    max_samples: int = Field(default=32, ge=1)  # evaluation samples taken from --data
    synthetic_samples: int = Field(default=8, ge=1)  # generated when no --data is given
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _merge_tolerances(cls, data: Any) -> Any:
        # A recipe that tightens fp16 keeps the defaults of the other precisions.
        if isinstance(data, dict) and isinstance(data.get("tolerances"), dict):
            merged = {p.value: t.model_dump() for p, t in _default_tolerances().items()}
            merged.update(data["tolerances"])
            data = {**data, "tolerances": merged}
        return data


class BenchmarkConfig(_Strict):
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 8])
    warmup_iterations: int = Field(default=10, ge=0)
    min_iterations: int = Field(default=50, ge=1)
    max_iterations: int = Field(default=2000, ge=1)
    min_seconds: float = Field(default=2.0, ge=0)  # per batch size, after warm-up
    threads: int | None = Field(default=None, ge=1)  # intra-op threads; default: CPUs available


class CleanupConfig(_Strict):
    enabled: bool = True
    # The simplified model must match the original this closely before it is used.
    atol: float = 1e-4
    rtol: float = 1e-3


class Preprocessing(_Strict):
    """How image files in --data become tensors (ImageNet-style by default)."""

    input: str | None = None  # default: the model's first input
    resize: int = 256  # shorter side, pixels
    crop: int = 224  # center crop, pixels
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    dtype: Literal["float32", "float16", "uint8"] = "float32"


class CalibrationConfig(_Strict):
    method: CalibrationMethod = CalibrationMethod.minmax
    samples: int = Field(default=64, ge=1)
    target: QuantTarget = QuantTarget.auto
    percentile: float = Field(default=99.999, gt=90, le=100)
    num_bins: int = Field(default=2048, ge=128)  # entropy / percentile histogram bins
    per_channel: bool = True
    # Op types that get Q/DQ; None: every op ONNX Runtime has a Q/DQ kernel for (CNNs gain from
    # quantized Add/Pool too). Transformers: [MatMul, Gemm] keeps masks, softmax and norms in float.
    op_types: list[str] | None = None
    # Accuracy-driven fallback: when the int8 model's output cosine against fp32 on the calibration
    # samples is below this, the most sensitive groups of layers stay in float until it holds.
    fallback_min_cosine: float | None = Field(default=None, gt=0, le=1)


class PrecisionConfig(_Strict):
    keep_io_types: bool = True  # fp16/bf16: inputs and outputs stay fp32
    # fp16/bf16: op types kept in fp32 (overflow-prone reductions and normalizations).
    block_ops: list[str] = Field(
        default_factory=lambda: [
            "LayerNormalization", "InstanceNormalization", "GroupNormalization",
            "Softmax", "LogSoftmax", "Exp", "Pow", "ReduceMean", "ReduceSum",
            "ReduceSumSquare", "ReduceL2", "ReduceLogSumExp", "Resize", "Range", "CumSum",
        ]
    )
    block_nodes: list[str] = Field(default_factory=list)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)


class SelectionConfig(_Strict):
    """How `--backend auto` / `--precision auto` pick among signed-off candidates."""

    target_batch_size: int = Field(default=8, ge=1)  # compare candidates' p50 at this batch
    latency_budget_ms: float | None = Field(default=None, gt=0)  # candidates slower than this lose


class Recipe(_Strict):
    name: str = DEFAULT_RECIPE_NAME
    description: str = ""
    precision: Precision = Precision.fp32
    backend: BackendName = BackendName.onnxruntime
    shapes: dict[str, list[Annotated[int, Field(ge=1)]]] = Field(default_factory=dict)
    # Backends that compile faster kernels for fixed shapes (OpenVINO: dynamic batch costs 6-20% at
    # int8) compile one static model per batch size unless the deployment needs dynamic shapes.
    dynamic_shapes: bool = False
    preprocessing: Preprocessing | None = None
    cleanup: CleanupConfig = Field(default_factory=CleanupConfig)
    precision_options: PrecisionConfig = Field(default_factory=PrecisionConfig)
    accuracy: AccuracyConfig = Field(default_factory=AccuracyConfig)
    benchmark: BenchmarkConfig = Field(default_factory=BenchmarkConfig)
    selection: SelectionConfig = Field(default_factory=SelectionConfig)

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


def _validate(data: Any, source: str) -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise UsageError(f"recipe {source}: {where}: {first['msg']}{more}") from None


def load_recipe(path_or_name: str | Path | None = None) -> Recipe:
    """Load a recipe from a YAML path or a bundled name (`recipes/<name>.yaml`); None: the default."""
    if path_or_name is None:
        path_or_name = DEFAULT_RECIPE_NAME
    path = Path(path_or_name)
    if not path.suffix and not path.exists():
        path = RECIPES_DIR / f"{path_or_name}.yaml"
    if not path.is_file():
        bundled = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
        raise UsageError(f"recipe not found: {path_or_name} (bundled: {', '.join(bundled)})")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise UsageError(f"recipe {path}: not valid YAML: {first_line(exc)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UsageError(f"recipe {path}: expected a mapping at the top level, got {type(data).__name__}")
    return _validate(data, source=str(path))


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
        shapes[name] = values
    if not shapes:
        raise UsageError("--shapes: no shapes given")
    return shapes
