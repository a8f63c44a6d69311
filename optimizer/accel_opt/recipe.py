"""Recipe schema: what to build and how to judge it.

A recipe is YAML validated by pydantic (unknown keys rejected, safe loading). CLI flags the user
actually gave override recipe values; nothing else does.

One module: it is the reference of every recipe key, its default and why, in the order of recipes/default.yaml;
split, a user reading what a key means would have to chase it through several files.
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

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
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
    torch = "torch"  # PyTorch 2: torch.export + AOTInductor, for models given as a PyTorch factory


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


ErrorStat = Literal["mean", "median", "max"]
# CPU kernel classes (accel_opt.machine.cpu.CPU_CLASSES plus the non-x86 ones), or "host": this machine's.
TargetCpu = Literal["host", "avx2", "avx512", "avx_vnni", "avx512_vnni", "amx", "arm64", "other"]


class Tolerance(_Strict):
    """The numeric gate of one precision. Every output of every evaluation sample is judged; this is
    the one definition of "within tolerance" the project uses (build gate, cleanup check, export check).

    Errors are measured in units of the output's *scale*: |candidate - reference| divided by the
    standard deviation of that reference output over all evaluation samples (its largest |value| if
    it is constant, 1 if it is all zeros). A box coordinate in pixels and a probability are judged
    alike: 0.01 means "1% of the spread of that output's values".

    - `max_error`: the `error_stat` of the scaled error over all samples together.
    - `max_sample_error`: the same statistic within each sample; every sample must hold it.
    - `min_cosine`: cosine similarity of candidate and reference over all samples together.
    - `min_sample_cosine`: each sample's cosine. A sample whose reference is ~all zeros (RMS below
      1% of the output's RMS) has no meaningful direction: it is skipped, and the report says so;
      its scaled error is still judged.
    - `max_gain_error`: |g - 1| for the least-squares gain g = <cand, ref> / <ref, ref> over all
      samples: a systematic scale error, which cosine cannot see (cand = 1.09 * ref has cosine 1).
    - `atol`/`rtol` (optional, in the output's own units): Polygraphy's element rule
      |cand - ref| <= atol + rtol * |ref|, aggregated with `error_stat`; checked only when given.
    - NaN or Inf in a candidate output always fails.
    - `min_agreement`: integer and boolean outputs (class ids from an ArgMax, masks, indices) are compared
      exactly, not by distance: the fraction of their elements equal to the reference, over all samples.
      A near-tie argmax flips under any rounding, so one changed id must not fail a build by itself.
    - `max_failing_fraction`: the share of samples that may fail the per-sample limits. 0 (the default) is strict:
      one failing sample fails the build. Above 0, a reduced-precision build signs off only where the one-sided
      upper confidence bound of the failing share (accuracy.confidence) stays within it, on held-out samples.
    """

    max_error: float = Field(ge=0)
    max_sample_error: float = Field(ge=0)
    min_cosine: float = Field(ge=-1, le=1)
    min_sample_cosine: float = Field(ge=-1, le=1)
    max_gain_error: float = Field(ge=0)
    error_stat: ErrorStat = "mean"
    atol: float | None = Field(default=None, ge=0)
    rtol: float | None = Field(default=None, ge=0)
    min_agreement: float = Field(default=0.98, ge=0, le=1)
    max_failing_fraction: float = Field(default=0.0, ge=0, lt=1)


def _default_tolerances() -> dict[Precision, Tolerance]:
    return {
        # fp32: only graph rewrites and kernel choice differ from the reference (~1e-6 of the scale, but fused
        # re-parameterized blocks reach more: PP-OCRv4 det on ORT, optimized vs not, 2.3e-3 at the worst pixel).
        Precision.fp32: Tolerance(max_error=1e-2, max_sample_error=1e-2, min_cosine=0.99999, min_sample_cosine=0.9999,
                                  max_gain_error=1e-4, error_stat="max", min_agreement=0.999),
        # fp16: 10-bit mantissa, ~1e-3 relative per op, accumulating through depth.
        Precision.fp16: Tolerance(max_error=1e-2, max_sample_error=2e-2, min_cosine=0.999, min_sample_cosine=0.99,
                                  max_gain_error=5e-3, min_agreement=0.99),
        # bf16: 7-bit mantissa, ~8x coarser than fp16 (YOLOv8n on OpenVINO bf16: 6e-4 of the scale, cosine 0.99999).
        Precision.bf16: Tolerance(max_error=4e-2, max_sample_error=8e-2, min_cosine=0.99, min_sample_cosine=0.98,
                                  max_gain_error=2e-2),
        # int8: ~1/255 of each tensor's range per step, compounded over depth (ResNet-50 here: cosine
        # 0.998, ~0.05 of the scale); a gain 5% off is a calibration fault, not rounding noise.
        Precision.int8: Tolerance(max_error=0.1, max_sample_error=0.2, min_cosine=0.99, min_sample_cosine=0.98,
                                  max_gain_error=0.05),
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


class NeighbourMetric(_Strict):
    """Retrieval agreement: for each evaluation sample, its nearest neighbour (cosine) among the other samples'
    candidate embeddings is the one the fp32 reference's embeddings name. Needs at least 3 samples."""

    kind: Literal["neighbours"] = "neighbours"
    output: str | None = None
    min_agreement: float = Field(default=0.9, ge=0, le=1)


class DetectionMetric(_Strict):
    """Detector agreement: the candidate's boxes matched one-to-one to the reference's (same class,
    IoU >= `match_iou`), pooled over samples: precision = matched / candidate boxes, recall =
    matched / reference boxes. The reference's detections stand in for ground truth.

    `output` is the dense head ([1, 4+C, N] as YOLOv8 exports it, or [N, 4+C]), decoded with
    `box_format`, `has_objectness` and `score_threshold`, then class-aware NMS at `nms_iou`. A model
    that applies its own NMS sets `decoded: true`: rows are [x1, y1, x2, y2, score, class].
    """

    kind: Literal["detection"] = "detection"
    output: str | None = None
    decoded: bool = False
    box_format: Literal["cxcywh", "xyxy"] = "cxcywh"
    layout: Literal["auto", "rows", "columns"] = "auto"  # auto: columns ([attrs, N]) when attrs < N
    has_objectness: bool = False
    score_threshold: float = Field(default=0.25, ge=0, le=1)
    nms_iou: float = Field(default=0.45, gt=0, le=1)
    match_iou: float = Field(default=0.5, gt=0, le=1)
    min_precision: float = Field(default=0.95, ge=0, le=1)
    min_recall: float = Field(default=0.95, ge=0, le=1)


TaskMetric = Annotated[TopKMetric | CosineMetric | NeighbourMetric | DetectionMetric, Field(discriminator="kind")]


class SplitConfig(_Strict):
    """How --data is divided into three disjoint roles, deterministically (accuracy.seed) and recorded in the
    manifest: samples that calibrate int8 ranges, samples that steer choices (the fallback's search, auto's
    shortlist, the cleanup check) and held-out samples that only judge the final verdict. Calibration needs far
    fewer samples than a verdict sized by its confidence bound, so the verdict gets the rest. A build that does not
    calibrate (fp32, fp16, bf16) gives the calibration share to the verdict; the steering share is the same for
    every candidate of one `--precision auto` run. `--eval-data` replaces the verdict share with its own samples."""

    # Of --data, at most precision_options.calibration.samples: min/max ranges settle on a few dozen images.
    calibration_fraction: float = Field(default=0.25, gt=0, lt=1)
    steering_fraction: float = Field(default=0.15, ge=0, lt=1)
    max_steering: int = Field(default=32, ge=0)  # a search judges every variant on these: more costs time


class AccuracyConfig(_Strict):
    tolerances: dict[Precision, Tolerance] = Field(default_factory=_default_tolerances)
    task_metrics: list[TaskMetric] = Field(default_factory=list)
    # Held-out samples judged at most. Every judged sample's outputs are held for the verdict (the reference's and
    # the candidate's): a classifier's logits take KiB, a 640x640 detector's head ~11 MiB per sample in float64.
    max_samples: int = Field(default=300, ge=1)
    synthetic_samples: int = Field(default=8, ge=1)  # held-out samples generated when no --data is given
    seed: int = 0  # fixes the split into calibration, steering and held-out samples
    # A reduced-precision build signs off only where every rate's one-sided lower bound at this confidence clears its
    # minimum (Clopper-Pearson); too few held-out samples for that is its own verdict, with the number needed.
    confidence: float = Field(default=0.95, gt=0.5, lt=1)
    split: SplitConfig = Field(default_factory=SplitConfig)
    # Evaluation samples the folder's probe set keeps for re-checks on another machine class (all of them when the
    # gate judged fewer): a per-sample gate needs enough samples for one broken sample to show.
    probe_samples: int = Field(default=16, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _merge_tolerances(cls, data: Any) -> Any:
        # A recipe that tightens fp16's cosine keeps fp16's other defaults and the other precisions'.
        if isinstance(data, dict) and isinstance(data.get("tolerances"), dict):
            merged = {p.value: t.model_dump() for p, t in _default_tolerances().items()}
            for precision, given in data["tolerances"].items():
                key = precision.value if isinstance(precision, Precision) else precision
                merged[key] = {**merged.get(key, {}), **given} if isinstance(given, dict) else given
            data = {**data, "tolerances": merged}
        return data


class BenchmarkConfig(_Strict):
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 8])
    warmup_iterations: int = Field(default=10, ge=0)
    min_iterations: int = Field(default=50, ge=1)
    max_iterations: int = Field(default=2000, ge=1)
    min_seconds: float = Field(default=2.0, ge=0)  # per batch size, after warm-up
    threads: int | None = Field(default=None, ge=1)  # intra-op threads; default: CPUs available
    # The sweep: every batch size x concurrency (workers with a session each, requests back to back),
    # each point measured in windows until the last 3 windows' throughput is within stability_pct of
    # their mean (perf_analyzer's criterion), at most max_windows.
    concurrency: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 2])
    window_seconds: float = Field(default=0.5, gt=0)
    stability_pct: float = Field(default=10.0, gt=0)
    max_windows: int = Field(default=8, ge=4)
    # Budgets the recommended configuration must meet; one nothing meets fails the build (exit 1).
    p99_budget_ms: float | None = Field(default=None, gt=0)
    memory_budget_mib: float | None = Field(default=None, gt=0)  # peak process memory at any point, capacity included
    # The largest shapes the deployment must take (trtexec's --maxShapes): the capacity point runs at them.
    max_shapes: dict[str, list[Annotated[int, Field(ge=1)]]] = Field(default_factory=dict)


