"""Markdown rendered from the JSON report models (never assembled beside them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel_opt.accuracy import AccuracyReport
from accel_opt.accuracy.evidence import RateEvidence
from accel_opt.accuracy.labeled import labeled_markdown
from accel_opt.bench import BenchmarkReport
from accel_opt.data import DataSummary
from accel_opt.precision import PrecisionReport
from accel_opt.precision.fallback import FallbackReport
from accel_opt.recipe.stages import OBJECTIVES
from accel_opt.report.verdict import Verdict

if TYPE_CHECKING:
    from accel_opt.report.selection import AutoSelection

REFERENCES = {
    "reference-fp32": "the original model in fp32 on ONNX Runtime's CPU EP, graph optimizations off",
    "reference-pytorch": "the PyTorch module in fp32, eager: export errors count too",
}


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def number_cell(value: float | None, spec: str) -> str:
    """A measured number; null in a JSON report is a value that was not finite (an infinite gain)."""
    return "not finite" if value is None else format(value, spec)


def output_columns(error_stat: str) -> list[str]:
    return ["output", "scale", f"{error_stat} error", "worst sample error", "cosine", "worst sample cosine", "gain",
            "max abs", "NaN/Inf", "failed samples", "verdict"]


def output_cells(o: dict, sample_count: int) -> list[str]:
    """The outputs-table cells of one OutputAccuracy (as JSON), all but the verdict: sign-off markdown and
    HTML alike. An exact (integer/bool) output shows its agreement, with no distance statistics."""
    if o.get("agreement") is not None:
        return [o["name"], "exact", f"{o['error']:.3g} differ", f"{o['worst_sample_error']:.3g} differ", "-",
                "-", "-", "-",
                "0", f"agreement {o['agreement']:.2%}"]
    return [o["name"], f"{o['scale_basis']} {number_cell(o['scale'], '.4g')}", number_cell(o["error"], ".3g"),
            number_cell(o["worst_sample_error"], ".3g"), number_cell(o["cosine"], ".6f"),
            "-" if o["worst_sample_cosine"] is None else f"{o['worst_sample_cosine']:.6f}",
            number_cell(o["gain"], ".5f"),
            number_cell(o["max_abs_error"], ".3g"), str(o["non_finite_count"]),
            f"{o['failed_samples']} of {sample_count}"]


def evidence_lines(accuracy: dict, data_line: str) -> list[str]:
    """What the verdict rests on, statistically: the split into roles, how rates are judged, the steering check."""
    roles, confidence = accuracy.get("roles") or {}, accuracy.get("confidence", 0.95)
    method = accuracy.get("method", "")
    lines = [f"Samples: {accuracy['sample_count']} held out ({data_line}): they judged this verdict and nothing else; "
             f"{roles.get('calibration', 0)} calibrated the build and {roles.get('steering', 0)} steered its choices "
             "(the fallback's search, the cleanup check, auto's shortlist); no sample in two roles (each role's "
             "samples are listed in manifest.json)"]
    if accuracy.get("bounded"):
        lines.append("Rates (the share of samples within tolerance, task metrics' agreement) are judged by their "
                     "one-sided "
                     f"lower bound at {confidence:.0%} confidence ({method}) over {accuracy.get('trial_count')} "
                     "held-out "
                     f"{accuracy.get('trial_unit', 'samples')}, each one trial whatever rows it holds: the build signs "
                     "off only where every bound clears its minimum, and too few is its own verdict")
    else:
        lines.append(f"fp32: judged against the float32 noise floor on the observed rates (never refused for few "
                     f"samples); each rate's lower bound at {confidence:.0%} confidence ({method}) is shown")
    steering = accuracy.get("steering")
    if steering:
        lines.append(f"On the {steering['sample_count']} steering samples the deployed build "
                     f"{'passes' if steering['passed'] else 'fails'} the gate aimed at what the held-out samples can "
                     f"certify (loss {number_cell(steering['loss'], '.3g')}; 1 is the limit)"
                     + (f": {'; '.join(steering['failures'])}" if steering["failures"] else ""))
    return lines


TASK_COLUMNS = ["metric", "output", "observed", "lower bound", "minimum", "counted", "verdict"]


def task_rows(accuracy: dict) -> list[list[str]]:
    """The task-metrics table: each value with its lower bound and counts where it is a rate (markdown and HTML)."""
    rows = []
    for m in accuracy["task_metrics"]:
        for key, minimum in m["thresholds"].items():
            ev, value = (m.get("evidence") or {}).get(key), m["values"][key]
            verdict = ({"pass": "pass", "fail": "FAIL", "insufficient": "too few samples"}[ev["status"]] if ev
                       else "pass" if value is not None and value >= minimum else "FAIL")
            rows.append([f"{m['kind']}:{key}", m["output"], number_cell(value, ".4f"),
                         f"{ev['lower']:.4f}" if ev else "-", f"{minimum}",
                         RateEvidence.model_validate(ev).counted() if ev else "-", verdict])
    return rows


def signoff_markdown(
    model_name: str,
    verdict: Verdict,
    accuracy: AccuracyReport,
    precision: PrecisionReport | None,
    eval_data: DataSummary,
    calibration_count: int,
    notes: list[str],
    fallback: FallbackReport | None = None,
    bench: BenchmarkReport | None = None,
) -> str:
    as_json = accuracy.model_dump(mode="json")
    headline = verdict.headline(accuracy.trial_unit)
    tol, ev = accuracy.tolerance, accuracy.evaluation
    how = (f"in {ev.calls} calls of batch {ev.batch_size}, cut back into samples" if ev.mode == "batched"
           else f"one sample per call{f' ({ev.note})' if ev.note else ''}")
    out = [
        f"# Accuracy sign-off: {model_name}",
        "",
        f"**Verdict: {headline}**",
        "",
        "## What the verdict rests on",
        "",
        "- Candidate: "
        f"`{accuracy.candidate}`{f', loaded from the artifact as deployed: {ev.deployment}' if ev.deployment else ''}; "
        f"run {how}",
        f"- Reference: `{accuracy.reference}` ({REFERENCES.get(accuracy.reference, 'fp32')}), one sample per call",
        *(f"- {line}" for line in evidence_lines(as_json, _data_line(eval_data))),
    ]
    if eval_data.source == "synthetic":
        out.append("- **Synthetic data was used**: inputs were random, not real data: a numeric check only, judged on "
                   "the observed counts; no task rate was certified on real inputs.")
    if precision is not None:
        out.append(f"- Precision: {precision.precision.value} ({precision.transform})")
        if precision.calibration:
            cal = precision.calibration
            out.append(
                f"- Calibration: {cal.method}, preset {cal.preset} ({cal.preset_reason}); activations "
                f"{cal.activation_type}, "
                f"weights {cal.weight_type}{' per-channel' if cal.per_channel else ''}; {cal.sample_count} calibration "
                "samples, "
                f"disjoint from the {accuracy.sample_count} held-out samples (calibration cache "
                f"{'hit' if cal.cache_hit else 'miss'})"
            )
    elif calibration_count:
        out.append(f"- Calibration samples: {calibration_count}")
    absolute = (f"; absolute: atol {tol.atol or 0:g} / rtol {tol.rtol or 0:g} on the {tol.error_stat} error"
                if tol.atol is not None or tol.rtol is not None else "")
    out += [
        f"- Tolerance: errors are |candidate - reference| in units of each output's scale (the standard deviation "
        f"of its reference values). {tol.error_stat.capitalize()} error <= {tol.max_error:g} over all samples and "
        f"<= {tol.max_sample_error:g} within each; cosine >= {tol.min_cosine} over all samples and >= "
        f"{tol.min_sample_cosine} per sample (skipped where the reference is ~all zeros); gain within "
        f"1 +- {tol.max_gain_error:g} (a systematic scale error); no NaN/Inf{absolute}; "
        + ("no sample may fail the per-sample limits" if tol.max_failing_fraction == 0 else
           f"at most {tol.max_failing_fraction:.1%} of samples may fail the per-sample limits"),
        "",
        "## Outputs",
        "",
        _table(output_columns(tol.error_stat),
               [[*output_cells(o.model_dump(mode="json"), accuracy.sample_count), "pass" if o.passed else "FAIL"]
                for o in accuracy.outputs]),
    ]
    skipped = [f"{o.name}: {o.samples_without_direction}" for o in accuracy.outputs
               if o.samples_without_direction and o.agreement is None]
    if skipped:
        out += ["", "Per-sample cosine skipped (reference ~all zeros, no direction to compare; error still judged): "
                + ", ".join(skipped)]
    if accuracy.worst_samples:
        out += ["", "## Worst samples", ""]
        out.append(_table(
            ["sample", "output", f"{tol.error_stat} error", "cosine", "verdict"],
            [[w.sample, w.output, f"{w.error:.3g}", "-" if w.cosine is None else f"{w.cosine:.6f}",
              "pass" if w.passed else "FAIL"] for w in accuracy.worst_samples],
        ))
    if accuracy.task_metrics:
        out += ["", "## Task metrics", ""]
        out.append(_table(TASK_COLUMNS, task_rows(as_json)))
        metric_notes = [f"- {m.kind}: {m.note}" for m in accuracy.task_metrics if m.note]
        metric_notes += [f"- {m.kind}: changed or worst samples: {', '.join(m.worst_samples)}"
                         for m in accuracy.task_metrics if m.worst_samples]
        out += [""] + metric_notes if metric_notes else []
    if precision is not None and precision.kept_in_higher_precision:
        out += ["", "## Kept in higher precision", ""]
        out.append(_table(["node", "op", "why"], [[k.node, k.op_type,
                                                   k.reason] for k in precision.kept_in_higher_precision]))
    out += ["", *fallback_markdown(fallback, bench)] if fallback is not None and fallback.status != "disabled" else []
    out += labeled_markdown(accuracy.checks)
    out += (["", "## Failed checks", ""] + [f"- {f}" for f in accuracy.failures]) if accuracy.failures else []
    if notes:
        out += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def fallback_markdown(fallback: FallbackReport, bench: BenchmarkReport | None) -> list[str]:
    """The fallback: its verdict and why, every step of its search (what was built or timed, its loss, gain, speed,
    what was decided), the top offenders before and after, and what it cost in speed."""
    budget = (f"budget {fallback.time_budget_s:.0f} s and >= {fallback.min_speedup:.2f}x the fp32 build's speed"
              if fallback.time_budget_s else f"budget {fallback.max_rounds} rounds")
    out = ["## Fallback (measured search)", "",
           f"**{fallback.status}**: {fallback.reason}. Judged with the gate's tolerance and task metrics"
           f"{'' if fallback.steering_slack == 1 else f' at {fallback.steering_slack:.0%} of their slack'} on "
           f"{fallback.steering_samples} {fallback.steering_source}; {budget}; "
           f"searched {fallback.search_seconds:.0f} s; "
           f"{fallback.fp32_flops_fraction:.1%} of the Conv/MatMul/Gemm FLOPs in float"
           + (f"; remedies adopted: {', '.join(fallback.remedies)}" if fallback.remedies else "") + ".", ""]
    if fallback.naive is None:
        return out
    out.append(f"The naive build: worst cosine {fallback.naive.worst_cosine:.6f}, steering samples "
               f"{'pass' if fallback.naive.passed else 'FAIL'}" + (f" (loss {fallback.naive.loss:.3g}: 1 is the limit)"
                                                                  if fallback.naive.loss is not None else "")
               + (f": {'; '.join(fallback.naive.failures)}" if fallback.naive.failures else "") + ".")
    if fallback.steps:
        out += ["", "Every step of the search, in order (loss: how far the steering samples are from passing, 1 at the "
                    "limit; "
                "gain: the loss it took away; speed-up: against the fp32 build on the deployed kernels):", ""]
        out.append(_table(["step", "kind", "what", "loss", "gain", "speed-up", "seconds", "decision"],
                          [[str(s.step), s.kind, s.what, "-" if s.loss is None else _error(s.loss),
                            "-" if s.gain is None else f"{s.gain:+.3g}",
                            "-" if s.speedup is None else f"{s.speedup:.2f}x",
                            f"{s.seconds:.1f}", s.decision or "-"] for s in fallback.steps]))
    if fallback.layers:
        out += ["", "Top offenders of the naive build (error added by the node, in units of its output's scale):", ""]
        out.append(_table(["node", "op", "depth", "added error, naive", "added error, chosen", "kept in fp32"],
                          [[r.node, r.op_type, str(r.depth), _error(r.added_error_naive),
                            "-" if r.added_error_final is None else _error(r.added_error_final),
                            "yes" if r.kept else "no"]
                           for r in fallback.layers]))
    speed = _fallback_speed(fallback, bench)
    if speed:
        out += ["", speed]
    return out


def _error(value: float) -> str:
    return "inf" if value == float("inf") else f"{value:.3g}"


def _fallback_speed(fallback: FallbackReport, bench: BenchmarkReport | None) -> str:
    naive = next((m for m in bench.models if m.label.endswith("-naive")), None) if bench else None
    if naive is None:
        return ""
    chosen = bench.models[0]
    pairs = [(b.batch_size, chosen.at(b.batch_size).latency.p50_ms, b.latency.p50_ms) for b in naive.batches]
    return "Speed cost of the fallback (p50, same interleaved run): " + "; ".join(
        f"batch {size}: {mine:.2f} ms vs naive {theirs:.2f} ms ({mine / theirs:.2f}x the naive time)" for size, mine,
        theirs in pairs)


def _data_line(data: DataSummary) -> str:
    if data.source == "synthetic":
        return f"synthetic, seed {data.seed}"
    unit = {"text": "texts", "images": "images"}.get(data.source, "files")  # a text file holds many samples
    return f"{data.source} from {data.path}, {data.count} {unit} read"


def benchmark_markdown(model_name: str, bench: BenchmarkReport) -> str:
    out = [
        f"# Benchmark: {model_name}",
        "",
        f"Threads: {bench.threads}. Each latency is wall time around the whole inference call"
        f"{' followed by device synchronization' if bench.synchronized else ''}; models measured in interleaved rounds "
        "in one run.",
        "",
    ]
    rows = []
    for m in bench.models:
        for b in m.batches:
            lat = b.latency
            rows.append([m.label, str(b.batch_size), f"{lat.p50_ms:.2f}", f"{lat.p90_ms:.2f}", f"{lat.p99_ms:.2f}",
                         f"{lat.mean_ms:.2f}", f"{b.throughput_per_s:.1f}", f"{b.input_prep_ms:.2f}",
                         str(lat.iterations)])
    out.append(_table(["model", "batch", "p50 ms", "p90 ms", "p99 ms", "mean ms", "samples/s", "input prep ms",
                       "iterations"], rows))
    out += ["", _table(
        ["model", "session load ms", "peak RSS MiB", "model memory MiB"],
        [[m.label, f"{m.session_load_ms:.1f}", f"{m.peak_rss_mib:.0f}",
          f"{m.model_memory_mib:.0f}"] for m in bench.models],
    )]
    if bench.concurrency:
        out += ["", "Concurrency sweep (one async request in flight per stream):", ""]
        out.append(_table(["hint", "threads", "streams", "batch", "samples/s", "p50 ms", "p99 ms"],
                          [[r["hint"], str(r["threads"]), str(r["streams"]), str(r["batch_size"]),
                            f"{r['samples_per_s']:.1f}",
                            f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}"] for r in bench.concurrency]))
    if bench.sweep:
        rec = bench.recommended
        out += ["", "Batch size x concurrency sweep (a session per worker, requests back to back; throughput measured "
                "until the last 3 windows agree):", ""]
        out.append(_table(["batch", "concurrency", "p50 ms", "p90 ms", "p99 ms", "samples/s", "peak memory MiB",
                           "stable", ""],
                          [[str(p.batch_size), str(p.concurrency), f"{p.p50_ms:.2f}", f"{p.p90_ms:.2f}",
                            f"{p.p99_ms:.2f}",
                            f"{p.throughput_per_s:.1f}", f"{p.peak_memory_mib:.0f}", "yes" if p.stable else "no",
                            "recommended" if rec and (p.batch_size,
                                                      p.concurrency) == (rec.batch_size, rec.concurrency) else
                            f"out of memory: {p.out_of_memory}" if p.out_of_memory else ""]
                           for p in bench.sweep]))
        out += ["", f"Recommendation: {bench.recommendation}."]
        out += [f"- {'pass' if c.passed else 'FAIL'}: {c.name}: {c.line}" for c in bench.checks]
    if bench.stages_ms:
        out += ["", f"Where a batch's time goes, ms ({bench.stage_note}):", ""]
        out.append(_table(["batch", "read", "decode", "preprocess", "h2d", "compute", "d2h", "postprocess",
                           "bottleneck"],
                          [[str(t.batch_size), f"{t.read_ms:.2f}", f"{t.decode_ms:.2f}", f"{t.preprocess_ms:.2f}",
                            f"{t.h2d_ms:.2f}", f"{t.compute_ms:.2f}", f"{t.d2h_ms:.2f}", f"{t.postprocess_ms:.2f}",
                            t.bottleneck] for t in bench.stages_ms]))
    elif bench.stage_note:
        out += ["", f"Application stages: {bench.stage_note}."]
    if bench.jobs:
        out += ["", "The whole job on the same files, measured end to end in this process:", ""]
        out.append(_table(["pipeline", "inputs", "seconds", "ms per input", "inputs/s", "bottleneck", "how"],
                          [[j.pipeline, str(j.inputs), f"{j.seconds:.2f}", f"{j.per_input_ms:.2f}",
                            f"{j.inputs_per_s:.1f}",
                            j.bottleneck, j.description] for j in bench.jobs]))
        if len(bench.jobs) == 2:
            out += ["", f"accel-opt run: {bench.jobs[0].seconds / bench.jobs[1].seconds:.2f}x the naive job's speed."]
    if bench.efficiency:
        eff = bench.efficiency
        out += ["", f"Efficiency: {eff.gflop_per_sample:.3g} GFLOP and {eff.io_mib_per_sample:.3g} MiB of "
                    "inputs/outputs per "
                f"sample, {eff.weight_mib:.3g} MiB of weights; host measurements in this run: fp32 GEMM "
                f"{eff.fp32_ceiling_gflops:.0f} "
                f"GFLOP/s, memory copy {eff.memory_gib_per_s:.1f} GiB/s (balance {eff.machine_balance:.0f} FLOP/byte); "
                f"{eff.precision_note}.", ""]
        out.append(_table(["batch", "achieved GFLOP/s", "of the fp32 ceiling", "FLOP/byte", "bound"],
                          [[str(b.batch_size), f"{b.achieved_gflops:.1f}", f"{b.fraction_of_fp32_ceiling:.0%}",
                            f"{b.arithmetic_intensity:.1f}", b.bound] for b in eff.batches]))
    for base, ratios in bench.speedup_vs_baseline.items():
        out += ["",
                f"Speedup of {bench.models[0].label} over {base} (p50 ratio, >1 is faster; measured, not claimed):", ""]
        out.append(_table(["batch", "speedup"], [[str(b), f"{r:.2f}x"] for b, r in ratios.items()]))
    return "\n".join(out) + "\n"


def _rate_cell(rate: RateEvidence) -> str:
    """A held-out rate beside its minimum, in a table cell: the bound for a reduced build, the observed rate for fp32
    (judged against its noise floor), the count where none may fail."""
    counted = rate.counted()
    if rate.minimum >= 1:
        shown = f", >= {rate.lower:.1%} vs {rate.shown_minimum:.1%}" if rate.shown_minimum < 1 else ""
        return f"{rate.what}: {counted}, none may fail{shown}"
    if rate.bounded:
        return f"{rate.what} >= {rate.lower:.1%} vs {rate.minimum:.1%} ({counted})"
    return f"{rate.what} {rate.rate:.1%} observed vs {rate.minimum:.1%} ({counted})"


def selection_markdown(name: str, selection: AutoSelection) -> str:
    budget = f"p99 <= {selection.latency_budget_ms} ms" if selection.latency_budget_ms else "none"
    time_budget = f"{selection.time_budget_s:.0f} s" if selection.time_budget_s else "none"
    out = [
        f"# Automatic choice: {name}",
        "",
        f"Objective: {selection.objective} ({OBJECTIVES.get(selection.objective, '')}); target batch "
        f"{selection.target_batch_size}; latency budget {budget}. Backend: {selection.backend_reason}.",
        f"Timing: {selection.timing}. A candidate not better than fp32 on the objective never wins.",
        f"Choice: the shortlist is made on the steering samples only; down the runoff's ranking, each reduced "
        f"candidate's held-out verdict is read at the family-wise level (Bonferroni), so the winner's verdict holds at "
        f"{selection.confidence:.0%} confidence ({selection.method}) whichever candidate it is.",
        f"Time: {selection.seconds:.0f} s of a {time_budget} budget.",
        "",
    ]

    def fmt(value: float | None, spec: str) -> str:
        return format(value, spec) if value is not None else "-"

    def steering(c) -> str:
        if c.steering_passed is None:
            return "-"
        return ("pass" if c.steering_passed else "FAIL") + (f" (loss {_error(c.steering_loss)})"
                                                            if c.steering_loss is not None else "")

    def held_out(c) -> str:
        if c.held_out is None:
            return "-"
        shown = [r for r in c.rates if r.minimum < 1] or c.rates[:1]
        rates = "; ".join(_rate_cell(r) for r in shown)
        level = f" at {c.family_confidence:.2%}" if c.family_confidence else ""
        return f"{c.held_out}{level}" + (f": {rates}" if rates else "")

    out.append(_table(
        ["backend", "precision", "steering", "held-out verdict", "p50 ms", "p50 ms in its build", "samples/s",
         "worst cosine", "build s", "search budget s", "verdict"],
        [[c.backend, c.precision, steering(c), held_out(c), fmt(c.latency_p50_ms, ".2f"),
          fmt(c.build_latency_p50_ms, ".2f"),
          fmt(c.throughput_per_s, ".1f"), fmt(c.cosine, ".5f"), f"{c.seconds:.0f}",
          fmt(c.search_budget_s, ".0f"), c.verdict]
         for c in selection.candidates],
    ))
    shown = selection.winner or next((c for c in selection.candidates if c.samples), None)
    if shown is not None and shown.samples:
        out += ["", f"Samples of the {shown.label} build: " + ", ".join(f"{count} {role}" for role,
                                                                        count in shown.samples.items())
                + "; every candidate is steered by the same steering samples, and only int8 builds calibrate."]
    spent = [c for c in selection.candidates if c.stage_seconds]
    if spent:
        stages = list(dict.fromkeys(name for c in spent for name in c.stage_seconds))
        out += ["", "Where the minutes went (seconds per stage of each build):", ""]
        out.append(_table(["candidate", *stages, "total"], [[c.label,
                                                             *(fmt(c.stage_seconds.get(n), ".0f") for n in stages),
                                                              f"{c.seconds:.0f}"] for c in spent]))
    if selection.untried:
        out += ["", "Left untried for lack of time:", ""] + [f"- {line}" for line in selection.untried]
    winner = selection.winner
    out += ["", f"Winner: {winner.backend} {winner.precision} -> {winner.artifact_dir}" if winner
            else f"No winner: {selection.no_winner_reason()} (see the verdicts)."]
    return "\n".join(out) + "\n"
