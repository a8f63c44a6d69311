"""`--precision auto`'s report, as data: each candidate's record (its steering and held-out verdicts, its runoff
timings, where its build's minutes went), the progress record and the selection (builder/choice.py chooses,
builder/auto.py builds the candidates)."""

from __future__ import annotations

from pydantic import BaseModel

from accel_opt.accuracy.evidence import DEFAULT_CONFIDENCE, METHOD, RateEvidence
from accel_opt.accuracy.labeled import LabeledAccuracy
from accel_opt.recipe.types import Precision
from accel_opt.report.verdict import Benefit


class RunoffPoint(BaseModel):
    batch_size: int
    p50_ms: float
    p99_ms: float
    throughput_per_s: float


class Candidate(BaseModel):
    backend: str
    precision: str
    why_tried: str
    signed_off: bool = False  # its own build's verdict on the held-out samples, at the recipe's confidence
    held_out: str | None = None  # that verdict: pass, fail or insufficient (None: not built)
    # Each rate of that verdict with its counts (top-k agreement, samples within tolerance, ...): auto reads them
    # again at its family-wise level. checks_passed: every other check of the build passed (numeric, benchmark).
    rates: list[RateEvidence] = []
    labeled: list[LabeledAccuracy] = []  # its gated label checks (--labels), read again at the family-wise level too
    checks_passed: bool = True
    benefit: Benefit | None = None  # its own verdict's benefit over its fp32 build (reduced precisions)
    steering_passed: bool | None = None  # on the steering samples, aimed at what the held-out ones certify (None: none)
    steering_loss: float | None = None
    family_confidence: float | None = None  # the level auto read its held-out verdict at
    samples: dict[str, int] = {}  # calibration / steering / verdict samples of its build
    seconds: float = 0.0  # wall time of its build
    stage_seconds: dict[str, float] = {}  # where they went
    search_budget_s: float | None = None  # its share of the time budget for the rescue search (reduced precisions)
    batch_size: int | None = None  # the target batch, or the build's largest when it could not run that
    latency_p50_ms: float | None = None  # at batch_size: from the runoff when there was one, else the build's
    build_latency_p50_ms: float | None = None  # at batch_size, measured during the candidate's own build
    throughput_per_s: float | None = None
    cosine: float | None = None  # worst output cosine vs the fp32 reference
    artifact_dir: str | None = None
    points: list[RunoffPoint] = []  # the runoff, one point per batch size the objective looks at
    objective_value: float | None = None  # ms (latency) or samples/s (throughput objectives); None: budget not met
    objective_batch: int | None = None
    verdict: str = ""  # why it won or lost
    # Too few held-out samples to certify it (dropped before building, or built and judged insufficient): how many
    # held-out samples would do with none failing, and the --data samples the recipe's split deals them from.
    samples_needed: int | None = None
    data_samples_needed: int | None = None

    @property
    def label(self) -> str:
        return f"{self.backend} {self.precision}"

    @property
    def reduced(self) -> bool:
        return self.precision != Precision.fp32.value

    def held_out_at(self, confidence: float) -> str:
        """Its held-out verdict with every bounded rate judged at `confidence`: pass, fail or insufficient."""
        if not self.rates and not self.labeled:
            return "pass" if self.signed_off else (self.held_out or "fail")
        if not self.checks_passed:
            return "fail"
        statuses = [rate.status_at(confidence) for rate in [*self.rates, *self.labeled]]
        if all(s == "pass" for s in statuses):
            return "pass"
        return "fail" if "fail" in statuses else "insufficient"


class ProgressEvent(BaseModel):
    """One line of progress: a stage of a candidate's build, or a step of its search, with the time left."""

    elapsed_s: float
    remaining_s: float | None  # None: no time budget
    candidate: str  # "openvino int8 (3/4)"
    step: str  # a stage name, or "search"
    detail: str

    def line(self) -> str:
        left = f", {self.remaining_s / 60:.1f} min left" if self.remaining_s is not None else ""
        return f"[{self.candidate} | {self.elapsed_s / 60:.1f} min{left}] {self.step}: {self.detail}"


class AutoSelection(BaseModel):
    objective: str = "throughput"
    target_batch_size: int
    latency_budget_ms: float | None
    backend_reason: str
    timing: str = ""  # where the compared latencies come from
    confidence: float = DEFAULT_CONFIDENCE  # the winner's verdict holds at this level, family-wise
    method: str = METHOD
    time_budget_s: float | None = None
    seconds: float = 0.0  # the whole run's wall time
    untried: list[str] = []  # what the time budget left untried
    winner: Candidate | None
    candidates: list[Candidate]
    progress: list[ProgressEvent] = []

    def no_winner_reason(self) -> str | None:
        """Why nothing was chosen, in a few words (None: there is a winner)."""
        if self.winner is not None:
            return None
        if any(c.signed_off for c in self.candidates):
            return "the signed-off candidates lose on the objective"
        if self.too_few_for_all:
            return self.too_few_line()
        return "no candidate passed the gate"

    @property
    def too_few_for_all(self) -> bool:
        """Every candidate tried was too few held-out samples away from a verdict (exit 6 when none won)."""
        tried = [c for c in self.candidates if not c.verdict.startswith("not tried")]
        return bool(tried) and all(c.samples_needed for c in tried)

    def too_few_line(self) -> str | None:
        """Which reduced candidates the held-out samples were too few to certify, and how many would do."""
        short = [c for c in self.candidates if c.samples_needed and not c.signed_off]
        if not short:
            return None
        needed = max(c.samples_needed for c in short)
        data = max((c.data_samples_needed for c in short if c.data_samples_needed), default=None)
        give = f"--data with at least {data} distinct samples or " if data else ""
        return (f"too few held-out samples to certify {', '.join(c.label for c in short)}: {needed} needed with none "
                f"failing; give {give}{needed} held-out ones with --eval-data")
