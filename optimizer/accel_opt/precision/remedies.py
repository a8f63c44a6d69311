"""The rescue search's whole-graph remedies: one small protocol, and the ordered registry the search's plan, the
calibration keys the remedies set (REMEDY_KEYS, which NNCF's quantizer resets) and the reports' names come from.
Adding a remedy is one class in REMEDIES and the recipe field it sets (recipe/stages.py CalibrationConfig): the int8
transform reads the field, and a remedy that changes the Q/DQ graph's integers after the quantizer placed them says how
in its `refine` (run by `refine` below, in the registry's `refine_order`).

Each remedy estimates its cost from the model's size: seconds per GFLOP-sample (the model's Conv/MatMul/Gemm FLOPs
at batch 1 times the calibration samples), measured on EfficientNet-Lite0 (0.78 GFLOP, 64 calibration crops: 50
GFLOP-samples) on a 2-vCPU AMD EPYC (AVX-512 VNNI): bias correction 4-5 s, percentile calibration 12-13 s, entropy
66-69 s, moving-average 6 s, per-tensor weights 2-3 s, Relu/Clip kept 3-4 s, NNCF on OpenVINO 10 s, AdaRound 356-395 s
(300 steps per layer); the weight fit 595 s for 600 steps of 8 crops. The search plans them cheapest first, scales the
estimates by how long the builds it has made took against theirs (another host, another model), and starts one only
where its estimate fits what is left of its budget.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from accel_opt.data import Sample
from accel_opt.files import install_line
from accel_opt.recipe.stages import CalibrationConfig

if TYPE_CHECKING:
    from accel_opt.precision.int8 import QuantSettings

KEY = "precision_options.calibration."  # the recipe keys the remedies set live here


@dataclass(frozen=True)
class ModelSize:
    """What a remedy's cost grows with: the model's FLOPs per sample and the samples it calibrates on."""

    gflops: float  # Conv/MatMul/Gemm GFLOPs at batch 1 (bench.efficiency.node_flops)
    calibration_samples: int

    @property
    def gflop_samples(self) -> float:
        return max(self.gflops, 1e-3) * max(self.calibration_samples, 1)


@dataclass(frozen=True)
class Planned:
    """A remedy as the search tries it: its name, the recipe keys it sets on top of the recipe, why it cannot run here
    (a missing package: recorded, skipped), its estimated seconds, and the key bounding its own loop in seconds (the
    search lowers it to what is left of its budget: a long remedy stops with what it has)."""

    name: str  # "bias correction", "percentile calibration"
    overrides: dict[str, object]
    unavailable: str | None = None
    estimate_s: float = 0.0
    budget_key: str | None = None  # "precision_options.calibration.adaround_time_budget_s"
    budget_s: float | None = None  # the recipe's own value of it


class Remedy(Protocol):
    """A change to how the whole graph is reduced: no layer leaves int8."""

    name: str
    keys: tuple[str, ...]  # the CalibrationConfig fields it sets
    min_calibration_samples: int  # offered only where the build calibrates on at least this many
    budget_key: str | None  # the CalibrationConfig field bounding its own loop in seconds (None: one short build)
    replaces_quantizer: bool  # another quantizer, tried instead of what was adopted (NNCF)

    def offered(self, calibration: CalibrationConfig, backend: str) -> tuple[str, dict[str, Any]] | None:
        """(its name as the reports give it, the recipe keys it sets) on top of `calibration`; None: not offered."""

    def unavailable(self, fused_preprocessing: bool) -> str | None:
        """Why it cannot run here, with the line that installs what it needs; None: it can."""

    def cost_s(self, calibration: CalibrationConfig, size: ModelSize) -> float:
        """Its estimated seconds on the host the constants were measured on."""

    refine_order: int | None  # where it changes a placed Q/DQ graph's integers (each builds on the ones before)

    def refine(self, job: Refining) -> str | None:
        """Change `job.staged` in place where `job.settings` turns this remedy on; a line for the build's notes."""


