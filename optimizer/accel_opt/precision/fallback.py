"""Accuracy-driven fallback: rescue a reduced-precision build that fails its steering samples, or say measured why not.

The naive build is judged on steering samples with the recipe's tolerance and task metrics (the gate's own rules).
When it fails, the search in precision/search.py takes over: it times the naive build against fp32 first (no rescue
can make a build pay that is not faster to begin with), tries whole-graph remedies for int8 (bias correction, other
activation calibrations), measures what restoring each group of same-shaped layers to float gains, adds them in that
order while the build stays `min_speedup` faster than fp32, and drops what did not help, within a wall-clock budget.
For fp16 every node whose fp32 activations exceed `fp16_activation_max` on a steering sample (and every consumer of a
weight beyond 65504) is kept in fp32 before the first build is judged, so a GPU build inherits it. The per-layer
diagnosis (precision/diagnose.py) still ranks the layers for the report and chooses which groups to measure when there
are too many.

The orchestration takes its actions as callables (build, judge, diagnose, speedup), so the pipeline chooses the
backend that judges and this module stays testable on its own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
from onnx import numpy_helper
from pydantic import BaseModel

from accel_opt.errors import CandidateDropped, Unsupported, first_line
from accel_opt.precision.callbacks import Actions, SearchActions, SearchLimits
from accel_opt.precision.diagnose import Diagnosis
from accel_opt.precision.report import KeptNode, PrecisionReport
from accel_opt.precision.search import Build, SearchStep, Unit, search, tail_units
from accel_opt.recipe.gate import Tolerance
from accel_opt.recipe.stages import FallbackConfig
from accel_opt.recipe.types import Precision

FP16_MAX = 65504.0
FLOAT_BY_DESIGN = "accel_opt.float_by_design"  # metadata key: nodes the fallback left in float on purpose
TABLE_ROWS = 10  # offenders shown before/after in the report
STEERING_MARGIN = 0.5  # the search's steering samples must pass with half the gate's numeric slack (see stricter)


class VariantVerdict(BaseModel):
    passed: bool
    worst_cosine: float
    failures: list[str]
    loss: float | None = None  # how far from passing, in units of each check's threshold (AccuracyReport.loss)
    output_loss: float | None = None  # its outputs' numeric part (AccuracyReport.output_loss)
    changed: list[str] | None = None  # the steering samples whose task outcome changed (AccuracyReport.changed_samples)


class LayerRow(BaseModel):
    """One top offender of the naive build, with its added error before and after the fallback."""

    node: str
    op_type: str
    depth: int
    added_error_naive: float
    added_error_final: float | None  # None: not compared in the final build (kept in fp32)
    kept: bool


class FallbackReport(BaseModel):
    # "kernels": the deployed kernels lose what the Q/DQ graph itself keeps (int16 saturation): no layer to blame;
    # "no speed-up": the naive build is not faster than fp32 here, so no rescue can pay; "time budget": it ran out;
    # "insufficient evidence": the held-out samples are too few to certify any build, so nothing was searched;
    # "cannot win" (auto): even fully rescued the build would not beat a candidate already signed off
    status: Literal["disabled", "not needed", "rescued", "budget exhausted", "kernels", "no speed-up", "time budget",
                    "insufficient evidence", "cannot win"]
    reason: str
    precision: str
    steering_samples: int
    steering_source: str
    steering_slack: float = 1.0  # the fraction of the gate's slack the steering samples may use
    max_rounds: int
    max_fp32_flops_fraction: float
    naive: VariantVerdict | None = None
    kept: list[KeptNode] = []  # chosen by the fallback (the recipe's block lists are in the precision report)
    fp32_flops_fraction: float = 0.0
    layers: list[LayerRow] = []
    naive_profile: list[tuple[int, float]] = []  # (depth, error) per compared tensor
    final_profile: list[tuple[int, float]] = []
    naive_model: str = ""  # the naive build's file in the work folder (benchmarked beside the chosen one)
    steps: list[SearchStep] = []  # every build, measurement and decision of the search, in order
    remedies: list[str] = []  # the whole-graph remedies the search adopted (bias correction, another calibration)
    search_seconds: float = 0.0
    time_budget_s: float = 0.0
    min_speedup: float = 0.0


def run(precision: Precision, config: FallbackConfig, actions: Actions, out_path: Path, steering_samples: int,
        steering_source: str, fixed: Sequence[KeptNode] = (), limits: SearchLimits | None = None,
        ) -> tuple[PrecisionReport, FallbackReport, Path]:
    """Build `precision` (keeping `fixed` in fp32), rescued by the fallback when the steering samples fail; returns the
    chosen build's report, the fallback's and its path (beside `out_path`; `out_path` itself when disabled).
    `limits` (SearchLimits: builder.context.CandidateLimits): a candidate of --precision auto: its share of the time
    budget replaces the recipe's, and a build that no rescue can make sign off or win is dropped (CandidateDropped)
    before its search."""
    if limits is not None:
        config = config.model_copy(update={"time_budget_s": max(limits.search_budget_s, 0.0)})
    report = FallbackReport(status="disabled", reason="", precision=precision.value, steering_samples=steering_samples,
                            steering_source=steering_source, max_rounds=config.max_rounds,
                            max_fp32_flops_fraction=config.max_fp32_flops_fraction, time_budget_s=config.time_budget_s,
                            min_speedup=config.min_speedup)
    kept: dict[str, KeptNode] = {k.node: k for k in fixed}
    if not config.enabled:
        report.reason = "turned off (--no-fallback or the recipe's precision_options.fallback.enabled)"
        return actions.build(list(kept), out_path, None), report, actions.written(out_path, None)
    primaries: set[str] = set()  # nodes kept for the error they add (not as a consequence of another)
    naive_path = actions.written(out_path.with_name(f"naive-{out_path.name}"), None)
    precision_report = _build_with_companions(actions, kept, primaries, naive_path, 0, config)
    graph = naive_path if is_onnx(naive_path) or actions.structure is None else actions.structure
    actions.flops, groups = actions.flops_of(graph), layer_groups(graph)
    total_flops = max(sum(actions.flops.values()), 1)

    def fraction() -> float:
        return sum(actions.flops.get(n, 0) for n in kept) / total_flops
    report.naive_model = naive_path.name
    diagnosis = actions.diagnose(naive_path) if precision is Precision.fp16 else None
    if diagnosis is not None:  # float16 overflow: certain on a GPU, whatever the CPU run says
        for layer in diagnosis.layers:
            if layer.max_abs_reference > config.fp16_activation_max and layer.node not in kept:
                kept[layer.node] = KeptNode(node=layer.node, op_type=layer.op_type, reason=(
                    f"fp16 overflow risk: fp32 activations reach {layer.max_abs_reference:.4g} on the steering samples "
                    f"(> {config.fp16_activation_max:g}; float16 max {FP16_MAX:g})"))
        if len(kept) > len(fixed):
            precision_report = _build_with_companions(actions, kept, primaries, naive_path, 0, config)
            diagnosis = None
    report.naive = verdict = actions.judge(naive_path)
    current = naive_path
    if verdict.passed:
        report.status, report.reason = "not needed", "the build passes the recipe's tolerance on the steering samples"
    elif (actions.judge_emulated is not None and is_onnx(naive_path)
          and (emulated := actions.judge_emulated(naive_path)).passed):
        report.status, report.reason = "kernels", (
            f"the deployed kernels fail what the graph itself passes (steering worst cosine {verdict.worst_cosine:.4f} "
            "as "
            f"deployed, {emulated.worst_cosine:.4f} with Q/DQ emulated in float): the per-layer diagnosis cannot see "
            "it, so no layer is kept in fp32. On a CPU without VNNI the int8 kernels saturate: build with 7-bit "
            "weights (--target-cpu, or precision_options.calibration.reduce_range: true) or on another backend")
    else:
        naive_diagnosis = diagnosis or actions.diagnose(naive_path)
        current, precision_report = _search(precision, config, actions, report, kept, primaries, naive_path, out_path,
                                            verdict, groups, naive_diagnosis, total_flops, precision_report, limits)
        if naive_diagnosis is not None:
            final_diagnosis = actions.diagnose(current) if current != naive_path else naive_diagnosis
            report.layers = _rows(naive_diagnosis, final_diagnosis, kept)
            report.naive_profile = naive_diagnosis.profile()
            report.final_profile = final_diagnosis.profile() if final_diagnosis else []
    report.kept = list(kept.values())
    report.fp32_flops_fraction = fraction()
    precision_report.kept_in_higher_precision = _merged(precision_report.kept_in_higher_precision, list(kept.values()))
    return precision_report, report, current


def _search(precision: Precision, config: FallbackConfig, actions: Actions, report: FallbackReport,
            kept: dict[str, KeptNode], primaries: set[str], naive_path: Path, out_path: Path, verdict: VariantVerdict,
            groups: dict[str, str], diagnosis: Diagnosis | None, total_flops: int,
            precision_report: PrecisionReport, limits: SearchLimits | None = None) -> tuple[Path, PrecisionReport]:
    """The measured search (precision/search.py) from the failing naive build; fills `report` and `kept`, returns the
    chosen build and its precision report. With `limits` (auto), a hopeless build raises CandidateDropped instead."""
    fixed = dict(kept)
    reports: dict[Path, PrecisionReport] = {naive_path: precision_report}

    def build_and_judge(keep: list[str], path: Path, overrides: dict | None) -> Build:
        path = actions.written(out_path.with_name(f"{path.stem}-{out_path.name}"), overrides)
        trial = {**fixed, **{n: KeptNode(node=n, op_type=groups.get(n, "").split(" ")[0], reason="") for n in keep}}
        try:
            reports[path] = _build_with_companions(actions, trial, primaries | set(keep), path, 1, config, overrides)
        except Unsupported as exc:  # the converter cannot write this mix (float16: a kept If/Loop body)
            return Build(path=path, loss=math.inf, passed=False, failures=[f"could not be built: {first_line(exc)}"],
                         worst_cosine=0.0)
        judged = actions.judge(path)
        return _build(path, judged)

    units_by_key: dict[str, list[str]] = {}
    for node, key in groups.items():
        if node not in kept:
            units_by_key.setdefault(key, []).append(node)
    added = {layer.node: layer.added_error for layer in diagnosis.layers} if diagnosis is not None else {}
    units = [Unit(key=key, nodes=nodes, flops=sum(actions.flops.get(n, 0) for n in nodes),
                  added_error=sum(max(added.get(n, 0.0), 0.0) for n in nodes)) for key, nodes in units_by_key.items()]
    # Every unit is measured when they are few; otherwise those the diagnosis blames most (the ranking is checked,
    # not trusted: what is kept is what the measurement shows).
    units = sorted(units, key=lambda u: (-u.added_error, -u.flops))
    if limits is not None and diagnosis is not None:
        why = hopeless(verdict.loss, units, diagnosis, config.max_rounds)
        if why:
            raise CandidateDropped(why)
    tails = tail_units([n for n in groups if n not in kept], config.tail_layers, actions.flops)
    units = (tails + units)[: config.max_measured_units]
    naive = _build(naive_path, verdict)
    started = time.monotonic()
    found = search(naive, units, SearchActions(build_and_judge=build_and_judge, speedup=actions.speedup),
                   out_path.parent, time_budget_s=config.time_budget_s, min_speedup=config.min_speedup,
                   max_additions=config.max_rounds, remedies=actions.remedies,
                   max_flops_fraction=config.max_fp32_flops_fraction, total_flops=total_flops,
                   cannot_win=limits.cannot_win if limits is not None else None,
                   on_step=limits.on_step if limits is not None else None)
    if found.status == "cannot win":
        raise CandidateDropped(found.reason)
    report.search_seconds = round(time.monotonic() - started, 1)
    report.status, report.reason = found.status, found.reason
    report.steps, report.remedies = found.steps, list(found.remedies)
    for unit in reversed(found.kept_units):  # a node in two kept units: the reason of the first kept
        gain = found.gains.get(unit.label)
        for node in unit.nodes:
            kept[node] = KeptNode(node=node, op_type=groups.get(node, "").split(" ")[0], reason=(
                f"restoring {unit.label} to float took {gain:.3g} off the steering samples' loss (measured)"
                if gain is not None else "restored by the search"))
    chosen = found.best.path
    return chosen, reports.get(chosen, precision_report)


def _build(path: Path, judged: VariantVerdict) -> Build:
    """A build as the search sees it: its path and its verdict on the steering samples."""
    return Build(path=path, loss=judged.loss if judged.loss is not None else (0.0 if judged.passed else math.inf),
                 passed=judged.passed, failures=judged.failures, worst_cosine=judged.worst_cosine,
                 output_loss=judged.output_loss,
                 changed=frozenset(judged.changed) if judged.changed is not None else None)


# A build is hopeless when, even if restoring the `max_rounds` groups of layers the per-layer diagnosis blames most
# removed all the error they add, the steering samples' loss would stay this many times the gate's limit. A loss alone
# does not
# tell: int8 that collapsed on one tensor (worst cosine < 0.5, loss > 50: the test suite's spiky CNN) put ~all its
# added error in one group and was rescued by restoring it, while a document-layout detector's int8 (cosine 0.73-0.82
# against 0.99, loss 18-27, on an AVX-512 VNNI EPYC) was searched for minutes per candidate and rescued nothing.
HOPELESS_REMAINING_LOSS = 3.0


def hopeless(loss: float | None, units: Sequence, diagnosis: Diagnosis, rounds: int) -> str | None:
    """Why no rescue of a naive build with this steering `loss` can pass, judged before any search (None: it may).
    `units` are ranked by the error their layers add (search.Unit, worst first)."""
    total = sum(max(layer.added_error, 0.0) for layer in diagnosis.layers)
    if loss is None or not math.isfinite(loss) or loss <= HOPELESS_REMAINING_LOSS or total <= 0:
        return None
    share = min(1.0, sum(u.added_error for u in units[:rounds]) / total)
    left = loss * (1 - share)
    if left <= HOPELESS_REMAINING_LOSS:
        return None
    return (f"its steering samples' loss is {loss:.3g}x the gate's limit and the {min(rounds, len(units))} layer "
            "groups the "
            f"diagnosis blames most add only {share:.0%} of the error: restoring them all would still leave about "
            f"{left:.3g}x the limit, far outside what a rescue has recovered (a rescued collapse put ~all its error in "
            "one group)")


def stricter(tolerance: Tolerance, factor: float = STEERING_MARGIN) -> Tolerance:
    """The gate's numeric limits with `factor` of their slack: the search keeps, of many variants, the one that does
    best on its steering samples, so it must pass them with a margin for the held-out ones to pass too (YOLOv8n,
    judged in-sample: steering samples passed, the gate's recall was 0.87). Rates are aimed by
    accuracy.metrics.aimed_gate."""
    return tolerance.model_copy(update={
        "max_error": tolerance.max_error * factor, "max_sample_error": tolerance.max_sample_error * factor,
        "min_cosine": 1 - (1 - tolerance.min_cosine) * factor,
        "min_sample_cosine": 1 - (1 - tolerance.min_sample_cosine) * factor,
        "max_gain_error": tolerance.max_gain_error * factor,
        "min_agreement": 1 - (1 - tolerance.min_agreement) * factor})


def _build_with_companions(actions: Actions, kept: dict[str, KeptNode], primaries: set[str], path: Path,
                           number: int, config: FallbackConfig, overrides: dict | None = None) -> PrecisionReport:
    """Build with `kept` in fp32, and with the nodes whose output still reaches them through a Q/DQ pair
    (see `requantized_sources`). Nodes the backend then runs in float anyway (Actions.companions) are not
    excluded, since excluding them would make their producers float in turn, up the whole graph: they are
    recorded in the model's metadata (FLOAT_BY_DESIGN) for the backend's int8-kernel check, and reported."""
    report = actions.build(list(kept), path, overrides)
    if not is_onnx(path):  # NNCF's IR: its own placement decides what feeds a kept layer, and no metadata records it
        return report
    budget = config.max_fp32_flops_fraction * max(sum(actions.flops.values()), 1)
    extra = []
    for name in requantized_sources(path, primaries):  # within the FLOPs budget, like the picks
        used = sum(actions.flops.get(n, 0) for n in [*kept, *extra])
        if name not in kept and name not in extra and (not actions.flops.get(name) or used
                                                       + actions.flops[name] <= budget):
            extra.append(name)
    op_types = {n.name: n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}
    if extra:  # one level only: the node computing a damaging input; its own inputs may stay quantized
        for name in extra:
            kept[name] = KeptNode(node=name, op_type=op_types.get(name, ""), reason=(
                f"fallback round {number}: its output reached a node kept in fp32 through a Q/DQ pair"))
        report = actions.build(list(kept), path, overrides)
    floating = [n for n in (actions.companions(path) if actions.companions else []) if n not in kept]
    why = ("the backend has no integer kernel for it in this graph: it runs in float on dequantized inputs"
           if not number
           else f"fallback round {number}: runs in float on the backend once its neighbours are kept in fp32")
    report.kept_in_higher_precision += [KeptNode(node=n, op_type=op_types.get(n, ""), reason=why) for n in floating]
    if kept or floating:  # read by ONNX Runtime's int8-kernel check; nothing to record otherwise
        mark_float_by_design(path, [*kept, *floating])
    return report


def is_onnx(path: Path) -> bool:
    """Whether a build is an ONNX graph (the others: NNCF's OpenVINO IR, which no ONNX tool reads)."""
    return Path(path).suffix == ".onnx"


def mark_float_by_design(model_path: Path, nodes: list[str]) -> None:
    """Record in the model which nodes were left in float on purpose (ONNX metadata_props)."""
    model = onnx.load(str(model_path), load_external_data=False)
    entries = [p for p in model.metadata_props if p.key != FLOAT_BY_DESIGN]
    del model.metadata_props[:]
    model.metadata_props.extend(entries)
    model.metadata_props.add(key=FLOAT_BY_DESIGN, value=",".join(nodes))
    onnx.save(model, str(model_path))  # external data references are relative: the files stay where they are


def float_by_design(model: onnx.ModelProto) -> set[str]:
    return {n for p in model.metadata_props if p.key == FLOAT_BY_DESIGN for n in p.value.split(",") if n}


def requantized_sources(model_path: Path, kept: set[str]) -> list[str]:
    """Nodes whose output reaches a node of `kept` through a QuantizeLinear -> DequantizeLinear pair.

    ORT's quantizer quantizes a quantized op's output (a Mul's, an Add's) whatever reads it, so a node
    kept in float would still read int8-rounded values: the error it was kept for stays unless the
    node computing that input is kept in float too."""
    graph = onnx.load(str(model_path), load_external_data=False).graph
    producers = {o: n for n in graph.node for o in n.output if o}
    sources = []
    for node in graph.node:
        if node.name not in kept:
            continue
        for name in node.input:
            dq = producers.get(name)
            q = producers.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
            source = producers.get(q.input[0]) if q is not None and q.op_type == "QuantizeLinear" else None
            while source is not None and source.op_type in ("Cast", "QuantizeLinear", "DequantizeLinear"):
                source = producers.get(source.input[0])
            if source is not None and source.name and source.name not in kept:
                sources.append(source.name)
    return sources


def layer_groups(model_path: Path) -> dict[str, str]:
    """Conv/MatMul/Gemm node -> "op weight-shape" (weights read directly or through a DequantizeLinear)."""
    graph = onnx.load(str(model_path), load_external_data=False).graph
    dims = {t.name: tuple(t.dims) for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    groups = {}
    for node in graph.node:
        if node.op_type not in ("Conv", "ConvTranspose", "MatMul", "Gemm") or len(node.input) < 2 or not node.name:
            continue
        weight = node.input[1]
        source = producers.get(weight)
        if source is not None and source.op_type in ("DequantizeLinear", "Cast"):
            weight = source.input[0]
        if weight in dims:
            groups[node.name] = f"{node.op_type} {'x'.join(map(str, dims[weight]))}"
    return groups


def _rows(naive: Diagnosis, final: Diagnosis | None, kept: dict[str, KeptNode]) -> list[LayerRow]:
    after = {e.node: e.added_error for e in final.layers} if final else {}
    rows, seen = [], set()
    for layer in naive.ranked():
        if layer.node in seen:
            continue
        seen.add(layer.node)
        rows.append(LayerRow(node=layer.node, op_type=layer.op_type, depth=layer.depth,
                             added_error_naive=layer.added_error,
                             added_error_final=after.get(layer.node), kept=layer.node in kept))
        if len(rows) == TABLE_ROWS:
            break
    return rows


def _merged(reported: list[KeptNode], chosen: list[KeptNode]) -> list[KeptNode]:
    """The transform's kept list with the fallback's reasons for the nodes it chose."""
    reasons = {k.node: k for k in chosen}
    merged = [reasons.pop(k.node, k) for k in reported]
    return merged + list(reasons.values())


def wide_weight_consumers(model_path: Path) -> list[KeptNode]:
    """Nodes reading a weight beyond float16's range: converting it would clamp it to 65504."""
    model = onnx.load(str(model_path))
    wide = {t.name for t in model.graph.initializer
            if t.data_type == onnx.TensorProto.FLOAT
            and float(np.abs(numpy_helper.to_array(t)).max(initial=0)) > FP16_MAX}
    return [KeptNode(node=n.name, op_type=n.op_type, reason="reads a weight beyond float16's range (65504)")
            for n in model.graph.node if n.name and any(i in wide for i in n.input)]
