"""What one build knows as its stages run: the context pipeline.build() threads through them (its own module, so
the stage bodies beside their domains can name its type without importing the pipeline)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accel_opt.accuracy import AccuracyReport
from accel_opt.backends import Backend, CompiledModel
from accel_opt.bench import BenchmarkReport
from accel_opt.data import DataSummary, Sample
from accel_opt.graph.cleanup import CleanupReport
from accel_opt.graph.inspect import ResolvedShapes, TensorSpec
from accel_opt.graph.load import LoadedModel
from accel_opt.precision import PrecisionReport, fallback
from accel_opt.recipe import Recipe
from accel_opt.runtime import Deployment, ResourceConfig


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
    calibration_samples: list[Sample] = field(default_factory=list)
    eval_samples: list[Sample] = field(default_factory=list)
    eval_names: list[str] = field(default_factory=list)
    deploy_samples: list[Sample] = field(default_factory=list)  # the eval samples as the artifact takes them (fused: uint8 crops)
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
