"""The one verdict of a build: made once, from the accuracy gate, the benchmark's budgets and the measured benefit,
recorded in manifest.json and read (never recomputed) by every report, `--json`, JUnit, auto, `runtime.load` and
the commands that open a folder.

A reduced-precision build counts only when it is correct on held-out samples *and* measured to be faster than its
fp32 build on the same backend at the deployed batch: the lower bound of that speed-up, from the benchmark's
interleaved rounds, at the recipe's confidence, must reach `benchmark.min_speedup`.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, computed_field

Outcome = Literal["signed off", "gate failed", "too few samples", "no measured benefit"]
# The process exit code of each outcome (README, "Exit codes"). 6 and 7 are the verdict's own codes: neither is a
# failed check, and a pipeline may want to tell them apart from one (more data; a faster target or fp32).
EXIT_CODES: dict[str, int] = {"signed off": 0, "gate failed": 1, "too few samples": 6, "no measured benefit": 7}


class Benefit(BaseModel):
    """A reduced build's speed against its fp32 build, timed in interleaved rounds in one run (bench.run_benchmark)."""

    baseline: str  # the benchmark label of the fp32 build: "<backend>-fp32"
    batch: int  # the deployed batch the ratio is taken at
    speedup: float  # fp32 p50 / candidate p50 over every timed call of the run
    lower_bound: float | None  # one-sided, at `confidence` (None: too few rounds for a bound at that level)
    min_speedup: float  # the recipe's minimum (benchmark.min_speedup); 0: the rule is off
    confidence: float
    rounds: list[float]  # each interleaved round's speed-up (fp32 round p50 / candidate round p50)

    @computed_field
    @property
    def passed(self) -> bool:
        if self.min_speedup <= 0:
            return True
        return self.lower_bound is not None and self.lower_bound >= self.min_speedup

    def line(self) -> str:
        bound = (f"lower bound {self.lower_bound:.2f}x at {self.confidence:.0%}" if self.lower_bound is not None
                 else f"no bound at {self.confidence:.0%} from {len(self.rounds)} rounds")
        rule = f"minimum {self.min_speedup:.2f}x" if self.min_speedup > 0 else "no minimum (benchmark.min_speedup: 0)"
        return (f"{self.speedup:.2f}x {self.baseline} at batch {self.batch} ({bound}, {len(self.rounds)} interleaved "
                f"rounds; {rule})")


def rounds_needed(confidence: float) -> int:
    """Interleaved rounds for a distribution-free lower bound at `confidence`: the smallest of n rounds lies below
    their median with probability 1 - 2^-n (5 rounds: 96.9%, enough for 95%)."""
    return max(1, math.ceil(math.log2(1 / (1 - confidence))))


def speedup_lower_bound(round_speedups: list[float], confidence: float) -> float | None:
    """A one-sided lower confidence bound on the median round's speed-up: the k-th smallest round, k the largest with
    P(Binomial(n, 1/2) >= k) >= confidence (the sign test's interval for a median, no assumption on the noise's
    shape: a noisy neighbour hurts single rounds, and interleaving hurts both builds of a round alike). None when n
    rounds are too few for that level."""
    from scipy.stats import binom

    n = len(round_speedups)
    ordered = sorted(round_speedups)
    k = 0
    while k < n and binom.sf(k, n, 0.5) >= confidence:  # sf(k) = P(X >= k + 1)
        k += 1
    return ordered[k - 1] if k else None


def benefit_of(bench, batch: int, min_speedup: float, confidence: float) -> Benefit | None:
    """The Benefit of a reduced build from its BenchmarkReport `bench` (candidate first, its fp32 build among the
    baselines as "<backend>-fp32"), at the deployed `batch` (or the largest batch timed when that one was not);
    None when no fp32 build was timed beside it (an fp32 build is the baseline itself)."""
    candidate = bench.models[0]
    baseline = next((m for m in bench.models[1:] if m.label.endswith("-fp32")), None)
    if baseline is None or not candidate.batches:
        return None
    at = candidate.at(batch) or candidate.batches[-1]
    base = baseline.at(at.batch_size)
    rounds = [b / c for b, c in zip(base.round_p50_ms, at.round_p50_ms) if c > 0]
    return Benefit(baseline=baseline.label, batch=at.batch_size, speedup=base.latency.p50_ms / at.latency.p50_ms,
                   lower_bound=speedup_lower_bound(rounds, confidence), min_speedup=min_speedup,
                   confidence=confidence, rounds=rounds)


