"""How much a verdict on n held-out samples can say: every rate the gate judges (top-k agreement, boxes matched,
neighbours kept, samples within tolerance) is a count of successes among trials, and a build signs off only where
the one-sided lower confidence bound of that rate clears the recipe's minimum.

The bound is Clopper-Pearson's (the exact binomial interval, `statsmodels.proportion_confint(method="beta")`),
one-sided: the rate is at least `lower` with probability `confidence` whatever the true rate is. With no failure in n
trials it is (1 - confidence) ** (1 / n): 0 changed of 16 samples shows only >= 82.9% at 95%, so 16 samples can never
certify 95%; that needs 59, 97% needs 99. Too few trials for any result to clear the minimum is its own answer
("insufficient"), with the count that would be enough. A minimum of 1 (no failure allowed, the per-sample check's
default) is judged on the count itself: no finite sample can bound a rate to exactly 1, and one failure fails it; a
bounded verdict then also needs enough trials for none failing to show the rate at least `floor` (the recipe's
`strict_min_bound`, 95% by default: 59 trials), so that "none failed" never rests on a handful of samples.

Trials are independent samples, never rows. The rows of one sample (the tokens of a text, the boxes of an image, the
rows of one .npz batch, the elements of an integer output) share its input and fail together more often than apart,
so each sample counts once: its own rate (the share of its rows that agree) enters the bound over samples, as if
each sample were one trial whose success is that share (`RateEvidence.of_samples`: successes = the sum of the
per-sample rates, rounded down). A rate in [0, 1] is no more spread than a 0/1 outcome of the same mean (Hoeffding,
1963), so the bound is at least as wide as a bound on whole-sample successes; tests/accuracy/test_coverage.py checks
its coverage on rows that fail together. Rows pooled as if independent would claim, for 16 rows of 8 samples, what 16
samples show. Identical inputs are dealt once (data.split_roles): a copy is left unused, never a second trial."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, computed_field

METHOD = "Clopper-Pearson (exact binomial), one-sided"
DEFAULT_CONFIDENCE = 0.95

Status = Literal["pass", "fail", "insufficient"]


def _beta_quantile(q: float, a: float, b: float) -> float:
    from scipy.special import betaincinv  # the regularized incomplete beta's inverse: Beta(a, b)'s quantile

    return float(betaincinv(a, b, q))


def lower_bound(successes: int, trials: int, confidence: float = DEFAULT_CONFIDENCE) -> float:
    """The rate is at least this, at `confidence` (one-sided Clopper-Pearson); 0 without a success."""
    if trials <= 0 or successes <= 0:
        return 0.0
    return _beta_quantile(1 - confidence, successes, trials - successes + 1)


def upper_bound(successes: int, trials: int, confidence: float = DEFAULT_CONFIDENCE) -> float:
    """The rate is at most this, at `confidence`; 1 when every trial succeeded."""
    if trials <= 0 or successes >= trials:
        return 1.0
    return _beta_quantile(confidence, successes + 1, trials - successes)


def trials_needed(minimum: float, confidence: float = DEFAULT_CONFIDENCE) -> int | None:
    """The fewest trials whose bound clears `minimum` when none fails: (1 - confidence) ** (1 / n) >= minimum.
    None for a minimum of 1 (judged on the count, see the module docstring); 0 for a minimum of 0."""
    if minimum >= 1.0:
        return None
    if minimum <= 0.0:
        return 0
    return math.ceil(math.log(1 - confidence) / math.log(minimum) - 1e-9)


def failures_allowed(minimum: float, trials: int, confidence: float = DEFAULT_CONFIDENCE) -> int | None:
    """The most failures among `trials` whose bound still clears `minimum`; None when not even zero does."""
    if minimum >= 1.0:
        return 0
    if trials <= 0 or lower_bound(trials, trials, confidence) < minimum:
        return None
    low, high = 0, trials  # lower_bound falls as failures grow: the largest count that still clears
    while low < high:
        middle = (low + high + 1) // 2
        if lower_bound(trials - middle, trials, confidence) >= minimum:
            low = middle
        else:
            high = middle - 1
    return low


def aimed_minimum(minimum: float, verdict_trials: int, confidence: float = DEFAULT_CONFIDENCE) -> float | None:
    """The point rate a choice made on other samples (the rescue search, auto's shortlist) must show for the
    held-out verdict on `verdict_trials` to clear `minimum`: 1 - allowed failures / trials. None: nothing can."""
    allowed = failures_allowed(minimum, verdict_trials, confidence)
    if allowed is None:
        return None
    return 1.0 - allowed / verdict_trials if minimum < 1.0 else 1.0


@dataclass(frozen=True)
class Trials:
    """What one trial of a rate is: each held-out sample, or, where the user named groups of samples that share a
    source (crops of one photo, frames of one video), each group: `unit_of` gives each sample's trial index."""

    unit_of: tuple[int, ...]
    count: int
    unit: str = "samples"

    @classmethod
    def of(cls, names: Sequence[str], groups: Sequence[str] | None = None) -> Trials:
        if groups is None:
            return cls(tuple(range(len(names))), len(names))
        index = {group: i for i, group in enumerate(dict.fromkeys(groups))}
        return cls(tuple(index[g] for g in groups), len(index), "groups")

    def shares(self, values: np.ndarray, owner: np.ndarray) -> list[float]:
        """Each trial's share: the mean of `values` (1 agrees, 0 does not, or a sample's own rate) over its rows;
        `owner` is each row's sample index. Trials without rows are left out."""
        units = np.asarray(self.unit_of, dtype=np.int64)[np.asarray(owner, dtype=np.int64)]
        counts = np.bincount(units, minlength=self.count)
        kept = np.bincount(units, weights=np.asarray(values, dtype=np.float64), minlength=self.count)
        return [float(k / c) for k, c in zip(kept, counts) if c]


class RateEvidence(BaseModel):
    """One judged rate: `successes` of `trials` (`unit`) against the recipe's `minimum`. `bounded`: the verdict
    rests on the lower bound (reduced-precision sign-offs); otherwise on the observed rate, the bound only
    reported (fp32 against its noise floor, re-checks on a probe set, a search's steering samples)."""

    what: str  # "top-1 agreement", "samples within tolerance"
    successes: int
    trials: int
    unit: str = "samples"  # what a trial is: an independent sample
    failure: str = "failed"  # what a failed trial is called: changed (a prediction), unmatched (a box)
    minimum: float
    confidence: float = DEFAULT_CONFIDENCE
    bounded: bool = True
    floor: float | None = None  # a minimum of 1 on a bounded verdict: none may fail, and none failing must show this
    # Where samples hold several rows (boxes, tokens, batch rows, elements): how many, how many failed, what a row is.
    rows: int | None = None
    rows_failed: int | None = None
    row_unit: str = "rows"

    @classmethod
    def of_samples(cls, what: str, per_sample: Sequence[float], rows: int, rows_failed: int, row_unit: str = "rows",
                   **fields) -> RateEvidence:
        """A rate over samples that hold several rows each: each sample's share of rows that agree (`per_sample`),
        one trial per sample (see the module docstring). With one row per sample, the counts as they are."""
        trials = len(per_sample)
        successes = math.floor(sum(per_sample) + 1e-9)
        if rows == trials:
            return cls(what=what, successes=successes, trials=trials, **fields)
        return cls(what=what, successes=successes, trials=trials, rows=rows, rows_failed=rows_failed,
                   row_unit=row_unit, **fields)

    @computed_field
    @property
    def rate(self) -> float:
        return self.successes / self.trials if self.trials else 1.0

    @computed_field
    @property
    def failures(self) -> int:
        return self.trials - self.successes

    @computed_field
    @property
    def lower(self) -> float:
        return lower_bound(self.successes, self.trials, self.confidence)

    @computed_field
    @property
    def needed(self) -> int | None:
        """Trials a result without failure needs to clear the minimum (None: judged on the count alone)."""
        return trials_needed(self.shown_minimum, self.confidence)

    @property
    def shown_minimum(self) -> float:
        """What the bound must show: the minimum, or for "none may fail" on a bounded verdict, its floor."""
        return self.floor if self.minimum >= 1.0 and self.bounded and self.floor is not None else self.minimum

    def status_at(self, confidence: float) -> Status:
        """The verdict at another confidence (auto's family-wise level): the same counts, another bound."""
        return self.model_copy(update={"confidence": confidence}).status

    @computed_field
    @property
    def status(self) -> Status:
        if self.minimum >= 1.0:  # no failure allowed: judged on the count (no sample bounds a rate to exactly 1) ...
            if self.failures:
                return "fail"
            needed = self.needed  # ... and, bounded, on enough trials for none failing to show the floor
            return "insufficient" if needed and self.trials < needed else "pass"
        if self.rate < self.minimum:  # the data already show the rate below the minimum
            return "fail"
        if not self.bounded:
            return "pass"
        needed = self.needed or 0
        if self.trials < needed:
            return "insufficient"
        return "pass" if self.lower >= self.minimum else "fail"

    def line(self) -> str:
        """The verdict in words: '>= 95.3% at 95% confidence (1 changed of 120 held-out)' and what it is judged by."""
        held = " held-out" if self.bounded else ""
        counted = self.counted(held)
        bound = f">= {self.lower:.1%} at {self.confidence:.0%} confidence"
        status = self.status
        if status == "insufficient":
            return (f"{self.what}: {self.trials}{held} {_of(self.trials, self.unit)} cannot show >= "
                    f"{self.shown_minimum:.1%} at "
                    f"{self.confidence:.0%} confidence even with none {self.failure} ({self.lower:.1%} is the most "
                    "they "
                    f"can); {self.needed} needed")
        if self.minimum >= 1.0:
            shown = f" ({bound})" if self.shown_minimum < 1.0 and status == "pass" else ""
            return f"{self.what}: {counted}; none may fail{shown}" + ("" if status == "pass" else " (FAIL)")
        if not self.bounded:
            relation = ">=" if status == "pass" else "<"
            return f"{self.what} {self.rate:.2%} {relation} {self.minimum:.2%} ({counted}; {bound})"
        return f"{self.what} {bound} ({counted}) {'>=' if status == 'pass' else '<'} {self.minimum:.1%}"

    def counted(self, held: str = "") -> str:
        """The counts in words: '1 changed of 60 held-out samples (3 of their 120 rows)'."""
        text = f"{self.failures} {self.failure} of {self.trials}{held} {_of(self.trials, self.unit)}"
        return text + (f" ({self.rows_failed} of their {self.rows} {self.row_unit})" if self.rows is not None else "")

    def shortfall_hint(self) -> str | None:
        """For a bounded rate that fails only by its bound: how many trials at the observed rate would clear it."""
        if not self.bounded or self.status != "fail" or self.rate < self.minimum or self.minimum >= 1.0:
            return None
        for trials in (2 * self.trials, 4 * self.trials, 8 * self.trials, 16 * self.trials):
            if lower_bound(round(self.rate * trials), trials, self.confidence) >= self.minimum:
                return f"at the observed {self.rate:.2%}, about {trials} {self.unit} would clear it"
        return None


def _of(count: int, unit: str) -> str:
    """`unit` for `count` of them: '1 sample', '2 samples'."""
    return unit[:-1] if count == 1 and unit.endswith("s") else unit
