"""Accuracy on the user's labels, and a one-sided bound on how far a candidate's accuracy drops below fp32's.

MLPerf, Intel Neural Compressor, NNCF and Olive gate reduced precision on task accuracy over labeled data, each by a
point estimate. Here the drop is bounded: the same held-out samples are scored under both models, and the bound is
computed on the paired outcomes. Of n samples, `lost` are right under fp32 and wrong under the candidate, `gained` the
reverse; the rest agree and say nothing about the drop. The true drop is delta = p_lost - p_gained = pi * (2 theta - 1),
with pi the chance that a sample is discordant and theta the chance that a discordant sample is a loss.

Method (exact conditional, Bonferroni-combined): given the d = lost + gained discordant samples, `lost` is binomial in
theta, and d is binomial in pi over n; both get a Clopper-Pearson bound, theta's one-sided at alpha/2 and pi's
two-sided at alpha/4 per side, so both hold together with probability at least 1 - alpha whatever the true rates (the
union bound needs no independence). Then delta <= pi_high * (2 theta_high - 1) where that factor is positive (pi_low
where it is negative). Why this one: its coverage is at least the stated confidence at every sample size and every
true rate, which is what a sign-off promises; the usual large-sample intervals (Wald, McNemar-based; Newcombe's hybrid
score, tighter) dip below nominal coverage for some rates at small n. The price is width: certifying a 1-point drop
at 95% takes 437 held-out samples with no discordant one (a one-sided Clopper-Pearson bound on one rate, 299).
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, computed_field

from accel_opt.accuracy.evidence import DEFAULT_CONFIDENCE, Status, lower_bound, upper_bound

PAIRED_METHOD = "exact conditional on the discordant pairs (Clopper-Pearson, Bonferroni-combined), one-sided"


def drop_upper_bound(lost: int, gained: int, samples: int, confidence: float = DEFAULT_CONFIDENCE) -> float:
    """At `confidence`, the true accuracy drop (fp32's accuracy minus the candidate's) is at most this, from `samples`
    paired outcomes of which `lost` went from right to wrong and `gained` from wrong to right. Between -1 and 1."""
    if samples <= 0:
        return 1.0
    alpha = 1 - confidence
    discordant = lost + gained
    direction = 2 * upper_bound(lost, discordant, 1 - alpha / 2) - 1  # 2 theta_high - 1 (1 without a discordant pair)
    if direction >= 0:
        return upper_bound(discordant, samples, 1 - alpha / 4) * direction
    return lower_bound(discordant, samples, 1 - alpha / 4) * direction


def samples_to_certify_drop(max_drop: float, confidence: float = DEFAULT_CONFIDENCE) -> int | None:
    """The fewest held-out samples whose bound can clear `max_drop` (when no sample is discordant):
    1 - (alpha/4) ** (1/n) <= max_drop. None for a limit of 0 (no number of samples bounds a drop at exactly 0)."""
    if max_drop >= 1.0:
        return 0
    if max_drop <= 0.0:
        return None
    return math.ceil(math.log((1 - confidence) / 4) / math.log(1 - max_drop) - 1e-9)


class LabeledAccuracy(BaseModel):
    """Top-k accuracy on the labels of the held-out samples, under fp32 and the candidate, and the gate on its drop."""

    output: str
    k: int
    samples: int
    reference_correct: int
    candidate_correct: int
    lost: int  # right under fp32, wrong under the candidate
    gained: int  # wrong under fp32, right under the candidate
    drop_bound: float  # the true drop is at most this, at `confidence`
    confidence: float
    method: str = PAIRED_METHOD
    limit: float | None = None  # the largest drop allowed (absolute); None: reported, not gated
    limit_basis: str = ""  # "absolute" or "relative: 99% of fp32's accuracy"
    samples_needed: int | None = None  # held-out samples the limit needs at best (no discordant pair)
    bounded: bool = True  # judged by the bound (reduced-precision sign-offs); else by the observed drop
    status: Status = "pass"

    @computed_field
    @property
    def reference_accuracy(self) -> float:
        return self.reference_correct / self.samples if self.samples else 0.0

    @computed_field
    @property
    def candidate_accuracy(self) -> float:
        return self.candidate_correct / self.samples if self.samples else 0.0

    @computed_field
    @property
    def drop(self) -> float:
        return self.reference_accuracy - self.candidate_accuracy

    def status_at(self, confidence: float) -> Status:
        """The verdict if the bound were taken at `confidence` (auto's family-wise level)."""
        if self.limit is None:
            return "pass"
        if not self.bounded:
            return "pass" if self.drop <= self.limit else "fail"
        if drop_upper_bound(self.lost, self.gained, self.samples, confidence) <= self.limit:
            return "pass"
        needed = samples_to_certify_drop(self.limit, confidence)
        return "insufficient" if needed is None or self.samples < needed else "fail"

    def line(self) -> str:
        """One line for a person: both accuracies, the drop, its bound and the verdict."""
        head = (f"top-{self.k} accuracy on the labels: fp32 {self.reference_accuracy:.1%}, candidate "
                f"{self.candidate_accuracy:.1%} ({self.samples} held-out, {self.lost} lost, {self.gained} gained): "
                "drop "
                f"{self.drop:+.2%}, at most {self.drop_bound:+.2%} at {self.confidence:.0%} confidence")
        if self.limit is None:
            return head
        verdict = {"pass": "within", "fail": "beyond", "insufficient": "cannot be certified within"}[self.status]
        verdict = verdict if self.bounded else f"observed drop {'within' if self.status == 'pass' else 'beyond'}"
        more = f" ({self.samples_needed} held-out samples needed)" if self.status == "insufficient" else ""
        return f"{head}; {verdict} the limit {self.limit:.2%} ({self.limit_basis}){more}"


def correct_top_k(outputs: list[dict[str, np.ndarray]], output: str, labels: list[int], k: int) -> np.ndarray:
    """Per sample, whether its label is among the `k` highest scores of `output` (one row of class scores each)."""
    rows = [np.asarray(out[output], dtype=np.float64).reshape(-1) for out in outputs]
    return np.array([label in np.argsort(-row, kind="stable")[:k] for row, label in zip(rows, labels)], dtype=bool)


def labeled_accuracy(ref_outs: list[dict[str, np.ndarray]], cand_outs: list[dict[str, np.ndarray]], labels: list[int],
                     output: str, k: int = 1, confidence: float = DEFAULT_CONFIDENCE, max_drop: float | None = None,
                     min_relative: float | None = None, bounded: bool = True) -> LabeledAccuracy:
    """Score both models' outputs against `labels` (paired, sample by sample) and gate the drop: at most `max_drop`
    (absolute, NNCF/Olive style), or at least `min_relative` of fp32's accuracy (MLPerf's 0.99; the limit is then
    (1 - min_relative) times fp32's observed accuracy). Not `bounded`: the observed drop is judged against the limit
    (fp32 builds and steering samples, like every other rate), the bound reported beside it."""
    ref_ok, cand_ok = correct_top_k(ref_outs, output, labels, k), correct_top_k(cand_outs, output, labels, k)
    n, lost, gained = len(labels), int((ref_ok & ~cand_ok).sum()), int((~ref_ok & cand_ok).sum())
    result = LabeledAccuracy(output=output, k=k, samples=n, reference_correct=int(ref_ok.sum()),
                             candidate_correct=int(cand_ok.sum()), lost=lost, gained=gained,
                             drop_bound=drop_upper_bound(lost, gained, n, confidence), confidence=confidence,
                             bounded=bounded)
    if max_drop is None and min_relative is None:
        return result
    if max_drop is not None:
        result.limit, result.limit_basis = max_drop, "absolute"
    else:
        result.limit = (1 - min_relative) * result.reference_accuracy
        result.limit_basis = f"relative: {min_relative:.1%} of fp32's accuracy"
    result.samples_needed = samples_to_certify_drop(result.limit, confidence)
    result.status = result.status_at(confidence)
    return result


def labeled_markdown(checks: list) -> list[str]:
    """signoff.md's section on the labels: each k's line, and how the bound is taken ([] without labels)."""
    labeled = [c.labeled for c in checks if getattr(c, "labeled", None) is not None]
    if not labeled:
        return []
    out = ["", "## Accuracy on the labels", "", *[f"- {r.line()}" for r in labeled], "",
           f"The drop's bound: {PAIRED_METHOD}, on the same held-out samples scored under both models."]
    if any(not c.gated for c in checks):
        beyond = [f"- {c.name}: {c.line}" for c in checks if not c.gated and not c.passed]
        out += ["", "The recipe gates on the labels alone (accuracy.labels.gate: labels): agreement with fp32 is "
                f"reported, not gated; {len(beyond) or 'no'} agreement check(s) beyond its tolerance", *beyond]
    return out
