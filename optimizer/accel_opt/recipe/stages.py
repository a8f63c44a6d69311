"""The build's keys stage by stage: cleanup, the precision transform (calibration, the rescue search), the benchmark,
`--precision auto`'s selection, and each backend's options."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from accel_opt.recipe.types import CalibrationMethod, QuantTarget, TargetCpu, _Strict


class BenchmarkConfig(_Strict):
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 8], min_length=1)
    warmup_iterations: int = Field(default=10, ge=0)
    min_iterations: int = Field(default=50, ge=1)
    max_iterations: int = Field(default=2000, ge=1)
    min_seconds: float = Field(default=2.0, ge=0)  # per batch size, after warm-up
    threads: int | None = Field(default=None, ge=1)  # intra-op threads; default: CPUs available
    # The sweep: every batch size x concurrency (workers with a session each, requests back to back),
    # each point measured in windows until the last 3 windows' throughput is within stability_pct of
    # their mean (perf_analyzer's criterion), at most max_windows.
    # nothing swept: no point
    concurrency: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 2], min_length=1)
    window_seconds: float = Field(default=0.5, gt=0)
    stability_pct: float = Field(default=10.0, gt=0)
    max_windows: int = Field(default=8, ge=4)
    # Budgets the recommended configuration must meet; one nothing meets fails the build (exit 1).
    p99_budget_ms: float | None = Field(default=None, gt=0)
    memory_budget_mib: float | None = Field(default=None, gt=0)  # peak process memory at any point, capacity included
    # The largest shapes the deployment must take (trtexec's --maxShapes): the capacity point runs at them.
    max_shapes: dict[str, list[Annotated[int, Field(ge=1)]]] = Field(default_factory=dict)
    # A reduced precision signs off only when it is measured to pay: the one-sided lower bound (accuracy.confidence)
    # of its speed-up over its fp32 build, same backend, deployed batch, interleaved rounds, must reach this.
    # Below it the verdict is "no measured benefit" (exit 7). 0: the rule is off (the speed-up is still reported).
    min_speedup: float = Field(default=1.05, ge=0)


class CleanupConfig(_Strict):
    # The simplified model is used only if it matches the original within the fp32 tolerance.
    enabled: bool = True


class CalibrationConfig(_Strict):
    method: CalibrationMethod = CalibrationMethod.minmax
    # minmax only: each sample's min and max enter an exponential moving average (ONNX Runtime's CalibMovingAverage,
    # constant 0.01) instead of the extremes over all samples: one outlier sample no longer sets a range.
    moving_average: bool = False
    samples: int = Field(default=64, ge=1)
    target: QuantTarget = QuantTarget.auto
    percentile: float = Field(default=99.999, gt=90, le=100)
    # Entropy / percentile histogram bins. ONNX Runtime's entropy search is quadratic in them: 100,000 bins were still
    # calibrating a 10-class toy model after 120 s on 2 cores; 8192 bounds it at 16x the default's work.
    num_bins: int = Field(default=2048, ge=128, le=8192)
    per_channel: bool = True
    # ONNX Runtime's QDQKeepRemovableActivations: a Relu/Clip stays explicit between Q/DQ pairs instead of folding into
    # the quantization range (TensorRT's preset keeps them anyway). False: the preset decides.
    keep_removable_activations: bool = False
    # Op types that get Q/DQ; None: every op ONNX Runtime has a Q/DQ kernel for (CNNs gain from
    # quantized Add/Pool too). Transformers: [MatMul, Gemm] keeps masks, softmax and norms in float.
    op_types: list[str] | None = None
    # The CPU class the int8 graph is built for (its kernels decide the weights' range): "host" is this machine.
    # On avx2 / avx512 without VNNI the u8 x s8 kernels sum pairs in int16 and saturate: 7-bit weights there.
    target_cpu: TargetCpu = "host"
    # 7-bit weights: None follows target_cpu (on where the kernels saturate); true/false overrides that.
    reduce_range: bool | None = None
    # Each quantized Conv/Gemm's bias absorbs the mean shift its rounded weights add, measured on the calibration
    # samples (depthwise convolutions shift most). Off: the rescue search tries it as a remedy and keeps it on gain.
    bias_correction: bool = False
    # "adaround": each layer's integer weights rounded up or down so its output on the calibration samples is closest
    # to the float model's, layer by layer (precision/adaround.py; needs PyTorch, the `ptq` extra): minutes on a mobile
    # net (EfficientNet-Lite0: 4.5 to 5 min on 2 cores). "nearest": off, and the rescue search tries it as a remedy.
    weight_rounding: Literal["nearest", "adaround"] = "nearest"
    adaround_iterations: int = Field(default=300, ge=1)  # optimizer steps per layer
    # Wall clock, checked before each layer; the layers left keep nearest rounding. AdaRound's cost grows with the
    # model's FLOPs and weights: this bounds what it adds to a build, and to the rescue search that tries it.
    adaround_time_budget_s: float = Field(default=600.0, gt=0)
    # Every quantized layer's bias trained together, after the other remedies, so the graph's outputs come closest
    # to the float model's on the calibration samples, a quarter held back to choose the checkpoint (a distillation;
    # precision/output_fit.py, needs PyTorch, the `ptq` extra): about 2 min on a mobile net on 2 cores. Not a remedy
    # of the rescue search: after AdaRound it gained nothing on EfficientNet-Lite0 and took a quarter of its budget.
    bias_fit: bool = False
    bias_fit_steps: int = Field(default=200, ge=1)  # optimizer steps of 8 samples
    bias_fit_time_budget_s: float = Field(default=600.0, gt=0)  # wall clock, checked before each step
    # The fit's stronger form: every quantized layer's int8 weights trained too, with the biases, in one fit
    # (precision/output_fit.py; the `ptq` extra): ~0.75 s a step on EfficientNet-Lite0 on 2 cores. It needs hundreds of
    # calibration samples (calibration.samples): on a few dozen it overfits, and the held-back quarter keeps nothing.
    # Not a remedy of the rescue search: minutes on top of AdaRound exceed its budget.
    weight_fit: bool = False
    weight_fit_steps: int = Field(default=600, ge=1)  # optimizer steps of 8 samples
    weight_fit_time_budget_s: float = Field(default=900.0, gt=0)  # wall clock, checked before each step
    # Who places and calibrates the int8 quantizers. "accel-opt": this project's Q/DQ ONNX (every backend; the keys
    # above). "nncf": NNCF's post-training quantization of the OpenVINO model, with full bias correction
    # (precision/nncf_openvino.py; the OpenVINO backend only, the `openvino` extra): the build ships the OpenVINO IR
    # NNCF writes (model.xml + model.bin), and NNCF's own presets for the CPU plugin replace the keys above, which
    # must keep their defaults. The rescue search of an OpenVINO int8 build tries it as a remedy.
    quantizer: Literal["accel-opt", "nncf"] = "accel-opt"
    # NNCF only: SmoothQuant on the convolutions (alpha 0.15, NNCF's own for them; NNCF runs it for its transformer
    # model type only) and ChannelAlignment (NNCF 3.4.0 fails on EfficientNet-Lite0 with KeyError: numpy.float32).
    smooth_quant: bool = False
    channel_alignment: bool = False

    @model_validator(mode="after")
    def _consistent_keys(self) -> CalibrationConfig:
        if self.moving_average and self.method is not CalibrationMethod.minmax:
            raise ValueError(f"moving_average averages min/max ranges: method {self.method.value} takes none")
        if self.quantizer == "accel-opt":
            on = [k for k in ("smooth_quant", "channel_alignment") if getattr(self, k)]
            if on:
                raise ValueError(f"{' and '.join(on)} run in NNCF only: set quantizer: nncf")
            return self
        changed = [k for k, default in NNCF_REPLACES.items() if getattr(self, k) != default]
        if changed:
            raise ValueError(f"quantizer nncf calibrates with NNCF's own presets: {', '.join(changed)} must keep "
                             "the default (" + ", ".join(f"{k}: {getattr(NNCF_REPLACES[k], 'value', NNCF_REPLACES[k])}"
                                                  for k in changed) + ")")
        return self


# What quantizer: nncf replaces (NNCF's own range estimators, per-channel symmetric weights and overflow handling for
# OpenVINO's CPU plugin, its own bias correction): each key must keep this default.
NNCF_REPLACES: dict[str, object] = {
    "method": CalibrationMethod.minmax, "moving_average": False, "per_channel": True,
    "keep_removable_activations": False, "op_types": None, "target": QuantTarget.auto,
    "target_cpu": "host", "reduce_range": None, "bias_correction": False, "weight_rounding": "nearest",
    "bias_fit": False, "weight_fit": False}


class FallbackConfig(_Strict):
    """Accuracy-driven fallback for int8/fp16/bf16: when the reduced build fails the recipe's tolerance and task
    metrics on the steering samples, a measured search (other calibrations, then groups of layers restored to float in
    the order of their measured gain) looks for a build that passes while it still pays in speed."""

    @model_validator(mode="before")
    @classmethod
    def _earlier_names(cls, data: Any) -> Any:
        """`probe_samples`, the key's earlier name, still read; where an `extends:` base gives `steering_samples` too,
        the recipe's own `probe_samples` wins (the bundled recipes say `steering_samples`)."""
        if isinstance(data, dict) and "probe_samples" in data:
            data = {k: v for k, v in data.items() if k != "probe_samples"} | {"steering_samples": data["probe_samples"]}
        return data

    enabled: bool = True
    max_rounds: int = Field(default=8, ge=1)  # groups of layers added to the float set, at most
    # The speed budget: the search keeps nothing in float that would take the build below this speed-up over the same
    # backend's fp32 build (timed on the deployed kernels), and does not search at all for a build that starts below it.
    min_speedup: float = Field(default=1.1, gt=0)
    # The time budget of the search, wall clock, checked before each build: a mobile classifier's search fits in
    # about ten minutes on two cores.
    time_budget_s: float = Field(default=600.0, gt=0)
    # Groups measured one by one (each a build); with more, those the per-layer diagnosis blames most.
    max_measured_units: int = Field(default=32, ge=1)
    # The network's last k Conv/MatMul/Gemm layers, for each k here, are a unit of their own, measured before the
    # groups of same-shaped layers (a k above a quarter of the layers is skipped): the common remedy of a head kept in
    # higher precision, which no group covers. Two builds, ~7 s each on EfficientNet-Lite0 (where it did not gain).
    tail_layers: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [4, 10])  # []: none
    # An optional cap on the Conv/MatMul/Gemm FLOPs left in float; the speed budget decides by default.
    max_fp32_flops_fraction: float = Field(default=1.0, gt=0, le=1)
    # The first steering samples (at most accuracy.split.max_steering, 32), judged for every variant of the search
    # (`probe_samples`: the key's earlier name, still read). All 32: aimed at what the held-out verdict certifies, they
    # may show no change, and a build changing 5% of its answers shows none on 16 samples 44% of the time (0.95^16),
    # on 32 19%. Measured on EfficientNet-Lite0 with OpenVINO (AVX-512 VNNI): the search stopped at 91.7% held-out
    # top-1 agreement on 16 steering samples, 95.1% on 32.
    steering_samples: int = Field(default=32, ge=1)
    diagnosis_samples: int = Field(default=4, ge=1)  # the first steering samples, run layer by layer (the costly part)
    # fp16: nodes whose fp32 activations exceed this on a steering sample stay fp32 before any build is judged
    # (float16 holds at most 65504; the margin covers inputs larger than the steering samples).
    fp16_activation_max: float = Field(default=8192.0, gt=0, le=65504)