class CleanupConfig(_Strict):
    # The simplified model is used only if it matches the original within the fp32 tolerance.
    enabled: bool = True


class Preprocessing(_Strict):
    """How image files in --data become tensors (ImageNet-style by default)."""

    input: str | None = None  # default: the model's first input
    resize: int = 256  # shorter side, pixels
    crop: int = 224  # center crop, pixels
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    dtype: Literal["float32", "float16", "uint8"] = "float32"
    # Normalize and lay out inside the model: it takes the host's uint8 HWC crops (4x fewer bytes to move,
    # the arithmetic on the backend); decoding, resizing and cropping stay on the host. The gate checks the
    # fused model on those crops against the reference on the host pipeline's floats.
    fused: bool = False
    # JPEG decoding at 1/2, 1/4 or 1/8 scale in the DCT domain (Pillow's draft mode) when the image is at
    # least that much larger than `resize`: several times less decoding work. The pixels differ from a full
    # decode, so the gate runs the candidate on draft-decoded inputs against the reference on full decodes.
    draft_decode: bool = False

    def host_part(self) -> Preprocessing:
        """What the host still does: decode, resize, crop, as uint8 HWC when the rest is fused."""
        return self.model_copy(update={"dtype": "uint8", "layout": "NHWC", "fused": False}) if self.fused else self