@dataclass(frozen=True)
class Refining:
    """A Q/DQ graph the quantizer placed (`staged`), and what the remedies that change its integers learn from: the
    float model, the calibration samples, the build's settings, and where what they learn is kept (`learned`)."""

    float_path: Path
    staged: Path
    samples: list[Sample]
    settings: QuantSettings
    cache_dir: Path | None
    rounding_key: str  # the graph's key before any integer changed: what AdaRound learns is kept under it
    fit_key: str  # the whole graph's key: the fits learned there serve the builds keeping layers in float
    own_key: str | None = None  # this graph's own key where it keeps layers in float, else None

    def learned(self, whole_graph_key: str, kind: str) -> Path | None:
        """Where what a remedy learns is read and kept. Learned on the graph with every layer quantized, it is kept
        under `whole_graph_key` and reused by the builds that keep layers in float (the rescue search makes many,
        after that graph). A build that keeps layers in float and finds none learns on its own graph, and keeps that
        under its own key: each layer's rounding or fit there answers the float layers it was learned beside, so
        reused by the whole graph it made every one of EfficientNet-Lite0's layers worse (logit RMS error 0.079 ->
        0.095)."""
        if self.cache_dir is None:
            return None
        whole_graph = Path(self.cache_dir) / f"{whole_graph_key}.{kind}.npz"
        if self.own_key is None or whole_graph.is_file():
            return whole_graph
        return Path(self.cache_dir) / f"{self.own_key}.{kind}.npz"


class _Remedy:
    """What most remedies share: one calibration and quantization, its cost proportional to the GFLOP-samples. Each
    subclass says what it sets (`offered`)."""

    name = ""
    keys: tuple[str, ...] = ()
    budget_key: str | None = None
    replaces_quantizer = False
    refine_order: int | None = None
    min_calibration_samples = 0  # offered only with at least this many (what it learns overfits fewer)
    seconds_per_gflop_sample: ClassVar[float] = 0.1

    def unavailable(self, fused_preprocessing: bool) -> str | None:
        return None

    def cost_s(self, calibration: CalibrationConfig, size: ModelSize) -> float:
        return self.seconds_per_gflop_sample * size.gflop_samples

    def refine(self, job: Refining) -> str | None:
        return None


class BiasCorrection(_Remedy):
    """Each bias absorbs the mean shift of its rounded weights (bias_correction.py), after AdaRound's rounding."""

    name, keys, seconds_per_gflop_sample, refine_order = "bias correction", ("bias_correction",), 0.09, 2

    def offered(self, calibration, backend):
        return None if calibration.bias_correction else (self.name, {KEY + "bias_correction": True})

    def refine(self, job):
        from accel_opt.precision.bias_correction import correct_biases

        return correct_biases(job.float_path, job.staged, job.samples) if job.settings.bias_correction else None


class _Method(_Remedy):
    """Another activation calibration method, in place of the recipe's."""

    method = ""
    keys = ("method", "moving_average")

    def offered(self, calibration, backend):
        if calibration.method.value == self.method:
            return None
        return self.name, {KEY + "method": self.method, KEY + "moving_average": False}


class PercentileCalibration(_Method):
    name, method, seconds_per_gflop_sample = "percentile calibration", "percentile", 0.25


class EntropyCalibration(_Method):
    name, method, seconds_per_gflop_sample = "entropy calibration", "entropy", 1.34


class MovingAverageCalibration(_Remedy):
    """ONNX Runtime's CalibMovingAverage: min/max ranges averaged over the samples (replaces another method)."""

    name, keys, seconds_per_gflop_sample = "moving-average calibration", ("method", "moving_average"), 0.12

    def offered(self, calibration, backend):
        if calibration.moving_average:
            return None
        return self.name, {KEY + "method": "minmax", KEY + "moving_average": True}


class WeightGranularity(_Remedy):
    """The weights' granularity flipped: per tensor where the recipe has per channel (a range per filter is finer, but
    a few large filters can be what holds), per channel where it has per tensor."""

    name, keys, seconds_per_gflop_sample = "weight granularity", ("per_channel",), 0.05

    def offered(self, calibration, backend):
        return (f"per-{'tensor' if calibration.per_channel else 'channel'} weights",
                {KEY + "per_channel": not calibration.per_channel})


