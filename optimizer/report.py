"""Markdown rendered from the JSON report models (never assembled beside them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel_opt.accuracy import AccuracyReport
from accel_opt.bench import BenchmarkReport
from accel_opt.data import DataSummary
from accel_opt.precision import PrecisionReport

if TYPE_CHECKING:
    from accel_opt.auto import AutoSelection

REFERENCES = {
    "reference-fp32": "the original model in fp32 on ONNX Runtime's CPU EP, graph optimizations off",
    "reference-pytorch": "the PyTorch module in fp32, eager: export errors count too",
}


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def signoff_markdown(
    model_name: str,
    signed_off: bool,
    accuracy: AccuracyReport,
    precision: PrecisionReport | None,
    eval_data: DataSummary,
    calibration_count: int,
    notes: list[str],
) -> str:
    verdict = "SIGNED OFF" if signed_off else "NOT SIGNED OFF"
    tol = accuracy.tolerance
    out = [
        f"# Accuracy sign-off: {model_name}",
        "",
        f"**Verdict: {verdict}**",
        "",
        f"- Candidate: `{accuracy.candidate}`; reference: `{accuracy.reference}` ({REFERENCES.get(accuracy.reference, 'fp32')})",
        f"- Evaluation samples: {accuracy.sample_count} ({_data_line(eval_data)})",
    ]
    if eval_data.source == "synthetic":
        out.append("- **Synthetic data was used**: inputs were random, not real data; the numeric check holds, "
                   "task quality was not measured on real inputs.")
    if precision is not None:
        out.append(f"- Precision: {precision.precision.value} ({precision.transform})")
        if precision.calibration:
            cal = precision.calibration
            out.append(
                f"- Calibration: {cal.method}, preset {cal.preset} ({cal.preset_reason}); activations {cal.activation_type}, "
                f"weights {cal.weight_type}{' per-channel' if cal.per_channel else ''}; {cal.sample_count} calibration samples, "
                f"disjoint from the {accuracy.sample_count} evaluation samples (calibration cache {'hit' if cal.cache_hit else 'miss'})"
            )
    elif calibration_count:
        out.append(f"- Calibration samples: {calibration_count}")
    out.append(
        f"- Tolerance: atol {tol.atol:g}, rtol {tol.rtol:g} on the {tol.error_stat} error "
        f"(an element passes within atol or rtol), cosine >= {tol.min_cosine}, no NaN/Inf"
    )
    out += ["", "## Outputs", ""]
    out.append(
        _table(
            ["output", "max abs", "mean abs", "max rel", "mean rel", "cosine", "NaN/Inf", "verdict"],
            [
                [o.name, f"{o.max_abs_error:.3g}", f"{o.mean_abs_error:.3g}", f"{o.max_rel_error:.3g}",
                 f"{o.mean_rel_error:.3g}", f"{o.cosine:.6f}", str(o.non_finite_count), "pass" if o.passed else "FAIL"]
                for o in accuracy.outputs
            ],
        )
    )
    if accuracy.task_metrics:
        out += ["", "## Task metrics", ""]
        out.append(
            _table(
                ["metric", "output", "value", "minimum", "verdict"],
                [[f"{m.kind}:{k}", m.output, f"{m.values[k]:.4f}", f"{v}", "pass" if m.values[k] >= v else "FAIL"]
                 for m in accuracy.task_metrics for k, v in m.thresholds.items()],
            )
        )
        metric_notes = [f"- {m.kind}: {m.note}" for m in accuracy.task_metrics if m.note]
        out += [""] + metric_notes if metric_notes else []
    if precision is not None and precision.kept_in_higher_precision:
        out += ["", "## Kept in higher precision", ""]
        out.append(_table(["node", "op", "why"], [[k.node, k.op_type, k.reason] for k in precision.kept_in_higher_precision]))
    if accuracy.failures:
        out += ["", "## Failed checks", ""] + [f"- {f}" for f in accuracy.failures]
    if notes:
        out += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def _data_line(data: DataSummary) -> str:
    if data.source == "synthetic":
        return f"synthetic, seed {data.seed}"
    return f"{data.source} from {data.path}"


def benchmark_markdown(model_name: str, bench: BenchmarkReport) -> str:
    out = [
        f"# Benchmark: {model_name}",
        "",
        f"Threads: {bench.threads}. Each latency is wall time around the whole inference call"
        f"{' followed by device synchronization' if bench.synchronized else ''}; models measured in interleaved rounds in one run.",
        "",
    ]
    rows = []
    for m in bench.models:
        for b in m.batches:
            lat = b.latency
            rows.append([m.label, str(b.batch_size), f"{lat.p50_ms:.2f}", f"{lat.p90_ms:.2f}", f"{lat.p99_ms:.2f}",
                         f"{lat.mean_ms:.2f}", f"{b.throughput_per_s:.1f}", f"{b.input_prep_ms:.2f}", str(lat.iterations)])
    out.append(_table(["model", "batch", "p50 ms", "p90 ms", "p99 ms", "mean ms", "samples/s", "input prep ms", "iterations"], rows))
    out += ["", _table(
        ["model", "session load ms", "peak RSS MiB", "model memory MiB"],
        [[m.label, f"{m.session_load_ms:.1f}", f"{m.peak_rss_mib:.0f}", f"{m.model_memory_mib:.0f}"] for m in bench.models],
    )]
    if bench.concurrency:
        out += ["", "Concurrency sweep (one async request in flight per stream):", ""]
        out.append(_table(["hint", "threads", "streams", "batch", "samples/s", "p50 ms", "p99 ms"],
                          [[r["hint"], str(r["threads"]), str(r["streams"]), str(r["batch_size"]), f"{r['samples_per_s']:.1f}",
                            f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}"] for r in bench.concurrency]))
    for base, ratios in bench.speedup_vs_baseline.items():
        out += ["", f"Speedup of {bench.models[0].label} over {base} (p50 ratio, >1 is faster; measured, not claimed):", ""]
        out.append(_table(["batch", "speedup"], [[str(b), f"{r:.2f}x"] for b, r in ratios.items()]))
    return "\n".join(out) + "\n"


def selection_markdown(name: str, selection: AutoSelection) -> str:
    budget = f"{selection.latency_budget_ms} ms" if selection.latency_budget_ms else "none"
    out = [
        f"# Automatic choice: {name}",
        "",
        f"Target batch {selection.target_batch_size}; latency budget {budget}. Backend: {selection.backend_reason}.",
        f"Latency: {selection.timing}.",
        "",
    ]

    def fmt(value: float | None, spec: str) -> str:
        return format(value, spec) if value is not None else "-"

    out.append(_table(
        ["backend", "precision", "signed off", "p50 ms", "p50 ms in its build", "samples/s", "worst cosine", "verdict"],
        [[c.backend, c.precision, "yes" if c.signed_off else "no", fmt(c.latency_p50_ms, ".2f"),
          fmt(c.build_latency_p50_ms, ".2f"), fmt(c.throughput_per_s, ".1f"), fmt(c.cosine, ".5f"), c.verdict]
         for c in selection.candidates],
    ))
    winner = selection.winner
    out += ["", f"Winner: {winner.backend} {winner.precision} -> {winner.artifact_dir}" if winner else "No candidate passed."]
    return "\n".join(out) + "\n"
