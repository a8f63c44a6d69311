"""What one build knows as its stages run: the context pipeline.build() threads through them (its own module, so
the stage bodies beside their domains can name its type without importing the pipeline)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accel_opt.accuracy import AccuracyReport
from accel_opt.accuracy.metrics import aimed_gate
from accel_opt.artifact.config import ResourceConfig
from accel_opt.artifact.signing import Signer
from accel_opt.backends import Backend, CompiledModel
from accel_opt.bench import BenchmarkReport
from accel_opt.data import DataSplit, DataSummary, Sample
from accel_opt.graph.cleanup import CleanupReport
from accel_opt.graph.inspect import ResolvedShapes, TensorSpec
from accel_opt.graph.load import LoadedModel
from accel_opt.machine.cpu import CpuProfile
from accel_opt.precision import PrecisionReport, fallback
from accel_opt.recipe.gate import TaskMetric, Tolerance
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.types import Precision
from accel_opt.report.verdict import Verdict
from accel_opt.runtime import Deployment


@dataclass
class CandidateLimits:
    """What `--precision auto` tells one candidate's build (None for a plain build): its share of the time budget for
    the rescue search, the throughput it must be able to beat, and where the search's steps are reported."""

    label: str  # "openvino int8"
    search_budget_s: float  # replaces precision_options.fallback.time_budget_s for this candidate
    beat_per_s: float | None = None  # the best throughput at the target batch among the candidates signed off so far
    beat_label: str = ""
    fp32_per_s: float | None = None  # this backend's fp32 throughput at the target batch (its fp32 candidate's build)
    on_step: Callable[[Any], None] | None = None  # called with each SearchStep as the search records it
    family_note: str = ""  # the level its held-out verdict is read at, family-wise over auto's reduced candidates

    def cannot_win(self, speedup: float | None) -> str | None:
        """Why a build whose naive form runs `speedup` x its backend's fp32 cannot win even if fully rescued: the naive
        build is the fastest any rescue makes it, and it is not faster than what is already signed off (with a 10%
        margin for the two having been timed in separate builds). None: it can."""
        if speedup is None or self.beat_per_s is None or self.fp32_per_s is None:
            return None
        best_case = speedup * self.fp32_per_s
        if best_case >= CANNOT_WIN_MARGIN * self.beat_per_s:
            return None
        return (f"even fully rescued it would run at most {best_case:.1f} samples/s (its naive build: {speedup:.2f}x "
                f"its fp32's {self.fp32_per_s:.1f}), below {self.beat_label}'s {self.beat_per_s:.1f} already signed off")


CANNOT_WIN_MARGIN = 0.9


@dataclass(frozen=True)
class Samples:
    """The build's samples by role, dealt once by the load stage and never rewritten: each role as the reference takes
    it and as the deployed folder takes it (fused preprocessing: the host's uint8 crops; draft decoding and the torch
    device path: the job's own inputs), with the names the reports give them.

    calibration: fits int8 ranges. steering: steers choices (the rescue search, the cleanup check, auto's shortlist),
    never judges the verdict. held_out: judges the verdict and nothing else. timed: what the benchmark times, as the
    reference's side and the folder's side take it: the held-out samples, texts padded to one length (a batch of one
    shape) while the gate judges them as they are."""

    calibration: list[Sample]
    steering: list[Sample]
    steering_deployed: list[Sample]
    steering_names: list[str]
    held_out: list[Sample]
    held_out_deployed: list[Sample]
    held_out_names: list[str]
    timed: list[Sample]
    timed_deployed: list[Sample]