class ExplicitActivations(_Remedy):
    """Relu/Clip kept as nodes of their own instead of folded into the ranges before them."""

    name, keys, seconds_per_gflop_sample = "Relu/Clip kept explicit", ("keep_removable_activations",), 0.07

    def offered(self, calibration, backend):
        if calibration.keep_removable_activations or _preset_keeps_activations(calibration, backend):
            return None
        return self.name, {KEY + "keep_removable_activations": True}


class _NeedsTorch(_Remedy):
    def unavailable(self, fused_preprocessing: bool) -> str | None:
        return None if importlib.util.find_spec("torch") else f"needs PyTorch: {install_line('ptq')}"


class AdaRound(_NeedsTorch):
    """Each layer's weights rounded to fit the float model's output (adaround.py): it learns for the activation ranges
    chosen before it, so it is learned once, after the cheaper remedies."""

    name, keys, budget_key = "AdaRound", ("weight_rounding",), "adaround_time_budget_s"
    seconds_per_gflop_sample, refine_order = 7.5, 1  # at 300 steps per layer; first: the others build on its integers

    def offered(self, calibration, backend):
        if calibration.weight_rounding == "adaround":
            return None
        return self.name, {KEY + "weight_rounding": "adaround"}

    def refine(self, job):
        from accel_opt.precision.adaround import round_weights

        settings = job.settings
        if settings.weight_rounding != "adaround":
            return None
        return round_weights(job.float_path, job.staged, job.samples, settings.reduce_range,
                             settings.adaround_iterations, settings.adaround_time_budget_s,
                             job.learned(job.rounding_key, "rounding"))

    def cost_s(self, calibration, size):
        return self.seconds_per_gflop_sample * size.gflop_samples * calibration.adaround_iterations / 300


class WeightFit(_NeedsTorch):
    """Quantization-aware distillation (output_fit.py): the int8 weights and every bias trained together, the
    rounding in the loop (straight through), against the float model's outputs on the calibration samples, a quarter
    held back to keep the best checkpoint; what ships is the same Q/DQ graph with other integers."""

    name, keys, budget_key = "weight fit (distillation)", ("weight_fit", "bias_fit"), "weight_fit_time_budget_s"
    seconds_per_gflop_step_sample, refine_order = 0.16, 3  # Lite0: 600 steps of 8 in 595 s
    # Its ~100x more numbers than the biases overfit few samples: on EfficientNet-Lite0 the held-back error never went
    # below the graph's on 48 calibration crops, and fell to 0.69x on 384. Offered from 256: on the tests' spiky CNN
    # (64 samples) a fit learned on the all-int8 graph, reused by every build restoring a layer, left the unit that
    # rescues it unmeasurable, and the fitted build failed its held-out gain.
    min_calibration_samples = 256

    def offered(self, calibration, backend):
        if calibration.weight_fit:
            return None
        return self.name, {KEY + "weight_fit": True}

    def refine(self, job):
        """The bias fit, or the weight fit (which trains the biases too: one fit)."""
        from accel_opt.precision.output_fit import fit_file
        from accel_opt.precision.qdq_weights import int8_weight_range

        settings = job.settings
        if not (settings.bias_fit or settings.weight_fit):
            return None
        weights = settings.weight_fit
        steps, budget_s = ((settings.weight_fit_steps, settings.weight_fit_time_budget_s) if weights else
                           (settings.bias_fit_steps, settings.bias_fit_time_budget_s))
        return fit_file(job.float_path, job.staged, job.samples, steps, budget_s, job.learned(job.fit_key, "fit"),
                        weights=weights, weight_range=int8_weight_range(settings.reduce_range))

    def cost_s(self, calibration, size):
        from accel_opt.precision.output_fit import BATCH

        return self.seconds_per_gflop_step_sample * max(size.gflops, 1e-3) * calibration.weight_fit_steps * BATCH


