"""What each stage of a build hands on: typed, frozen results (the setup, the exported module, the loaded model, the
samples dealt by role, the cleaned and reduced graphs, the compiled folder, the accuracy check, the measurements and
the verdict), and BuildSoFar, which holds those made so far. pipeline.build() adds each stage's result as it passes;
no stage rewrites another's. Its own module, so the stage bodies beside their domains can name these types without
importing the pipeline."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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
                f"its fp32's {self.fp32_per_s:.1f}), below {self.beat_label}'s {self.beat_per_s:.1f} already signed "
                "off")


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


@dataclass(frozen=True)
class Setup:
    """What the build was asked: its arguments, resolved once by pipeline.build before any stage runs."""

    model_path: Path  # the ONNX file given (a factory: its name, .onnx)
    recipe: Recipe
    data_dir: Path | None
    eval_data_dir: Path | None  # --eval-data: the held-out samples, instead of a share of --data
    workdir: Path
    staging: Path
    cache_dir: Path | None
    backend: Backend
    threads: int
    cpu: CpuProfile  # the CPU the build's class-dependent choices are made for, and its manifest records
    signer: Signer | None = None  # build --sign-key: signs the finished folder (artifact.signing.signer_of)
    factory: Any = None  # a torch ModuleFactory when the input is FILE.py:FACTORY
    limits: CandidateLimits | None = None  # set when this build is a candidate of --precision auto
    reference_caches: dict | None = None  # auto: the reference's outputs by reference, shared by its candidates
    notes: tuple[str, ...] = ()  # what choosing the recipe said (builder.sources)


@dataclass(frozen=True)
class Exported:
    """The export stage's result: a PyTorch factory's module, exported and checked against itself."""

    torch_module: Any  # the accuracy reference and a baseline row
    onnx_path: Path
    record: dict[str, Any]  # export + verification reports (build.json)
    recipe: Recipe  # the setup's, with the example shapes a text factory was exported at
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Loaded:
    """The load stage's model: validated and loaded, its inputs and outputs, and the recipe fitted to it."""

    model: LoadedModel
    source_path: Path  # the ONNX file given (or exported); model.path may be a converted copy
    model_sha256: str
    external_data_sha256: dict[str, str]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    recipe: Recipe  # preprocessing fitted to the inputs; a text model's capacity shapes at its longest text
    text_encoder: Any = None  # the recipe's text stage with its tokenizer (preprocess.text.TextEncoder)
    tokenizer_path: Path | None = None  # the tokenizer file the artifact folder carries
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Dealt:
    """The load stage's samples: what --data and --eval-data hold, the shapes they resolve, and every sample's role."""

    data: DataSummary
    eval_data: DataSummary | None
    split: DataSplit  # which sample has which role (calibration, steering, verdict): the manifest records it
    sample_names: list[str]  # every sample read, in index order (split's indices)
    sample_keys: list[str]  # the --data samples' content hashes (data.sample_key), same order
    sample_groups: list[str] | None  # each sample's group, where the user grouped them (data.groups)
    sample_labels: list[int]  # each sample's class (--labels), aligned with the samples
    verdict_max: int | None  # held-out samples judged at most (accuracy.max_samples, or less for memory)
    samples: Samples
    shapes: ResolvedShapes
    deploy_batch: int  # rows per call of the shipped model: what the gate evaluates and `run` uses
    max_feed: Sample | None = None  # a feed at --max-shapes, for the capacity check
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Cleaned:
    """The cleanup stage's result: the fp32 graph every precision starts from and is compared with."""

    fp32_path: Path
    report: CleanupReport | None = None


@dataclass(frozen=True)
class Reduced:
    """The precision stage's result: the candidate model (graph, NNCF IR or a torch plan) and how it was made."""

    candidate_path: Path
    precision: PrecisionReport | None = None
    fallback: fallback.FallbackReport | None = None


