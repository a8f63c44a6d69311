"""`--backend auto` / `--precision auto`: build every (backend, precision) pair that makes sense on
this machine, keep those that pass the gate, pick the fastest at the recipe's target batch within
its latency budget, and report every candidate with why it won or lost.

Each candidate is an ordinary build (its own signed artifact folder); int8 candidates on different
CPU backends share one calibration through the content-keyed cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from optimizer import artifacts, report
from optimizer.backends.select import auto_backend, candidate_precisions
from optimizer.errors import AccelOptError
from optimizer.pipeline import BuildResult, StageResult, build
from optimizer.recipe import BackendName, Precision, Recipe

log = logging.getLogger(__name__)
AUTO = "auto"


class Candidate(BaseModel):
    backend: str
    precision: str
    why_tried: str
    signed_off: bool = False
    latency_p50_ms: float | None = None  # at the target batch
    throughput_per_s: float | None = None
    cosine: float | None = None  # worst output cosine vs the fp32 reference
    artifact_dir: str | None = None
    verdict: str = ""  # why it won or lost


class AutoSelection(BaseModel):
    target_batch_size: int
    latency_budget_ms: float | None
    backend_reason: str
    winner: Candidate | None
    candidates: list[Candidate]


def plan(recipe: Recipe, backend: str, precision: str, has_data: bool) -> tuple[list[tuple[str, str, str]], str]:
    """The (backend, precision, why) pairs to build, and the reason for the backend choice."""
    if backend == AUTO:
        chosen, backend_reason = auto_backend()
        backends = [chosen] + ([BackendName.onnxruntime] if chosen is not BackendName.onnxruntime else [])
    else:
        backends, backend_reason = [BackendName(backend)], "given on the command line or in the recipe"
    pairs = []
    for b in backends:
        options = candidate_precisions(b) if precision == AUTO else [(Precision(precision), "given")]
        for p, why in options:
            if p is Precision.int8 and not has_data:
                log.warning("skipping int8 on %s: calibration needs --data", b.value)
                continue
            pairs.append((b.value, p.value, why))
    return pairs, backend_reason


def build_auto(
    model: str | Path,
    recipe: Recipe,
    backend: str,
    precision: str,
    data_dir: str | Path | None,
    out_dir: str | Path = "artifacts",
    on_candidate: Callable[[Candidate], None] | None = None,
    on_stage: Callable[[StageResult], None] | None = None,
) -> tuple[BuildResult | None, AutoSelection]:
    """Build the candidates and return (the winner's BuildResult or None, the selection report)."""
    pairs, backend_reason = plan(recipe, backend, precision, data_dir is not None)
    target = recipe.selection.target_batch_size
    budget = recipe.selection.latency_budget_ms
    results: dict[tuple[str, str], BuildResult] = {}
    candidates: list[Candidate] = []
    for b, p, why in pairs:
        candidate = Candidate(backend=b, precision=p, why_tried=why)
        try:
            result = build(model, recipe.with_overrides(backend=b, precision=p), data_dir=data_dir, out_dir=out_dir,
                           on_stage=on_stage)
        except AccelOptError as exc:
            if exc.exit_code in (2, 3):  # the model or the data is wrong: no candidate will do better
                raise
            candidate.verdict = f"could not build (exit {exc.exit_code}): {exc}"
        else:
            results[(b, p)] = result
            at_target = next((h for h in result.headline if h.batch_size == target), result.headline[-1])
            candidate.signed_off = result.signed_off
            candidate.latency_p50_ms = at_target.latency_p50_ms
            candidate.throughput_per_s = at_target.throughput_per_s
            candidate.cosine = result.worst_cosine
            candidate.artifact_dir = result.artifact_dir
            if not result.signed_off:
                candidate.verdict = "failed the gate: " + "; ".join(result.failures)
            elif budget is not None and at_target.latency_p50_ms > budget:
                candidate.verdict = f"p50 {at_target.latency_p50_ms:.2f} ms over the {budget} ms budget"
        candidates.append(candidate)
        if on_candidate:
            on_candidate(candidate)

    eligible = [c for c in candidates if c.signed_off and not c.verdict]
    winner = min(eligible, key=lambda c: c.latency_p50_ms, default=None)
    for c in eligible:
        if c is winner:
            c.verdict = f"won: fastest signed-off candidate at batch {target}"
        else:
            c.verdict = f"lost: {c.latency_p50_ms / winner.latency_p50_ms:.2f}x the winner's p50 at batch {target}"
    selection = AutoSelection(target_batch_size=target, latency_budget_ms=budget, backend_reason=backend_reason,
                              winner=winner, candidates=candidates)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = Path(model).stem
    artifacts.write_json(out / f"{stem}-auto-selection.json", selection)
    artifacts.write_text(out / f"{stem}-auto-selection.md", report.selection_markdown(stem, selection))
    return (results[(winner.backend, winner.precision)] if winner else None), selection
