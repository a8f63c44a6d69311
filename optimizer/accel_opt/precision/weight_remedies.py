"""What changes a Q/DQ graph's integers after the quantizer placed them, in the order each builds on the one before:
AdaRound (each layer's weights rounded to fit that layer's float output), bias correction (each bias absorbs its
rounded weights' mean shift), the bias fit (every bias trained together to the float model's outputs) or the weight fit
(every bias and int8 weight)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from accel_opt.data import Sample
from accel_opt.precision.adaround import round_weights
from accel_opt.precision.bias_correction import correct_biases
from accel_opt.precision.output_fit import fit_file
from accel_opt.precision.qdq_weights import int8_weight_range

if TYPE_CHECKING:
    from accel_opt.precision.int8 import QuantSettings


def refine(float_path: Path, staged: Path, samples: list[Sample], settings: QuantSettings, cache_dir: Path | None,
           rounding_key: str, fit_key: str, own_key: str | None = None) -> list[str]:
    """Apply the remedies `settings` turns on to the Q/DQ graph at `staged`, in place; what AdaRound and the fits learn
    is kept in `cache_dir` (see _learned). `own_key`: this graph's own key where it keeps layers in float, else None.
    Returns a line per remedy for the build's notes."""
    notes = []
    if settings.weight_rounding == "adaround":
        learned = _learned(cache_dir, rounding_key, own_key, "rounding")
        notes.append(round_weights(float_path, staged, samples, settings.reduce_range, settings.adaround_iterations,
                                   settings.adaround_time_budget_s, learned))
    if settings.bias_correction:
        notes.append(correct_biases(float_path, staged, samples))
    if settings.bias_fit or settings.weight_fit:  # the weight fit trains the biases too: one fit
        fitted = _learned(cache_dir, fit_key, own_key, "fit")
        weights = settings.weight_fit
        steps, budget_s = ((settings.weight_fit_steps, settings.weight_fit_time_budget_s) if weights else
                           (settings.bias_fit_steps, settings.bias_fit_time_budget_s))
        notes.append(fit_file(float_path, staged, samples, steps, budget_s, fitted, weights=weights,
                              weight_range=int8_weight_range(settings.reduce_range)))
    return notes


def _learned(cache_dir: Path | None, whole_graph_key: str, own_key: str | None, kind: str) -> Path | None:
    """Where what a remedy learns is read and kept. Learned on the graph with every layer quantized, it is kept under
    `whole_graph_key` and reused by the builds that keep layers in float (the rescue search makes many, after that
    graph). A build that keeps layers in float and finds none learns on its own graph, and keeps that under its
    `own_key`: each layer's rounding or fit there answers the float layers it was learned beside, so reused by the
    whole graph it made every one of EfficientNet-Lite0's layers worse (logit RMS error 0.079 -> 0.095)."""
    if cache_dir is None:
        return None
    whole_graph = Path(cache_dir) / f"{whole_graph_key}.{kind}.npz"
    if own_key is None or whole_graph.is_file():
        return whole_graph
    return Path(cache_dir) / f"{own_key}.{kind}.npz"