@dataclass(frozen=True)
class Compiled:
    """The compile stage's result: the staged folder, loaded back as a user would: what is checked and timed."""

    compiled: CompiledModel  # the compile in the workdir (its settings go to the resource config)
    resource_config: ResourceConfig
    deployment: Deployment
    deployed_hashes: dict[str, str]  # the staged files' sha256 when it was loaded
    shapes: ResolvedShapes  # the load stage's, or as given where the model fails at the deployed batch
    deploy_batch: int
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Checked:
    """The accuracy stage's result: the held-out comparison, and the deployment with where its outputs hold a batch's
    samples (what the gate found is part of how the folder runs)."""

    accuracy: AccuracyReport
    deployment: Deployment
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class BuildSoFar:
    """What a stage is handed: the setup and each earlier stage's result, never rewritten (pipeline.build makes a new
    one with each stage's result added). The properties read a value where the latest stage that settles it left it."""

    setup: Setup
    exported: Exported | None = None
    loaded: Loaded | None = None
    dealt: Dealt | None = None
    cleaned: Cleaned | None = None
    reduced: Reduced | None = None
    compiled: Compiled | None = None
    checked: Checked | None = None
    measured: BenchmarkReport | None = None
    verdict: Verdict | None = None

    @property
    def recipe(self) -> Recipe:
        return (self.loaded or self.exported or self.setup).recipe

    @property
    def model_path(self) -> Path:
        """The ONNX model the build reads: as given, exported, then as loaded (a converted copy where it had to be)."""
        if self.loaded is not None:
            return self.loaded.model.path
        return self.exported.onnx_path if self.exported is not None else self.setup.model_path




    @property
    def torch_module(self):
        return self.exported.torch_module if self.exported is not None else None




    @property
    def shapes(self) -> ResolvedShapes:
        return (self.compiled or self.dealt).shapes

    @property
    def deploy_batch(self) -> int:
        return (self.compiled or self.dealt).deploy_batch

    @property
    def fp32_path(self) -> Path:
        """The baseline every precision is compared with: the cleaned graph, or the loaded one."""
        return self.cleaned.fp32_path if self.cleaned is not None else self.model_path

    @property
    def candidate_path(self) -> Path:
        return self.reduced.candidate_path if self.reduced is not None else self.fp32_path

    @property
    def fallback(self) -> fallback.FallbackReport | None:
        return self.reduced.fallback if self.reduced is not None else None

    @property
    def deployment(self) -> Deployment:
        return (self.checked or self.compiled).deployment


    @property
    def notes(self) -> list[str]:
        """Every stage's notes, in stage order."""
        parts = [self.setup, self.exported, self.loaded, self.dealt, self.compiled, self.checked]
        return [note for part in parts if part is not None for note in part.notes]

    @property
    def torch(self) -> bool:
        """The build ships the PyTorch module (--backend torch), not an ONNX graph."""
        return self.setup.backend.name == "torch"

    @property
    def fused(self) -> bool:
        """Normalization is fused into the model: the artifact takes the host's uint8 crops."""
        return self.recipe.preprocessing is not None and self.recipe.preprocessing.fused

    @property
    def image_input(self) -> str:
        """The input the image preprocessing feeds (the model's first when the recipe names none)."""
        from accel_opt.preprocess.fit import image_input

        pre = self.recipe.preprocessing
        return image_input(pre, self.loaded.inputs).name if pre else self.loaded.inputs[0].name

    @property
    def eval_groups(self) -> list[str] | None:
        """The held-out samples' groups (None: not grouped): the verdict's rates count groups as their trials."""
        dealt = self.dealt
        return [dealt.sample_groups[i] for i in dealt.split.verdict] if dealt.sample_groups else None

    @property
    def eval_labels(self) -> list[int] | None:
        """The held-out samples' classes (--labels), None without labels."""
        dealt = self.dealt
        return [dealt.sample_labels[i] for i in dealt.split.verdict] if dealt.sample_labels else None

    @property
    def steering_labels(self) -> list[int] | None:
        """The steering samples' classes (--labels): auto's shortlist reads the labeled gate there too."""
        dealt = self.dealt
        return [dealt.sample_labels[i] for i in dealt.split.steering] if dealt.sample_labels else None

    @property
    def bounded(self) -> bool:
        """Whether the verdict's rates must clear their minimums by their confidence bound: every reduced precision
        on real data. An fp32 build is judged against the float32 noise floor by its observed rates, never refused for
        few samples; synthetic inputs (no --data) certify no rate: a numeric check on the observed counts."""
        synthetic = self.dealt is not None and self.dealt.data.synthetic
        return self.recipe.precision is not Precision.fp32 and not synthetic

    def steering_gate(self) -> tuple[Tolerance, list[TaskMetric], list[str]]:
        """(tolerance, task metrics, hopeless lines) a choice made on the steering samples judges by: for a bounded
        verdict, the rates the held-out samples can certify (accuracy.metrics.aimed_gate); else the recipe's own."""
        tolerance, metrics = self.recipe.tolerance, list(self.recipe.accuracy.task_metrics)
        if not self.bounded:
            return tolerance, metrics, []
        if self.recipe.accuracy.labels.labels_only:  # agreement is reported, not gated: it cannot make a build hopeless
            return tolerance, metrics, []
        return aimed_gate(tolerance, metrics, len(self.dealt.samples.held_out), self.recipe.accuracy.confidence)
