"""`signoff.html`: the sign-off a reviewer reads in a browser, rendered from the artifact's JSON reports only.

One self-contained page (inline CSS, plots embedded as PNG data URIs, no network reference): the
verdict first, then what it rests on, every check, the per-output and worst-sample tables, task
metrics, what stayed in higher precision, the benchmark with its plot, the resource configuration
and the environment. `render(folder)` reads accuracy.json, benchmark.json, resource_config.json
and build.json, so rendering a saved folder again reproduces the file byte for byte.
"""

from __future__ import annotations

import base64
import io
import json
from html import escape
from pathlib import Path
from typing import Any

import numpy as np

from accel_opt.report.markdown import (
    TASK_COLUMNS,
    evidence_lines,
    number_cell,
    output_cells,
    output_columns,
    task_rows,
)
from accel_opt.report.verdict import Verdict

REPORTS = ("accuracy.json", "benchmark.json", "resource_config.json", "build.json")
STYLE = """
body{font:14px/1.45 -apple-system,"Segoe UI",Helvetica,Arial,sans-serif;color:#1f2328;margin:0;background:#f6f8fa}
main{max-width:1100px;margin:0 auto;padding:24px 32px 48px;background:#fff;min-height:100vh}
h1{font-size:24px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
.verdict{font-size:20px;font-weight:600;padding:12px 16px;border-radius:6px;margin:12px 0 16px}
.pass{background:#dafbe1;color:#116329;border:1px solid #4ac26b}
.fail{background:#ffebe9;color:#a40e26;border:1px solid #ff8182}
.warn{background:#fff8c5;border:1px solid #d4a72c;padding:8px 12px;border-radius:6px}
table{border-collapse:collapse;margin:6px 0 10px;font-size:13px}
th,td{border:1px solid #d0d7de;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa}td.num{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#116329;font-weight:600}.bad{color:#a40e26;font-weight:600}.muted{color:#656d76}
code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace;background:#f6f8fa;padding:1px 4px;border-radius:4px}
ul{margin:4px 0 8px 20px;padding:0}img{max-width:100%;border:1px solid #d0d7de;border-radius:6px}
"""


def render(folder: str | Path, verdict: Verdict | None = None, title: str | None = None) -> str:
    """The sign-off page of the artifact (or staged) `folder`, from its JSON reports and its build's verdict (default:
    the one its manifest.json records)."""
    folder = Path(folder)
    acc, bench, config, build = (json.loads((folder / name).read_text()) for name in REPORTS)
    if verdict is None:
        verdict = Verdict.model_validate(json.loads((folder / "manifest.json").read_text())["verdict"])
    name = title or build.get("model_name") or folder.name
    checks = acc["checks"] + bench.get("checks", [])
    failures = verdict.reasons
    passed = verdict.signed_off
    parts = [f"<h1>Accuracy sign-off: {escape(name)}</h1>",
             f'<div class="muted">{escape(config["backend"])} {escape(config["precision"])} &middot; '
             f"{escape(build.get('created_utc', ''))}</div>",
             '<div class="verdict '
             f'{"pass" if passed else "fail"}">{escape(verdict.headline(acc.get("trial_unit", "samples")))}'
             f" &mdash; {sum(c['passed'] for c in checks)} of {len(checks)} checks passed</div>"]
    if not passed:
        parts.append("<h2>Failed checks</h2>" + _list(failures))
    parts += [_rests_on(acc, build), _checks(checks), _outputs(acc), _worst(acc), _tasks(acc), _fallback(build),
              _kept(build), _benchmark(bench), _resources(config), _environment(build, config)]
    notes = build.get("notes", []) + ((build.get("precision") or {}).get("notes") or [])
    if notes:
        parts.append("<h2>Notes</h2>" + _list(notes))
    body = "\n".join(p for p in parts if p)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(name)} sign-off</title>'
            f"<style>{STYLE}</style></head><body><main>\n{body}\n</main></body></html>\n")


def _list(items: list[str]) -> str:
    return "<ul>" + "".join(f"<li>{escape(str(i))}</li>" for i in items) + "</ul>"