class TextStage(_Strict):
    """How text inputs become token tensors: a Hugging Face `tokenizers` file (tokenizer.json), truncation and
    which tokenizer output feeds which model input. The artifact folder carries the tokenizer file."""

    # tokenizer.json; null: the factory's `tokenizer_file` hint, else tokenizer.json next to the model.
    tokenizer: str | None = None
    max_length: int = Field(default=128, ge=1)  # tokens, special tokens included
    # Off: a text longer than max_length is rejected (into the errors file) instead of cut.
    truncation: bool = True
    truncation_side: Literal["right", "left"] = "right"
    field: str = "text"  # the JSON Lines field, or the Parquet/CSV column, holding the text
    # model input -> tokenizer output (ids, attention_mask, type_ids); inputs the model lacks are left out.
    inputs: dict[str, Literal["ids", "attention_mask", "type_ids"]] = Field(default_factory=lambda: {
        "input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"})
    # A batch is padded to its longest text, rounded up to the next of these lengths when given: fewer distinct
    # shapes for backends that compile per shape. Empty: pad to the longest text exactly.
    length_buckets: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)
    # Texts the job reads ahead and sorts by length before batching: more similar lengths in a batch, still
    # answered in input order, memory bounded by this many texts (their token ids, a few KiB each).
    sort_window: int = Field(default=2048, ge=1)
    # A batch takes texts in length order while rows x padded length stays within this many tokens (and always at
    # least the deployed batch): short texts run in large batches, long ones in the deployed batch. null: the
    # deployed batch x max_length, the shape the capacity run measured. Static-batch models keep their batch.
    batch_tokens: int | None = Field(default=None, ge=1)


