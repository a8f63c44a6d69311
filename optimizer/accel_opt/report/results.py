"""What a build returns: its verdict, headline numbers, stages and what the verdict rests on (data first)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, computed_field

from accel_opt.bench import BenchmarkReport
from accel_opt.report.verdict import Verdict

StageStatus = Literal["passed", "failed", "skipped"]


class StageResult(BaseModel):
    name: str
    status: StageStatus
    seconds: float = 0.0
    detail: str = ""


class Headline(BaseModel):
    batch_size: int
    latency_p50_ms: float
    throughput_per_s: float
    speedup_vs_fp32: float | None = None  # same backend, measured in the same run
    speedup_vs_pytorch: float | None = None  # PyTorch eager fp32, for torch inputs


class DataRecord(BaseModel):
    """What the verdict rests on: where the samples came from and how many were used for what."""

    source: str  # "npz", "images" or "synthetic"
    path: str | None
    synthetic: bool  # random inputs: the numeric gate holds, task quality was not measured
    samples: int  # read or generated
    evaluation_samples: int  # held out: they judged the verdict and nothing else
    calibration_samples: int
    steering_samples: int = 0  # steered the build's choices (fallback search, cleanup check, auto's shortlist)
    eval_path: str | None = None  # --eval-data, when the held-out samples came from there
    held_out_max: int | None = None  # held-out samples judged at most (accuracy.max_samples, or less for memory)


class BuildResult(BaseModel):
    model: str
    precision: str
    backend: str
    verdict: Verdict  # the build's one verdict (report.verdict.decide), as its manifest records it
    samples_needed: int | None = None  # too few samples: held-out samples that would be enough with no failure
    data_samples_needed: int | None = None  # ... and the --data samples this recipe's split deals them from
    trial_unit: str = "samples"  # what those counts count: samples, or groups of samples that share a source
    artifact_dir: str | None = None
    latency_p50_ms: float | None = None  # at the smallest benchmarked batch
    throughput_per_s: float | None = None  # at the largest benchmarked batch
    headline: list[Headline] = []
    worst_cosine: float | None = None  # over outputs, against the fp32 reference
    error: str | None = None
    data: DataRecord | None = None
    evaluated: str | None = None  # what the gate ran: the artifact's files, backend, precision, batch
    reused: bool = False  # an identical build was found complete and verified under --out: nothing was rebuilt
    stages: list[StageResult] = []
    # What the build timed (ctx.samples.timed_deployed), for auto's run-off of its winners: in memory only, never
    # written (excluded from every dump).
    timed_samples: list[dict[str, Any]] = Field(default_factory=list, exclude=True, repr=False)

    @computed_field
    @property
    def signed_off(self) -> bool:
        return self.verdict.signed_off

    @computed_field
    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code

    @computed_field
    @property
    def failures(self) -> list[str]:  # the verdict's reasons: each failed check, or the missing benefit
        return self.verdict.reasons

    def synthetic_line(self) -> str | None:
        """Without --data: what the verdict covers, in words a reviewer reads; None on real data."""
        if self.data is None or not self.data.synthetic:
            return None
        return (f"numeric check only, on {self.data.evaluation_samples} synthetic (random) inputs: no task rate was "
                "certified; give --data for a sign-off on real inputs")

    def too_few_line(self) -> str | None:
        """Insufficient evidence: what would be enough, in words a user acts on; None otherwise."""
        if self.verdict.outcome != "too few samples" or self.samples_needed is None:
            return None
        needed, unit = self.samples_needed, self.trial_unit
        line = f"not enough held-out {unit} to certify it ({needed} needed with none failing): give "
        if self.data_samples_needed is not None:
            line += (f"--data with at least {self.data_samples_needed} distinct {unit} (this recipe's split holds "
                     f"{needed} out) or ")
        line += f"{needed} held-out ones with --eval-data"
        cap = self.data.held_out_max if self.data is not None else None
        if cap is not None and cap < needed:
            line += (f"; this build judges at most {cap} held-out samples: raise accuracy.max_samples to {needed} (its "
                     "notes "
                     "say where the memory its outputs take to judge lowers it)")
        return line


def fill_headline(result: BuildResult, bench: BenchmarkReport | None) -> None:
    if bench is None:
        return
    candidate = bench.models[0]
    fp32 = bench.speedup_vs_baseline.get(f"{result.backend}-fp32", {})
    eager = bench.speedup_vs_baseline.get("pytorch-eager", {})
    result.headline = [
        Headline(batch_size=b.batch_size, latency_p50_ms=b.latency.p50_ms, throughput_per_s=b.throughput_per_s,
                 speedup_vs_fp32=fp32.get(b.batch_size, 1.0 if result.precision == "fp32" else None),
                 speedup_vs_pytorch=eager.get(b.batch_size))
        for b in candidate.batches
    ]
    result.latency_p50_ms = candidate.batches[0].latency.p50_ms
    result.throughput_per_s = candidate.batches[-1].throughput_per_s