@dataclass
class BuildContext:
    model_path: Path
    recipe: Recipe
    data_dir: Path | None
    workdir: Path
    staging: Path
    cache_dir: Path | None
    backend: Backend
    threads: int
    cpu: CpuProfile  # the CPU the build's class-dependent choices are made for, and its manifest records
    signer: Signer | None = None  # build --sign-key: signs the finished folder (artifact.signing.signer_of)
    notes: list[str] = field(default_factory=list)
    factory: Any = None  # a torch ModuleFactory when the input is FILE.py:FACTORY
    torch_module: Any = None  # the exported module: the accuracy reference and a baseline row
    export: dict[str, Any] | None = None  # export + verification reports
    loaded: LoadedModel | None = None
    source_path: Path | None = None  # the ONNX file given (or exported); model_path may become a cleaned copy
    model_sha256: str = ""
    external_data_sha256: dict[str, str] = field(default_factory=dict)
    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[TensorSpec] = field(default_factory=list)
    shapes: ResolvedShapes | None = None
    deploy_batch: int = 1  # rows per call of the shipped model: what the gate evaluates and `run` uses
    data: DataSummary | None = None
    eval_data_dir: Path | None = None  # --eval-data: the held-out samples, instead of a share of --data
    eval_data: DataSummary | None = None
    split: DataSplit | None = None  # which sample has which role (calibration, steering, verdict): the manifest records it
    verdict_max: int | None = None  # held-out samples judged at most (accuracy.max_samples, or less for memory)
    sample_names: list[str] = field(default_factory=list)  # every sample read, in index order (split's indices)
    sample_keys: list[str] = field(default_factory=list)  # the --data samples' content hashes (data.sample_key), same order
    sample_groups: list[str] | None = None  # each sample's group, where the user grouped them (data.groups)
    sample_labels: list[int] = field(default_factory=list)  # each sample's class (--labels), aligned with samples
    samples: Samples | None = None  # the samples by role, read once by the load stage
    host_crops: list[Sample] = field(default_factory=list)  # fused preprocessing: every --data image as uint8 HWC crops
    # Every --data image as the artifact's own job makes it where that is not the reference's host path (draft
    # decoding; the torch backend's tensor path): the candidate's inputs, judged against the reference on full decodes.
    job_samples: list[Sample] = field(default_factory=list)
    max_feed: Sample | None = None  # a feed at --max-shapes, for the capacity check
    text_encoder: Any = None  # the recipe's text stage with its tokenizer (preprocess.text.TextEncoder)
    tokenizer_path: Path | None = None  # the tokenizer file the artifact folder carries
    cleanup: CleanupReport | None = None
    fp32_path: Path | None = None  # after cleanup: the baseline every precision is compared with
    precision: PrecisionReport | None = None
    fallback: fallback.FallbackReport | None = None
    candidate_path: Path | None = None
    compiled: CompiledModel | None = None  # the compile in the workdir (its settings go to the resource config)
    resource_config: ResourceConfig | None = None
    deployment: Deployment | None = None  # the staged artifact, loaded as a user would: what is checked and timed
    deployed_hashes: dict[str, str] = field(default_factory=dict)  # its files' sha256 when it was loaded
    accuracy: AccuracyReport | None = None
    bench: BenchmarkReport | None = None
    verdict: Verdict | None = None  # the one verdict, made by the verdict stage after the benchmark
    limits: CandidateLimits | None = None  # set when this build is a candidate of --precision auto
    reference_caches: dict | None = None  # auto: the reference's outputs by reference, shared by its candidates

    @property
    def torch(self) -> bool:
        """The build ships the PyTorch module (--backend torch), not an ONNX graph."""
        return self.backend.name == "torch"

    @property
    def fused(self) -> bool:
        """Normalization is fused into the model: the artifact takes the host's uint8 crops."""
        return self.recipe.preprocessing is not None and self.recipe.preprocessing.fused

    @property
    def image_input(self) -> str:
        """The input the image preprocessing feeds (the model's first when the recipe names none)."""
        from accel_opt.preprocess.fit import image_input

        pre = self.recipe.preprocessing
        return image_input(pre, self.inputs).name if pre else self.inputs[0].name

    @property
    def eval_groups(self) -> list[str] | None:
        """The held-out samples' groups (None: not grouped): the verdict's rates count groups as their trials."""
        return [self.sample_groups[i] for i in self.split.verdict] if self.sample_groups else None

    @property
    def eval_labels(self) -> list[int] | None:
        """The held-out samples' classes (--labels), None without labels."""
        return [self.sample_labels[i] for i in self.split.verdict] if self.sample_labels else None

    @property
    def steering_labels(self) -> list[int] | None:
        """The steering samples' classes (--labels): auto's shortlist reads the labeled gate there too."""
        return [self.sample_labels[i] for i in self.split.steering] if self.sample_labels else None

    @property
    def bounded(self) -> bool:
        """Whether the verdict's rates must clear their minimums by their confidence bound: every reduced precision
        on real data. An fp32 build is judged against the float32 noise floor by its observed rates, never refused for
        few samples; synthetic inputs (no --data) certify no rate: a numeric check on the observed counts."""
        synthetic = self.data is not None and self.data.synthetic
        return self.recipe.precision is not Precision.fp32 and not synthetic

    def steering_gate(self) -> tuple[Tolerance, list[TaskMetric], list[str]]:
        """(tolerance, task metrics, hopeless lines) a choice made on the steering samples judges by: for a bounded
        verdict, the rates the held-out samples can certify (accuracy.metrics.aimed_gate); else the recipe's own."""
        tolerance, metrics = self.recipe.tolerance, list(self.recipe.accuracy.task_metrics)
        if not self.bounded:
            return tolerance, metrics, []
        if self.recipe.accuracy.labels.labels_only:  # agreement is reported, not gated: it cannot make a build hopeless
            return tolerance, metrics, []
        return aimed_gate(tolerance, metrics, len(self.samples.held_out), self.recipe.accuracy.confidence)