class PrecisionConfig(_Strict):
    keep_io_types: bool = True  # fp16/bf16: inputs and outputs stay fp32
    # fp16/bf16: op types kept in fp32 (overflow-prone reductions and normalizations).
    block_ops: list[str] = Field(
        default_factory=lambda: [
            "LayerNormalization", "InstanceNormalization", "GroupNormalization",
            "Softmax", "LogSoftmax", "Exp", "Pow", "ReduceMean", "ReduceSum",
            "ReduceSumSquare", "ReduceL2", "ReduceLogSumExp", "Resize", "Range", "CumSum",
        ]
    )
    block_nodes: list[str] = Field(default_factory=list)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    fallback: FallbackConfig = Field(default_factory=FallbackConfig)


# What each `selection.objective` counts (the selection report says it).
OBJECTIVES = {
    "latency": "lowest p50 at batch 1",
    "throughput": "most samples/s at the target batch",
    "throughput_within_p99": "most samples/s at any benchmarked batch whose p99 meets the budget",
}


class SelectionConfig(_Strict):
    """How `--backend auto` / `--precision auto` pick among signed-off candidates."""

    # What `--precision auto` optimizes, every candidate timed on it in one interleaved runoff:
    #   latency: p50 at batch 1; throughput: samples/s at target_batch_size;
    #   throughput_within_p99: the best samples/s over benchmark.batch_sizes whose p99 <= latency_budget_ms.
    objective: Literal["latency", "throughput", "throughput_within_p99"] = "throughput"
    target_batch_size: int = Field(default=8, ge=1)  # the deployed batch (dynamic batch) and the throughput objective's
    latency_budget_ms: float | None = Field(default=None, gt=0)  # p99 per call; candidates over it lose
    # Wall clock for every candidate's build together (--time-budget); null: no limit. The fp32 builds run first;
    # reduced candidates share what is left for their rescue searches, and what the budget leaves untried is said.
    # 15 minutes: a 640x640 detector's four candidates (two fp32 builds, two int8 with a search) on 2 cores.
    time_budget_s: float | None = Field(default=900.0, gt=0)

    @model_validator(mode="after")
    def _budget_for_p99_objective(self) -> SelectionConfig:
        if self.objective == "throughput_within_p99" and self.latency_budget_ms is None:
            raise ValueError("objective throughput_within_p99 needs latency_budget_ms")
        return self


