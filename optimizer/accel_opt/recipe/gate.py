"""The accuracy gate's keys: per-precision tolerances (the one definition of "within tolerance"), the task metrics,
the split of --data into calibration, steering and held-out samples, and the confidence a sign-off is stated at."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from accel_opt.recipe.types import ErrorStat, Precision, _Strict


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
    - `strict_min_bound`: with `max_failing_fraction` 0, a reduced-precision build on real data also needs enough
      held-out samples for none failing to show at least this share within tolerance by its lower bound. 0.95 takes
      59 samples at 95% confidence: a sign-off then says at least 95% of inputs like these stay within tolerance, the
      level of the bundled recipes' own minimums (detector boxes 0.95, top-1 0.97, neighbours 0.9), and 59 is what
      about 100 --data samples hold out for an int8 build (70 for fp16/bf16); fewer is exit 6 with the count. fp32 is
      judged on the count alone (against the float32 noise floor), and so are synthetic inputs, which certify no rate.
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
    strict_min_bound: float = Field(default=0.95, gt=0, lt=1)


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
    # Samples that share a source, grouped (data.groups): whole groups are dealt, and held-out groups are the trials.
    group_pattern: str | None = None  # a regex over each sample's name: its first capture group (or match) is the group
    groups_file: str | None = None  # a CSV with the columns file,group

    @model_validator(mode="after")
    def _one_way_to_group(self) -> SplitConfig:
        if self.group_pattern is not None and self.groups_file is not None:
            raise ValueError("give group_pattern or groups_file, not both")
        if self.group_pattern is not None:
            try:
                re.compile(self.group_pattern)
            except re.error as exc:
                raise ValueError(f"group_pattern {self.group_pattern!r} is not a regular expression: {exc}") from None
        return self

    @model_validator(mode="after")
    def _leaves_a_verdict_share(self) -> SplitConfig:
        if self.calibration_fraction + self.steering_fraction > 0.9:
            raise ValueError("calibration_fraction + steering_fraction is "
                             f"{self.calibration_fraction + self.steering_fraction:g}: "
                             "keep them at most 0.9 together, so that at least a tenth of --data is held out to judge "
                             "the build")
        return self


class LabelsConfig(_Strict):
    """Accuracy on the user's labels (--labels): top-k accuracy under fp32 and the candidate on the held-out samples,
    and a gate on the drop, bounded by a paired one-sided bound at accuracy.confidence (accuracy.labeled). The
    agreement gate still applies (`gate: both`); `max_drop` or `min_relative` adds this one. `gate: labels` gates on
    the labels alone: agreement with fp32 is still measured and reported, not gated (a model whose reduced precision
    flips many predictions without losing accuracy ships)."""

    source: str | None = None  # "folders" (ImageFolder layout of --data) or a file,label CSV
    classes: str | None = None  # class names, one per line: CSV labels may be names
    output: str | None = None  # the output of class scores (default: the first)
    top_k: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 5])  # k above the classes: left out
    max_drop: float | None = Field(default=None, ge=0, le=1)  # absolute: 0.01 is one point of top-1 (NNCF, Olive)
    min_relative: float | None = Field(default=None, gt=0, le=1)  # of fp32's top-1 accuracy: 0.99 (MLPerf)
    gate: Literal["both", "labels"] = "both"  # which gates decide: agreement with fp32 and the labels, or the labels

    @model_validator(mode="after")
    def _one_limit(self) -> LabelsConfig:
        if self.max_drop is not None and self.min_relative is not None:
            raise ValueError("give max_drop (absolute) or min_relative (of fp32's accuracy), not both")
        if self.gate == "labels" and self.max_drop is None and self.min_relative is None:
            raise ValueError("gate: labels needs a limit on the drop (max_drop or min_relative), or nothing is gated")
        return self

    @property
    def labels_only(self) -> bool:
        """Only the labels gate: agreement with fp32 is reported, not gated."""
        return self.gate == "labels" and self.source is not None


class AccuracyConfig(_Strict):
    tolerances: dict[Precision, Tolerance] = Field(default_factory=_default_tolerances)
    task_metrics: list[TaskMetric] = Field(default_factory=list)
    # Held-out samples judged at most. Every judged sample's outputs are held for the verdict (the reference's and
    # the candidate's): a classifier's logits take KiB, a 640x640 detector's head ~11 MiB per sample in float64.
    max_samples: int = Field(default=300, ge=1)
    synthetic_samples: int = Field(default=8, ge=1)  # held-out samples generated when no --data is given
    seed: int = Field(default=0, ge=0)  # fixes the split into calibration, steering and held-out samples
    # A reduced-precision build signs off only where every rate's one-sided lower bound at this confidence clears its
    # minimum (Clopper-Pearson); too few held-out samples for that is its own verdict, with the number needed.
    confidence: float = Field(default=0.95, gt=0.5, lt=1)
    split: SplitConfig = Field(default_factory=SplitConfig)
    # Evaluation samples the folder's probe set keeps for re-checks on another machine class (all of them when the
    # gate judged fewer): a per-sample gate needs enough samples for one broken sample to show.
    probe_samples: int = Field(default=16, ge=1)
    labels: LabelsConfig = Field(default_factory=LabelsConfig)

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