class _Nncf(_Remedy):
    """NNCF's post-training quantization of the OpenVINO model (full bias correction), with `algorithms` on: a whole
    quantizer, whose keys reset every key of the remedies above, so the search tries it instead of them. Offered on
    the OpenVINO backend where the recipe keeps the defaults of what NNCF replaces beyond those."""

    keys = ("quantizer", "smooth_quant", "channel_alignment")
    replaces_quantizer, seconds_per_gflop_sample = True, 0.2
    algorithms: tuple[str, ...] = ()

    def offered(self, calibration, backend):
        from accel_opt.recipe.stages import NNCF_REPLACES

        if backend != "openvino" or any(getattr(calibration, key) != default for key, default in NNCF_REPLACES.items()
                                        if key not in REMEDY_KEYS):
            return None
        resets = {KEY + key: getattr(default, "value", default) for key, default in NNCF_REPLACES.items()
                  if key in REMEDY_KEYS}
        return self.name, {KEY + "quantizer": "nncf", **resets, **{KEY + key: True for key in self.algorithms}}

    def unavailable(self, fused_preprocessing: bool) -> str | None:
        from accel_opt.precision.nncf_openvino import missing

        if fused_preprocessing:
            return ("the recipe fuses the preprocessing into the ONNX graph (preprocessing.fused), and NNCF's OpenVINO "
                    "IR is not one")
        return missing()


class NncfOpenVino(_Nncf):
    name = "NNCF on OpenVINO"


class NncfSmoothQuant(_Nncf):
    name, algorithms = "NNCF on OpenVINO + SmoothQuant", ("smooth_quant",)


class NncfChannelAlignment(_Nncf):
    name, algorithms = "NNCF on OpenVINO + ChannelAlignment", ("channel_alignment",)


# The registry, in the order the remedies are tried where their estimates tie.
REMEDIES: tuple[Remedy, ...] = (
    BiasCorrection(), PercentileCalibration(), EntropyCalibration(), MovingAverageCalibration(), WeightGranularity(),
    ExplicitActivations(), AdaRound(), WeightFit(), NncfOpenVino(), NncfSmoothQuant(), NncfChannelAlignment())
# The calibration keys the remedies on top of the recipe's quantizer set: NNCF's quantizer resets them (and the recipe's
# other NNCF_REPLACES keys, which no remedy changes, must keep their defaults for NNCF to be offered).
REMEDY_KEYS = tuple(dict.fromkeys(key for r in REMEDIES if not r.replaces_quantizer for key in r.keys))


def refine(job: Refining) -> list[str]:
    """Apply the remedies `job.settings` turns on to the Q/DQ graph at `job.staged`, in place, each building on the
    ones before (AdaRound's rounding, bias correction, the fits); a line per remedy for the build's notes."""
    refiners = sorted((r for r in REMEDIES if r.refine_order is not None), key=lambda r: r.refine_order)
    return [note for remedy in refiners if (note := remedy.refine(job)) is not None]


def plan(calibration: CalibrationConfig, backend_name: str = "onnxruntime", fused_preprocessing: bool = False,
         size: ModelSize | None = None) -> tuple[Planned, ...]:
    """The remedies an int8 search tries on top of the recipe's `calibration`, cheapest first by their estimates for a
    model of `size` (registry order without one, or where they tie). None where the recipe quantizes with NNCF: its
    own presets, whose keys the remedies would set."""
    if calibration.quantizer == "nncf":
        return ()
    size = size or ModelSize(gflops=1.0, calibration_samples=calibration.samples)
    planned = []
    for remedy in REMEDIES:
        offer = remedy.offered(calibration, backend_name)
        if offer is None or size.calibration_samples < getattr(remedy, "min_calibration_samples", 0):
            continue
        name, overrides = offer
        budget_key = KEY + remedy.budget_key if remedy.budget_key else None
        planned.append(Planned(name, overrides, remedy.unavailable(fused_preprocessing),
                               round(remedy.cost_s(calibration, size), 1), budget_key,
                               getattr(calibration, remedy.budget_key) if remedy.budget_key else None))
    return tuple(sorted(planned, key=lambda p: p.estimate_s))  # stable: ties keep the registry's order


def _preset_keeps_activations(calibration: CalibrationConfig, backend_name: str) -> bool:
    from accel_opt.errors import Unsupported
    from accel_opt.precision.int8_presets import resolve_preset

    try:
        return resolve_preset(calibration.target, backend_name).keep_removable_activations
    except Unsupported:  # no preset for this backend: its build says so
        return True