class EmbeddingOutput(_Strict):
    """An embedding per input: `output` (default: the first) pooled over the tokens (`mean` over the attention mask,
    `cls`: the first token, `none`: the model pools itself), L2-normalized unless `normalize` is false."""

    output: str | None = None
    pooling: Literal["none", "mean", "cls"] = "none"
    normalize: bool = True
    file: Literal["npy", "parquet"] = "npy"  # also written at the end of a job: PREDICTIONS.embeddings.npy|.parquet


class Postprocess(_Strict):
    """What `accel-opt run` writes per input. `topk`: a classifier's `top1` and `topk` [[class, score], ...]
    from `output` (default: the first), scores softmax-ed unless `softmax` is false. `embedding`: the input's
    vector (see EmbeddingOutput). Without a postprocess section every output is saved to one .npz per input."""

    topk: int | None = Field(default=None, ge=1)
    output: str | None = None
    softmax: bool = True
    embedding: EmbeddingOutput | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> Postprocess:
        if (self.topk is None) == (self.embedding is None):
            raise ValueError("give one of topk (a classifier) or embedding")
        return self


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
    # The CPU class the int8 graph is built for (its kernels decide the weights' range): "host" is this machine.
    # On avx2 / avx512 without VNNI the u8 x s8 kernels sum pairs in int16 and saturate: 7-bit weights there.
    target_cpu: TargetCpu = "host"
    # 7-bit weights: None follows target_cpu (on where the kernels saturate); true/false overrides that.
    reduce_range: bool | None = None


class FallbackConfig(_Strict):
    """Accuracy-driven fallback for int8/fp16/bf16: when the reduced build fails the recipe's tolerance and task
    metrics on the probe samples, a measured search (other calibrations, then groups of layers restored to float in
    the order of their measured gain) looks for a build that passes while it still pays in speed."""

    enabled: bool = True
    max_rounds: int = Field(default=8, ge=1)  # groups of layers added to the float set, at most
    # The speed budget: the search keeps nothing in float that would take the build below this speed-up over the same
    # backend's fp32 build (timed on the deployed kernels), and does not search at all for a build that starts below it.
    min_speedup: float = Field(default=1.1, gt=0)
    # The time budget of the search, wall clock, checked before each build: a mobile classifier's search fits in
    # about ten minutes on two cores.
    time_budget_s: float = Field(default=600.0, gt=0)
    # Groups measured one by one (each a build); with more, those the per-layer diagnosis blames most.
    max_measured_units: int = Field(default=32, ge=1)
    # An optional cap on the Conv/MatMul/Gemm FLOPs left in float; the speed budget decides by default.
    max_fp32_flops_fraction: float = Field(default=1.0, gt=0, le=1)
    probe_samples: int = Field(default=16, ge=1)  # the first steering samples, judged for every variant of the search
    diagnosis_samples: int = Field(default=4, ge=1)  # the first probes, run layer by layer (the costly part)
    # fp16: nodes whose fp32 activations exceed this on a probe sample stay fp32 before any build is judged
    # (float16 holds at most 65504; the margin covers inputs larger than the probes).
    fp16_activation_max: float = Field(default=8192.0, gt=0, le=65504)


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
    fallback: FallbackConfig = Field(default_factory=FallbackConfig)