class TensorRtConfig(_Strict):
    """Native TensorRT builds (--backend tensorrt). Profiles default to batch 1 .. the largest benchmarked
    batch at the resolved shapes; the *_shapes here override them per input."""

    workspace_mib: int = Field(default=4096, ge=1)
    optimization_level: int = Field(default=3, ge=0, le=5)  # builder optimization level (TensorRT's default 3)
    build_timeout_s: float = Field(default=3600, gt=0)
    min_shapes: dict[str, list[Annotated[int, Field(ge=1)]]] = Field(default_factory=dict)
    opt_shapes: dict[str, list[Annotated[int, Field(ge=1)]]] = Field(default_factory=dict)
    max_shapes: dict[str, list[Annotated[int, Field(ge=1)]]] = Field(default_factory=dict)
    timing_cache_dir: str | None = None  # reused only on the same GPU and TensorRT version
    # Let the runtime deserialize host code a plan carries (version-compatible plans, plugins). TensorRT's default is
    # off; with it on, the engine still runs its host code only from a folder whose signature was verified.
    allow_host_code: bool = False


class TorchConfig(_Strict):
    """The torch backend (--backend torch): an AOTInductor package compiled for one device. `device`: "cpu" or
    "cuda[:N]"; null picks the GPU when torch sees one, else the CPU (the choice is recorded in the manifest)."""

    device: str | None = Field(default=None, pattern=r"^(cpu|cuda(:\d+)?)$")


class OnnxRuntimeConfig(_Strict):
    """ONNX Runtime's execution provider (--backend onnxruntime). providers[0] runs the model; CUDA/TensorRT
    EPs need an NVIDIA GPU and onnxruntime-gpu (pip uninstall -y onnxruntime, then install accel-opt's `gpu` extra),
    the TensorRT EP also TensorRT's libraries. Later entries are not fallbacks."""

    providers: list[Literal["CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"]] = Field(
        default_factory=lambda: ["CPUExecutionProvider"], min_length=1)
    # Off: a GPU build whose EP would leave any node to the CPU EP is refused (exit 4), naming the ops.
    allow_cpu_nodes: bool = False
