"""The gate's verdict as data: per sample, per output, per task metric, and the whole report."""

from __future__ import annotations

import logging
from typing import Literal

import numpy as np
from pydantic import BaseModel, PrivateAttr

from accel_opt.recipe import Tolerance

log = logging.getLogger(__name__)



NEAR_ZERO_RMS_FRACTION = 1e-2  # a sample whose reference RMS is below 1% of the output's has no direction
NOISE_SAMPLES = 4  # samples run through a second fp32 evaluation to measure the float32 noise floor
NOISE_FLOOR_MARGIN = 2.0  # x the measured fp32-vs-fp32 distance: other kernels' reordering lands within it
FP32_NOISE_ULPS = 64  # the floor is at least this many float32 ulps of an output's peak |value|
WORST_SAMPLES_PER_OUTPUT = 3  # listed in the sign-off besides every failing sample
MAX_LISTED_SAMPLES = 20




class SampleAccuracy(BaseModel):
    sample: str  # the file it came from (or synthetic-NNNN)
    output: str
    error: float  # the error statistic of |cand - ref| / scale within this sample
    cosine: float | None  # None: the reference is ~all zeros here, no direction to compare
    non_finite_count: int
    passed: bool


class OutputAccuracy(BaseModel):
    name: str
    shape: list[int]  # of one sample's reference output
    scale: float  # what errors are divided by
    # std of the reference; its max |value| if constant; 1 if all zero; "exact": an integer/bool output, compared
    # element by element (its error is the fraction of elements that differ, its cosine and gain are 1)
    scale_basis: Literal["std", "max abs", "unit", "exact"]
    error: float  # error statistic of the scaled error over all samples
    worst_sample_error: float
    cosine: float  # over all samples (Polygraphy)
    worst_sample_cosine: float | None
    samples_without_direction: int  # per-sample cosine skipped: reference ~all zeros
    failed_samples: int
    gain: float  # least-squares gain <cand, ref> / <ref, ref>; 1 = no systematic scale error
    max_abs_error: float  # absolute statistics over all samples (Polygraphy)
    mean_abs_error: float
    median_abs_error: float
    max_rel_error: float
    mean_rel_error: float
    non_finite_count: int  # NaN or Inf in the candidate output
    passed: bool
    agreement: float | None = None  # "exact" outputs: the fraction of elements equal to the reference
    noise_floor: float = 0.0  # absolute: differences below it are float32 noise, not error (fp32_noise_floor)


class TaskMetricResult(BaseModel):
    kind: str
    output: str
    values: dict[str, float]
    thresholds: dict[str, float]
    passed: bool
    note: str | None = None  # e.g. too few samples for the threshold to tolerate a single change
    worst_samples: list[str] = []  # samples whose prediction changed (top-k) or that lost most (detection)


class Check(BaseModel):
    """One check of the gate (an output's numeric check, a task metric threshold): what CI lists."""

    name: str  # e.g. "logits: per-sample", "task topk: top1"
    passed: bool
    line: str  # the one-line result, the failure reason when it failed


class Evaluation(BaseModel):
    """How the candidate was run: what the verdict rests on besides the data."""

    mode: Literal["batched", "per-sample"]
    batch_size: int  # rows per candidate call
    calls: int
    note: str | None = None  # why batching fell back to one sample per call
    output_batch_axes: dict[str, int] = {}  # batched: where each output holds its samples (-1: the same for all)
    deployment: str | None = None  # the artifact folder and file the candidate was loaded from (set by the build)


class AccuracyReport(BaseModel):
    reference: str
    candidate: str
    tolerance: Tolerance
    sample_count: int
    evaluation: Evaluation
    outputs: list[OutputAccuracy]
    worst_samples: list[SampleAccuracy]  # every failing sample and the worst few that passed, worst first
    task_metrics: list[TaskMetricResult]
    checks: list[Check]  # every check, passed or not
    failures: list[str]  # one line per failed check, empty when passed
    # compare(): the reference's outputs per sample, kept in memory (not serialized) for the folder's probe set
    _reference_outputs: list[dict[str, np.ndarray]] = PrivateAttr(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def worst_cosine(self) -> float:
        return min((o.cosine for o in self.outputs if o.agreement is None), default=1.0)