def _table(header: list[str] | None, rows: list[list[Any]], numeric: set[int] = frozenset()) -> str:
    """A table; `header` None for a key-value table, whose first column is drawn as headings."""
    head = "<tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>" if header else ""
    tag = "td" if header else "th"
    body = "".join("<tr>" + "".join(f'<{tag if i == 0 and not header else "td"}{" class=num" if i in numeric else ""}>'
                                    f'{cell}</{tag if i == 0 and not header else "td"}>' for i, cell in enumerate(row))
                   + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _mark(ok: bool) -> str:
    return '<span class="ok">pass</span>' if ok else '<span class="bad">FAIL</span>'


def _rests_on(acc: dict, build: dict) -> str:
    data, ev, tol = build.get("data") or {}, acc["evaluation"], acc["tolerance"]
    how = (f"in {ev['calls']} calls of batch {ev['batch_size']}, cut back into samples" if ev["mode"] == "batched"
           else f"one sample per call{' (' + ev['note'] + ')' if ev.get('note') else ''}")
    items = [
        f"Candidate <code>{escape(acc['candidate'])}</code>, loaded from the artifact as deployed: "
        f"{escape(ev.get('deployment') or '')}; run {escape(how)}",
        f"Reference <code>{escape(acc['reference'])}</code>, one sample per call",
        *map(escape, evidence_lines(acc,
                                    f"{data.get('source')} from {data.get('path') or ''}, {data.get('count', '?')} "
                                            "read; every sample and every output is judged")),
        f"Errors are |candidate &minus; reference| in units of each output's scale (its reference standard deviation): "
        f"{escape(tol['error_stat'])} error &le; {tol['max_error']:g} over all samples, &le; "
        f"{tol['max_sample_error']:g} "
        f"within each; cosine &ge; {tol['min_cosine']} overall and &ge; {tol['min_sample_cosine']} per sample; gain "
        "within "
        f"1 &plusmn; {tol['max_gain_error']:g}; no NaN/Inf"
        + (f"; absolute atol {tol['atol'] or 0:g} / rtol {tol['rtol'] or 0:g}" if tol.get("atol") is not None
           or tol.get("rtol") is not None else ""),
    ]
    warning = ('<p class="warn"><b>Synthetic data was used:</b> the inputs were random: a numeric check only, judged '
               "on the observed counts; no task rate was certified on real inputs.</p>"
               ) if data.get("source") == "synthetic" else ""
    return "<h2>What the verdict rests on</h2>" + warning + "<ul>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>"


def _checks(checks: list[dict]) -> str:
    return "<h2>Checks</h2>" + _table(["check", "result", "detail"],
                                      [[escape(c["name"]), _mark(c["passed"]) if c.get("gated", True) else
                                        f'{_mark(c["passed"])} (not gated)', escape(c["line"])] for c in checks])


def _outputs(acc: dict) -> str:
    rows = [[*map(escape, output_cells(o, acc["sample_count"])), _mark(o["passed"])] for o in acc["outputs"]]
    return "<h2>Outputs</h2>" + _table(output_columns(acc["tolerance"]["error_stat"]), rows, numeric=set(range(2, 10)))


def _worst(acc: dict) -> str:
    if not acc["worst_samples"]:
        return ""
    rows = [[escape(w["sample"]), escape(w["output"]), number_cell(w["error"], ".3g"),
             "-" if w["cosine"] is None else f"{w['cosine']:.6f}", _mark(w["passed"])] for w in acc["worst_samples"]]
    return "<h2>Worst samples</h2>" + _table(["sample", "output", "error", "cosine", "verdict"], rows, numeric={2, 3})


def _tasks(acc: dict) -> str:
    if not acc["task_metrics"]:
        return ""
    rows = [[*map(escape, row[:-1]), _mark(row[-1] == "pass") if row[-1] in ("pass", "FAIL") else escape(row[-1])]
            for row in task_rows(acc)]
    notes = [f"{m['kind']}: {m['note']}" for m in acc["task_metrics"] if m.get("note")]
    notes += [f"{m['kind']}: changed or worst samples: {', '.join(m['worst_samples'])}"
              for m in acc["task_metrics"] if m.get("worst_samples")]
    return "<h2>Task metrics</h2>" + _table(TASK_COLUMNS, rows, {2, 3, 4}) + (_list(notes) if notes else "")


def _fallback(build: dict) -> str:
    """The fallback's search step by step (naive build first), its top offenders before and after, and the
    error-by-depth plot."""
    fb = build.get("fallback")
    if not fb or fb["status"] == "disabled" or not fb.get("naive"):
        return ""
    slack = "" if fb.get("steering_slack", 1) == 1 else f" at {fb['steering_slack']:.0%} of their slack"
    remedies = fb.get("remedies") or ([f"{fb['calibration']} calibration"] if fb.get("calibration") else [])  # older
    calibration = f"; remedies adopted: {escape(', '.join(remedies))}" if remedies else ""
    out = [f"<h2>Fallback (measured search): {escape(fb['status'])}</h2>",
           f"<p>{escape(fb['reason'])}. Judged with the gate's tolerance and task metrics{slack} on "
           f"{fb['steering_samples']} "
           f"{escape(fb['steering_source'])}; searched {fb.get('search_seconds', 0):.0f} s of a "
           f"{fb.get('time_budget_s', 0):.0f} s "
           f"budget, at least {fb.get('min_speedup', 0):.2f}x the fp32 build's speed; {fb['fp32_flops_fraction']:.1%} "
           "of "
           f"the FLOPs in float{calibration}.</p>"]
    naive = fb["naive"]
    steps = [{"step": 0, "kind": "naive", "what": "the naive build", "loss": naive.get("loss"), "gain": None,
              "speedup": None, "seconds": 0.0, "decision": "PASS" if naive["passed"] else "FAIL"}, *fb.get("steps", [])]
    out.append(_table(["step", "kind", "what", "loss", "gain", "speed-up", "seconds", "decision"],
                      [[s["step"], escape(s["kind"]), escape(s["what"]),
                        "-" if s.get("loss") is None else number_cell(s["loss"], ".3g"),
                        "-" if s.get("gain") is None else f"{s['gain']:+.3g}",
                        "-" if s.get("speedup") is None else f"{s['speedup']:.2f}x", f"{s['seconds']:.1f}",
                        escape(s.get("decision") or "-")] for s in steps], {3, 4, 5, 6}))
    if fb["layers"]:
        out.append("<h3>Top offenders of the naive build</h3><p class=muted>Error the node adds (its output's error "
                   "minus "
                   "its inputs' worst), in units of the output's standard deviation.</p>")
        out.append(_table(["node", "op", "depth", "added error, naive", "added error, chosen", "kept in fp32"],
                          [[f"<code>{escape(r['node'])}</code>", escape(r["op_type"]), r["depth"],
                            number_cell(r["added_error_naive"], ".3g"),
                            "-" if r["added_error_final"] is None else f"{r['added_error_final']:.3g}",
                            "yes" if r["kept"] else "no"] for r in fb["layers"]], {2, 3, 4}))
    if fb.get("naive_profile"):
        png = base64.b64encode(layer_error_png(fb)).decode()
        out.append(f'<img alt="error by layer depth, naive and chosen build" src="data:image/png;base64,{png}">')
    return "\n".join(out)


def layer_error_png(fallback: dict) -> bytes:
    """Error (log scale) against layer depth for the naive and the chosen build."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.2), dpi=100)
    for key, label in (("naive_profile", "naive build"), ("final_profile", "chosen build")):
        points = [(d, e) for d, e in fallback.get(key) or [] if np.isfinite(e)]
        if points:
            depth, error = zip(*points)
            ax.plot(depth, np.maximum(error, 1e-7), marker=".", linewidth=1, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("layer depth (node index in the fp32 graph)")
    ax.set_ylabel("error / output std")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def _png(fig) -> bytes:
    from matplotlib import pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()


def _kept(build: dict) -> str:
    kept = (build.get("precision") or {}).get("kept_in_higher_precision") or []
    if not kept:
        return ""
    return "<h2>Kept in higher precision</h2>" + _table(
        ["node", "op", "why"], [[escape(k["node"]), escape(k["op_type"]), escape(k["reason"])] for k in kept])


def _benchmark(bench: dict) -> str:
    rows = [[escape(m["label"]), b["batch_size"], f"{b['latency']['p50_ms']:.2f}", f"{b['latency']['p90_ms']:.2f}",
             f"{b['latency']['p99_ms']:.2f}", f"{b['throughput_per_s']:.1f}", b["latency"]["iterations"]]
            for m in bench["models"] for b in m["batches"]]
    out = ["<h2>Benchmark</h2>",
           f"<p>{bench['threads']} threads; wall time around each whole inference call, models measured in "
           "interleaved rounds in one run.</p>",
           _table(["model", "batch", "p50 ms", "p90 ms", "p99 ms", "samples/s", "iterations"], rows, set(range(1, 7)))]
    for base, ratios in bench["speedup_vs_baseline"].items():
        out.append(f"<p>Speedup of {escape(bench['models'][0]['label'])} over {escape(base)} (p50): "
                   + ", ".join(f"batch {b}: <b>{r:.2f}x</b>" for b, r in ratios.items()) + "</p>")
    out.append(f'<img alt="latency and throughput by batch size" src="data:image/png;base64,{_plot(bench)}">')
    if bench.get("stages_ms"):
        out.append("<h3>Where a batch's time goes</h3>" + f'<img alt="stage times per batch" '
                   f'src="data:image/png;base64,{_stage_plot(bench)}"><p '
                   f'class=muted>{escape(bench.get("stage_note", ""))}</p>')
    if bench.get("jobs"):
        out.append("<h3>The whole job</h3>" + _table(
            ["pipeline", "inputs", "seconds", "ms per input", "inputs/s", "bottleneck", "how"],
            [[escape(j["pipeline"]), j["inputs"], f"{j['seconds']:.2f}", f"{j['per_input_ms']:.2f}",
              f"{j['inputs_per_s']:.1f}",
              escape(j["bottleneck"]), escape(j["description"])] for j in bench["jobs"]], {1, 2, 3, 4}))
    eff = bench.get("efficiency")
    if eff:
        out.append("<h3>Efficiency</h3>"
                   + f"<p>{eff['gflop_per_sample']:.3g} GFLOP per sample, {eff['weight_mib']:.3g} MiB of "
                   f"weights; in this run the fp32 GEMM measurement ran {eff['fp32_ceiling_gflops']:.0f} GFLOP/s and "
                   "memory "
                   f"{eff['memory_gib_per_s']:.1f} GiB/s; {escape(eff['precision_note'])}.</p>" + _table(
                       ["batch", "achieved GFLOP/s", "of the fp32 ceiling", "FLOP/byte", "bound"],
                       [[b["batch_size"], f"{b['achieved_gflops']:.1f}", f"{b['fraction_of_fp32_ceiling']:.0%}",
                         f"{b['arithmetic_intensity']:.1f}", escape(b["bound"])] for b in eff["batches"]],
                       {0, 1, 2, 3}))
    if bench.get("sweep"):
        rec = bench.get("recommended") or {}
        out.append("<h3>Batch size x concurrency</h3>" + _table(
            ["batch", "concurrency", "p50 ms", "p90 ms", "p99 ms", "samples/s", "peak memory MiB", "windows",
             "stable", ""],
            [[p["batch_size"], p["concurrency"], f"{p['p50_ms']:.2f}", f"{p['p90_ms']:.2f}", f"{p['p99_ms']:.2f}",
              f"{p['throughput_per_s']:.1f}", f"{p['peak_memory_mib']:.0f}", p["windows"],
              "yes" if p["stable"] else "no",
              "<b>recommended</b>" if (p["batch_size"],
                                       p["concurrency"]) == (rec.get("batch_size"), rec.get("concurrency"))
              else escape(f"out of memory: {p['out_of_memory']}") if p.get("out_of_memory") else ""]
             for p in bench["sweep"]], set(range(0, 8))))
        out.append(f"<p>{escape(bench.get('recommendation', ''))}</p>")
    if bench.get("concurrency"):
        out.append(_table(["hint", "threads", "streams", "batch", "samples/s", "p50 ms", "p99 ms"],
                          [[escape(r["hint"]), r["threads"], r["streams"], r["batch_size"], f"{r['samples_per_s']:.1f}",
                            f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}"] for r in bench["concurrency"]],
                          set(range(1, 7))))
    return "\n".join(out)


def _plot(bench: dict) -> str:
    """p50/p99 latency and throughput against batch size, one line per model, as a base64 PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (lat, thr) = plt.subplots(1, 2, figsize=(10, 3.4), dpi=100)
    for model in bench["models"]:
        sizes = [b["batch_size"] for b in model["batches"]]
        line, = lat.plot(sizes, [b["latency"]["p50_ms"] for b in model["batches"]], marker="o",
                         label=f"{model['label']} p50")
        lat.plot(sizes, [b["latency"]["p99_ms"] for b in model["batches"]], linestyle="--", color=line.get_color(),
                 label=f"{model['label']} p99")
        thr.plot(sizes, [b["throughput_per_s"] for b in model["batches"]], marker="o", color=line.get_color(),
                 label=model["label"])
    for ax, label in ((lat, "latency per call (ms)"), (thr, "throughput (samples/s)")):
        ax.set_xlabel("batch size")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return base64.b64encode(_png(fig)).decode()


STAGES = ("read", "decode", "preprocess", "h2d", "compute", "d2h", "postprocess")


def _stage_plot(bench: dict) -> str:
    """Stacked bars: each batch size's time split into the application's stages, as a base64 PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = bench["stages_ms"]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * len(rows)), dpi=100)
    labels = [f"batch {r['batch_size']}" for r in rows]
    left = np.zeros(len(rows))
    for stage in STAGES:
        values = np.asarray([r[f"{stage}_ms"] for r in rows])
        ax.barh(labels, values, left=left, label=stage)
        left += values
    ax.set_xlabel("ms per batch")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return base64.b64encode(_png(fig)).decode()


def _resources(config: dict) -> str:
    rec = config.get("recommended") or {}
    rows = [["backend / device",
             f"{escape(config['backend'])} on {escape(config['device'])} via {escape(', '.join(config['providers']))}"],
            ["precision", escape(config["precision"])], ["threads", config["threads"]],
            ["batch size (deployed, as the gate ran it)", config["batch_size"]],
            ["inputs", "<br>".join(f"<code>{escape(i['name'])}</code> {escape(i['dtype'])} {i['shape_used']} "
                                    f"(batch axis {i.get('batch_axis')})" for i in config["inputs"])],
            ["recommended", escape(_readable(rec))],
            ["memory", escape(_readable(config.get("memory") or {}))]]
    return "<h2>Resource configuration</h2>" + _table(None, rows)


UNITS = (("_per_s", "/s"), ("_ms", " ms"), ("_mib", " MiB"), ("_bytes", " bytes"), ("_s", " s"))


def _readable(record: dict) -> str:
    """A record as a person reads it: 'batch size 8, throughput 28,790/s, p99 4.48 ms', nested records in brackets,
    absent values left out, numbers rounded to what they mean."""
    parts = []
    for key, value in record.items():
        if value is None or value == {} or value == []:
            continue
        name, unit = key, ""
        for suffix, shown in UNITS:
            if key.endswith(suffix):
                name, unit = key[: -len(suffix)], shown
                break
        name = name.replace("_", " ")
        if isinstance(value, dict):
            if inner := _readable(value):
                parts.append(f"{name} ({inner})")
        elif isinstance(value, bool) or not isinstance(value, int | float):
            parts.append(f"{name} {value}")
        else:
            parts.append(f"{name} {_number(value)}{unit}")
    return ", ".join(parts)


def _number(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _environment(build: dict, config: dict) -> str:
    env = build.get("environment") or {}
    cpu = env.get("cpu") or {}
    rows = [["CPU", escape(f"{cpu.get('model')} ({cpu.get('machine')}), {cpu.get('available_cpus')} CPUs; "
                           f"{' '.join(cpu.get('flags', []))}")],
            ["tools", escape(", ".join(f"{k} {v}" for k, v in (env.get("tools") or {}).items()))]]
    rows += [[f"<code>{escape(name)}</code>", f"<code>{digest}</code>"] for name,
             digest in (build.get("files_sha256") or {}).items()]
    return ("<h2>Environment and files</h2>" + _table(None, rows)
            + "<p class=muted>Every file's sha256 is in manifest.json; <code>accel-opt verify</code> checks them.</p>")
