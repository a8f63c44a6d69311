"""The gate's verdict as data: per sample, per output, per task metric, and the whole report."""

from __future__ import annotations

import logging
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field, PrivateAttr, computed_field

from accel_opt.accuracy.evidence import DEFAULT_CONFIDENCE, METHOD, RateEvidence
from accel_opt.accuracy.labeled import LabeledAccuracy
from accel_opt.recipe.gate import Tolerance

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
    # The rates among `values` with their counts (top-k agreement, neighbours kept, boxes matched): judged by their
    # bound where the gate is bounded. Values without evidence (a mean cosine) are judged as they are.
    evidence: dict[str, RateEvidence] = {}
    passed: bool
    note: str | None = None  # e.g. how many boxes the rates count
    worst_samples: list[str] = []  # samples whose prediction changed (top-k) or that lost most (detection)
    # Every sample whose outcome changed, for metrics whose outcome per sample is one (top-k, neighbours; None: not
    # one of those): what a paired comparison of two builds counts. In memory only: reports list `worst_samples`.
    changed: list[str] | None = Field(default=None, exclude=True)


class Check(BaseModel):
    """One check of the gate (an output's numeric check, a task metric threshold): what CI lists."""

    name: str  # e.g. "logits: per-sample", "task topk: top1"
    passed: bool
    line: str  # the one-line result, the failure reason when it failed
    # A rate judged by its confidence bound: its counts, minimum and bound (None: a point check, e.g. a cosine).
    evidence: RateEvidence | None = None
    labeled: LabeledAccuracy | None = None  # accuracy on the labels, its drop bounded on the paired outcomes
    gated: bool = True  # False: reported, not gated (agreement under accuracy.labels.gate: labels)

    @property
    def insufficient(self) -> bool:
        """Not passed because the samples are too few for any result to clear the minimum."""
        if self.labeled is not None:
            return self.labeled.status == "insufficient"
        return self.evidence is not None and self.evidence.status == "insufficient"

    @property
    def needed(self) -> int | None:
        """Held-out samples that would certify it (with none failing), where that is its problem."""
        return (self.labeled.samples_needed if self.labeled is not None else
                self.evidence.needed if self.evidence is not None else None)

    def status_at(self, confidence: float) -> str:
        if self.labeled is not None:
            return self.labeled.status_at(confidence)
        return self.evidence.status_at(confidence) if self.evidence is not None else ("pass" if self.passed else "fail")


class Evaluation(BaseModel):
    """How the candidate was run: what the verdict rests on besides the data."""

    mode: Literal["batched", "per-sample"]
    batch_size: int  # rows per candidate call
    calls: int
    note: str | None = None  # why batching fell back to one sample per call
    output_batch_axes: dict[str, int] = {}  # batched: where each output holds its samples (-1: the same for all)
    deployment: str | None = None  # the artifact folder and file the candidate was loaded from (set by the build)


