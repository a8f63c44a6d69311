"""The gate's bound holds what it states on samples whose rows fail together: each sample counts once, its own rate
entering the bound over samples (evidence.RateEvidence.of_samples). Simulated, seeded: a few thousand verdicts with a
known true rate, the one-sided coverage at least the stated confidence; and pooling the rows as if independent, the
reading this replaces, falls short of it."""

from __future__ import annotations

import numpy as np
import pytest

from accel_opt.accuracy.evidence import RateEvidence, lower_bound

DRAWS = 2000


def _per_sample_rates(rng: np.random.Generator, samples: int, rows: int, hard_share: float, hard_rate: float):
    """Each sample is hard with probability `hard_share`; a hard sample's rows agree with probability `hard_rate`, an
    easy one's always: rows of one sample fail together. Returns the samples' rates and the true mean rate."""
    hard = rng.random(samples) < hard_share
    agreed = rng.binomial(rows, np.where(hard, hard_rate, 1.0))
    return agreed / rows, 1 - hard_share * (1 - hard_rate)


@pytest.mark.parametrize("samples, rows, hard_share, hard_rate", [
    (60, 8, 0.03, 0.2),    # a few hard inputs whose rows nearly all flip: a detector's crowded image, a long text
    (120, 16, 0.05, 0.5),
    (40, 4, 0.10, 0.0),    # whole samples fail: the per-sample rate is 0 or 1, the bound is Clopper-Pearson's own
    (200, 32, 0.01, 0.6),
])
def test_the_bound_over_samples_covers_the_true_rate(samples, rows, hard_share, hard_rate):
    rng = np.random.default_rng(0)
    covered = pooled_covered = 0
    for _ in range(DRAWS):
        rates, truth = _per_sample_rates(rng, samples, rows, hard_share, hard_rate)
        evidence = RateEvidence.of_samples("agreement", list(rates), rows=samples * rows,
                                           rows_failed=int(round(samples * rows - rates.sum() * rows)), minimum=0.9)
        covered += evidence.lower <= truth
        pooled_covered += lower_bound(int(round(rates.sum() * rows)), samples * rows) <= truth
    assert covered / DRAWS >= 0.95, f"coverage {covered / DRAWS:.3f} of the bound over samples"
    if rows > 4 and hard_rate < 0.5:  # strongly clustered: rows counted as trials claim more than the data show
        assert pooled_covered / DRAWS < 0.95, f"pooled rows covered {pooled_covered / DRAWS:.3f}"


def test_a_sample_of_many_rows_counts_once():
    """16 rows of 8 samples, the rows of one sample all changed: 1 changed of 8 samples, not 2 of 16 rows."""
    rates = [1.0] * 7 + [0.0]
    evidence = RateEvidence.of_samples("top-1 agreement", rates, rows=16, rows_failed=2, failure="changed",
                                       minimum=0.5)
    assert (evidence.successes, evidence.trials, evidence.failures) == (7, 8, 1)
    assert "1 changed of 8 held-out samples (2 of their 16 rows)" in evidence.line()
    half = RateEvidence.of_samples("top-1 agreement", [1.0] * 7 + [0.5], rows=16, rows_failed=1, minimum=0.5)
    assert half.successes == 7  # a half-agreeing sample is no success: rounded down, never up