# What each `selection.objective` counts (the selection report says it).
OBJECTIVES = {
    "latency": "lowest p50 at batch 1",
    "throughput": "most samples/s at the target batch",
    "throughput_within_p99": "most samples/s at any benchmarked batch whose p99 meets the budget",
}


class SelectionConfig(_Strict):
    """How `--backend auto` / `--precision auto` pick among signed-off candidates."""

    # What `--precision auto` optimizes, every candidate timed on it in one interleaved runoff:
    #   latency: p50 at batch 1; throughput: samples/s at target_batch_size;
    #   throughput_within_p99: the best samples/s over benchmark.batch_sizes whose p99 <= latency_budget_ms.
    objective: Literal["latency", "throughput", "throughput_within_p99"] = "throughput"
    target_batch_size: int = Field(default=8, ge=1)  # the deployed batch (dynamic batch) and the throughput objective's
    latency_budget_ms: float | None = Field(default=None, gt=0)  # p99 per call; candidates over it lose
    # Wall clock for every candidate's build together (--time-budget); null: no limit. The fp32 builds run first;
    # reduced candidates share what is left for their rescue searches, and what the budget leaves untried is said.
    # 15 minutes: a 640x640 detector's four candidates (two fp32 builds, two int8 with a search) on 2 cores.
    time_budget_s: float | None = Field(default=900.0, gt=0)

    @model_validator(mode="after")
    def _budget_for_p99_objective(self) -> SelectionConfig:
        if self.objective == "throughput_within_p99" and self.latency_budget_ms is None:
            raise ValueError("objective throughput_within_p99 needs latency_budget_ms")
        return self


class TensorRtConfig(_Strict):
    """Native TensorRT builds (--backend tensorrt). Profiles default to batch 1 .. the largest benchmarked
    batch at the resolved shapes; the *_shapes here override them per input."""

    workspace_mib: int = Field(default=4096, ge=1)
    optimization_level: int = Field(default=3, ge=0, le=5)  # builder optimization level (TensorRT's default 3)
    build_timeout_s: float = Field(default=3600, gt=0)
    min_shapes: dict[str, list[Annotated[int, Field(ge=1)]]] = Field(default_factory=dict)
    opt_shapes: dict[str, list[Annotated[int, Field(ge=1)]]] = Field(default_factory=dict)
    max_shapes: dict[str, list[Annotated[int, Field(ge=1)]]] = Field(default_factory=dict)
    timing_cache_dir: str | None = None  # reused only on the same GPU and TensorRT version


class TorchConfig(_Strict):
    """The torch backend (--backend torch): an AOTInductor package compiled for one device. `device`: "cpu" or
    "cuda[:N]"; null picks the GPU when torch sees one, else the CPU (the choice is recorded in the manifest)."""

    device: str | None = Field(default=None, pattern=r"^(cpu|cuda(:\d+)?)$")


class OnnxRuntimeConfig(_Strict):
    """ONNX Runtime's execution provider (--backend onnxruntime). providers[0] runs the model; CUDA/TensorRT
    EPs need an NVIDIA GPU and onnxruntime-gpu (pip uninstall -y onnxruntime && pip install 'accel-opt[gpu]'),
    the TensorRT EP also TensorRT's libraries. Later entries are not fallbacks."""

    providers: list[Literal["CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"]] = Field(
        default_factory=lambda: ["CPUExecutionProvider"], min_length=1)
    # Off: a GPU build whose EP would leave any node to the CPU EP is refused (exit 4), naming the ops.
    allow_cpu_nodes: bool = False


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