class SteeringVerdict(BaseModel):
    """The deployed build on the steering samples (never the held-out ones): what auto's shortlist reads. Judged on
    observed rates aimed at what the held-out verdict can certify (evidence.aimed_minimum)."""

    sample_count: int
    passed: bool
    loss: float  # how far from passing, in units of each check's limit (<= 1 passes; AccuracyReport.loss)
    worst_cosine: float
    failures: list[str] = []


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
    # How the rates were judged: by their one-sided lower bound at `confidence` (`bounded`: reduced precisions'
    # sign-offs), or by the observed rate with the bound reported (fp32, re-checks, steering).
    confidence: float = DEFAULT_CONFIDENCE
    method: str = METHOD
    bounded: bool = False
    # What a rate's trial is: each held-out sample, or each group of samples that share a source; how many there were.
    trial_unit: str = "samples"
    trial_count: int | None = None
    # How many samples had each role (calibration, steering, verdict): set by the build; the verdict is `sample_count`.
    roles: dict[str, int] = {}
    steering: SteeringVerdict | None = None  # set by the build
    # compare(): the reference's outputs per sample, kept in memory (not serialized) for the folder's probe set
    _reference_outputs: list[dict[str, np.ndarray]] = PrivateAttr(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    @computed_field
    @property
    def verdict(self) -> str:
        """"pass", "fail", or "insufficient": every failing check is a rate its samples are too few to certify."""
        failing = [c for c in self.checks if c.gated and not c.passed]
        if not failing:
            return "pass"
        return "insufficient" if all(c.insufficient for c in failing) else "fail"

    @computed_field
    @property
    def samples_needed(self) -> int | None:
        """Held-out samples that, with none failing, would certify every rate this verdict found too few for."""
        needed = [c.needed for c in self.checks if c.gated and c.insufficient and c.needed]
        return max(needed, default=None)

    def verdict_at(self, confidence: float) -> str:
        """The verdict if every bounded rate were judged at `confidence` (auto's family-wise level); point checks
        are as judged."""
        statuses = [c.status_at(confidence) for c in self.checks if c.gated]
        if all(s == "pass" for s in statuses):
            return "pass"
        return "insufficient" if all(s in ("pass", "insufficient") for s in statuses) else "fail"

    @property
    def loss(self) -> float:
        """How far the verdict is from passing, in units of each check's limit (1.0: at the limit; <= 1 passes): what
        the rescue search lowers and auto's shortlist reads. Gated on the labels alone: the observed drop against
        its limit."""
        if any(not c.gated for c in self.checks):
            labeled = [c.labeled for c in self.checks if c.gated and c.labeled is not None
                       and c.labeled.limit is not None]
            return max((_over(max(r.drop, 0.0), r.limit) for r in labeled), default=0.0)
        ratios = [self.output_loss]
        for metric in self.task_metrics:
            for key, limit in metric.thresholds.items():
                value = metric.values.get(key)
                if value is None:
                    continue
                # every task threshold is a minimum (agreement, precision, recall, cosine) on a 0..1 scale
                ratios.append((1 - value) / max(1 - limit, 1e-12))
        return max(ratios)

    @property
    def output_loss(self) -> float:
        """The part of `loss` the outputs' numeric checks set: continuous where the task metrics count samples, so
        it can still rank two builds whose changed predictions are too few to tell them apart (search.better)."""
        tol = self.tolerance
        ratios = [0.0]
        for o in self.outputs:
            if o.non_finite_count:
                return float("inf")
            if o.agreement is not None:  # exact outputs: the share of elements that differ against the allowed share
                ratios.append((1 - o.agreement) / max(1 - tol.min_agreement, 1e-12))
                continue
            ratios += [_over(o.error, tol.max_error), _over(o.worst_sample_error, tol.max_sample_error),
                       (1 - o.cosine) / max(1 - tol.min_cosine, 1e-12), _over(abs(o.gain - 1), tol.max_gain_error)]
            if o.worst_sample_cosine is not None:
                ratios.append((1 - o.worst_sample_cosine) / max(1 - tol.min_sample_cosine, 1e-12))
        return max(ratios)

    @property
    def changed_samples(self) -> list[str] | None:
        """The samples whose outcome changed under any task metric that counts them (None: no such metric, or the
        verdict is gated on labels, where a changed prediction is not itself a failure)."""
        if any(not c.gated for c in self.checks):
            return None
        counted = [m.changed for m in self.task_metrics if m.changed is not None]
        return sorted(set().union(*counted)) if counted else None

    @property
    def worst_cosine(self) -> float:
        return min((o.cosine for o in self.outputs if o.agreement is None), default=1.0)


def _over(value: float, limit: float) -> float:
    """`value` in units of `limit`; a limit of 0 (allowed: "no error at all") is met only by 0."""
    if limit > 0:
        return value / limit
    return 0.0 if value <= 0 else float("inf")