class Verdict(BaseModel):
    """What a build concluded about its folder: the outcome, its exit code, the reasons and what it rests on."""

    outcome: Outcome
    reasons: list[str] = []  # one line per failed check (empty when signed off)
    bounds: list[str] = []  # each bounded rate, with its lower bound: what a sign-off rests on
    confidence: float = 0.95  # the level the rates and the benefit were read at
    benefit: Benefit | None = None  # None: an fp32 build (the baseline itself), or not timed beside its fp32 build
    samples_needed: int | None = None  # too few samples: held-out ones that would be enough with none failing

    @computed_field
    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.outcome]

    @computed_field
    @property
    def signed_off(self) -> bool:
        return self.outcome == "signed off"

    def headline(self, trial_unit: str = "samples") -> str:
        """The sign-off's headline (signoff.md and .html): SIGNED OFF with its benefit, or NOT SIGNED OFF and why."""
        if self.signed_off:
            return "SIGNED OFF" + (f" ({self.benefit.line()})" if self.benefit else "")
        if self.outcome == "too few samples":
            return f"NOT SIGNED OFF: not enough held-out {trial_unit} ({self.samples_needed} needed)"
        if self.outcome == "no measured benefit":
            return f"NOT SIGNED OFF: no measured benefit: {self.benefit.line() if self.benefit else 'not timed'}"
        return "NOT SIGNED OFF"

    def line(self) -> str:
        """The verdict in one line, as every command says it."""
        if self.signed_off:
            return "signed off" + (f"; {self.benefit.line()}" if self.benefit is not None else "")
        if self.outcome == "no measured benefit":
            return f"NOT signed off: no measured benefit: {self.benefit.line() if self.benefit else 'not timed'}"
        detail = "; ".join(self.reasons[:2]) + (f" (+{len(self.reasons) - 2} more)" if len(self.reasons) > 2 else "")
        what = "too few held-out samples to certify it" if self.outcome == "too few samples" else "its gate failed"
        return f"NOT signed off: {what}" + (f" ({detail})" if detail else "")


def decide(accuracy, bench_failures: list[str], benefit: Benefit | None) -> Verdict:
    """THE verdict (the only place one is made): from the accuracy report (AccuracyReport), the benchmark's budget
    failures and the benefit. A failed check decides first; too few samples is its own outcome when nothing else
    failed; a correct build that does not pay is "no measured benefit"."""
    reasons = list(accuracy.failures) + list(bench_failures)
    bounds = [c.evidence.line() for c in accuracy.checks if c.gated and c.evidence is not None]
    if reasons:
        too_few = accuracy.verdict == "insufficient" and not bench_failures
        outcome: Outcome = "too few samples" if too_few else "gate failed"
    elif benefit is not None and not benefit.passed:
        outcome, reasons = "no measured benefit", [f"no measured benefit: {benefit.line()}"]
    else:
        outcome = "signed off"
    return Verdict(outcome=outcome, reasons=reasons, bounds=bounds, confidence=accuracy.confidence, benefit=benefit,
                   samples_needed=accuracy.samples_needed if outcome == "too few samples" else None)


def legacy_verdict(signed_off: bool, exit_code: int, reason: str = "") -> Verdict:
    """A folder from before verdicts were recorded: its manifest's signed_off and exit code, read as one."""
    if signed_off:
        return Verdict(outcome="signed off")
    return Verdict(outcome="too few samples" if exit_code == 6 else "gate failed", reasons=[reason] if reason else [])
