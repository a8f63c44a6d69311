"""`accel-opt compare BASELINE CANDIDATE`: a regression gate between two builds of one model family.

Both folders are verified and loaded through the runtime, timed against each other in interleaved
rounds on the same samples (each at its own deployed batch size), and judged against the same fp32
reference (the candidate's input model, found from its manifest and checked by its sha256, or
`--reference`) with the candidate's tolerance and task metrics. The gates compare throughput and
the task quality, and give exit 1 with the numbers.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from pydantic import BaseModel

from accel_opt.accuracy import AccuracyReport, Check, compare
from accel_opt.accuracy.labeled import drop_upper_bound, samples_to_certify_drop
from accel_opt.backends.onnxruntime.backend import reference_runner
from accel_opt.bench import deployment_target, run_benchmark
from accel_opt.data import DataSummary, load_samples, sample_key
from accel_opt.errors import InputRejected, UsageError
from accel_opt.files import sha256_file
from accel_opt.graph.inspect import io_specs
from accel_opt.machine.cpu import available_cpus
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.types import Precision
from accel_opt.runtime import Deployment, read_manifest

SYNTHETIC_SAMPLES = 16


class Side(BaseModel):
    artifact: str
    backend: str
    precision: str
    batch_size: int
    latency_p50_ms: float  # per call at batch_size, in the interleaved run
    throughput_per_s: float
    quality: float  # the candidate's first task metric's first value, or the worst output cosine
    accuracy: AccuracyReport


class Comparison(BaseModel):
    reference: str
    data: DataSummary
    quality_metric: str  # what `quality` is
    baseline: Side
    candidate: Side
    left_out: dict[str, int] = {}  # --data samples not judged: calibrated or steered a build (its manifest), or copies
    throughput_ratio: float  # candidate / baseline: > 1 is faster
    latency_regression_pct: float  # how much slower per sample the candidate is (negative: faster)
    accuracy_drop: float  # baseline quality - candidate quality
    accuracy_drop_bound: float | None = None  # its paired upper bound at the recipe's confidence (--max-accuracy-drop)
    checks: list[Check]
    too_few: list[str] = []  # the failed checks whose samples were too few to certify them (exit 6 when only those)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def exit_code(self) -> int:
        """0 passed; 6 when every failed check failed only for too few samples; 1 otherwise."""
        failed = [c.name for c in self.checks if not c.passed]
        if not failed:
            return 0
        return 6 if set(failed) <= set(self.too_few) else 1


def reference_of(candidate: Deployment, given: str | Path | None) -> Path:
    """The fp32 model the candidate was built from: `given`, else the path its manifest records, which
    must still hold the same bytes (sha256)."""
    record = read_manifest(candidate.files).input_model
    if given is None and record.get("factory"):  # exported inside the build: no ONNX file of its own to point at
        raise UsageError(f"{candidate.folder.name} was built from {record['factory']}, exported inside the build: give "
                         "--reference MODEL.onnx (accel-opt export writes one)")
    path = Path(given) if given else Path(record.get("path") or "")
    if not path.is_file():
        raise UsageError(f"the candidate's reference model {path} is not there: give --reference MODEL.onnx")
    if given is None and record.get("sha256") and sha256_file(path) != record["sha256"]:
        raise InputRejected(f"{path} has changed since {candidate.folder.name} was built (sha256): give --reference")
    return path


def run_comparison(baseline: Deployment, candidate: Deployment, reference: Path, data_dir: str | Path | None,
                   max_latency_regression_pct: float | None = None,
                   max_accuracy_drop: float | None = None) -> Comparison:
    if [i.name for i in baseline.config.inputs] != [i.name for i in candidate.config.inputs]:
        raise UsageError("the two artifacts take different inputs: not the same model family")
    recipe = Recipe.model_validate(read_manifest(candidate.files).recipe["resolved"])
    config = candidate.config
    count = recipe.accuracy.max_samples
    fed = [side.samples(data_dir, SYNTHETIC_SAMPLES, recipe.accuracy.seed)[0] for side in (baseline, candidate)]
    samples, data = _reference_samples(candidate, reference, data_dir, recipe)
    kept, left_out = _judgeable(samples, data.names, (baseline, candidate))
    kept = kept[:count]
    samples, names, fed = [samples[i] for i in kept], [data.names[i] for i in kept], [[f[i] for i in kept] for f in fed]
    threads = config.threads or available_cpus()

    # A reduced-precision side is judged as its build was: every rate by its lower bound at the recipe's confidence.
    reports = [compare(reference_runner(reference, threads), side.runner(_dtypes(own)), samples, recipe.tolerance,
                       recipe.accuracy.task_metrics, names=names, batch_size=side.batch_size,
                       batch_axes=side.batch_axes,
                       candidate_samples=own, noise_reference=reference_runner(reference, threads, optimize=True),
                       confidence=recipe.accuracy.confidence, bounded=side.config.precision is not Precision.fp32)
               for side, own in zip((baseline, candidate), fed, strict=True)]
    sizes = sorted({baseline.batch_size, candidate.batch_size})
    targets = [deployment_target(baseline, _dtypes(fed[0]), label="baseline", samples=fed[0]),
               deployment_target(candidate, _dtypes(fed[1]), label="candidate", samples=fed[1])]
    bench = run_benchmark(targets, samples, sizes, recipe.benchmark, threads, config.batch_axes)
    metric = _quality_metric(reports[1])
    sides = []
    for deployment, report, timed in zip((baseline, candidate), reports, bench.models, strict=True):
        at = timed.at(deployment.batch_size)
        sides.append(Side(artifact=str(deployment.folder), backend=deployment.config.backend,
                          precision=deployment.config.precision.value, batch_size=deployment.batch_size,
                          latency_p50_ms=at.latency.p50_ms, throughput_per_s=at.throughput_per_s,
                          quality=_quality(report, metric), accuracy=report))
    base, cand = sides
    ratio = cand.throughput_per_s / base.throughput_per_s
    regression = (base.throughput_per_s / cand.throughput_per_s - 1) * 100
    drop = base.quality - cand.quality
    verdicts = {"pass": "candidate within the tolerance against the reference",
                "insufficient": f"too few samples to certify the candidate ({cand.accuracy.samples_needed} needed)"}
    checks = [Check(name="candidate signs off", passed=cand.accuracy.passed,
                    line=verdicts.get(cand.accuracy.verdict, "candidate fails the gate")
                    + ("" if cand.accuracy.passed else f": {cand.accuracy.failures[0]}"))]
    too_few = ["candidate signs off"] if cand.accuracy.verdict == "insufficient" else []
    if max_latency_regression_pct is not None:
        ok = regression <= max_latency_regression_pct
        checks.append(Check(name="latency regression", passed=ok,
                            line=f"candidate {abs(regression):.1f}% {'slower' if regression > 0 else 'faster'} per "
                                 "sample "
                                 f"({cand.throughput_per_s:.1f} vs {base.throughput_per_s:.1f} samples/s); "
                                 f"limit {max_latency_regression_pct:g}% slower"))
    drop_bound = None
    if max_accuracy_drop is not None:
        check, drop_bound, short = _drop_check(reports, names, metric, base.quality, cand.quality, max_accuracy_drop,
                                               recipe.accuracy.confidence)
        checks.append(check)
        too_few += ["accuracy drop"] if short else []
    return Comparison(reference=str(reference), data=data, quality_metric=metric, baseline=base, candidate=cand,
                      throughput_ratio=ratio, latency_regression_pct=regression, accuracy_drop=drop, checks=checks,
                      left_out=left_out, accuracy_drop_bound=drop_bound, too_few=too_few)


def _drop_check(reports: list[AccuracyReport], names: list[str], metric: str, base_quality: float, cand_quality: float,
                limit: float, confidence: float) -> tuple[Check, float | None, bool]:
    """--max-accuracy-drop, judged as the build judges a drop on labels: by the paired one-sided upper bound at the
    recipe's confidence over the samples whose outcome (agreement with the reference under the first task metric)
    each side changed; (check, bound, too few samples to certify the limit). Without a metric counting outcomes per
    sample (a cosine), the point difference, said so."""
    changed = [report.task_metrics[0].changed if report.task_metrics else None for report in reports]
    drop = base_quality - cand_quality
    point = f"{metric}: candidate {cand_quality:.4f}, baseline {base_quality:.4f}, drop {drop:.4f}"
    if changed[0] is None or changed[1] is None:
        ok = base_quality - cand_quality <= limit
        return Check(name="accuracy drop", passed=ok, line=f"{point}; limit {limit:g} (a point difference: this metric "
                     "has no per-sample outcome to bound)"), None, False
    base_changed, cand_changed = set(changed[0]), set(changed[1])
    lost, gained = len(cand_changed - base_changed), len(base_changed - cand_changed)
    bound = drop_upper_bound(lost, gained, len(names), confidence)
    needed = samples_to_certify_drop(limit, confidence)
    short = bound > limit and (needed is None or len(names) < needed)  # no outcome of these samples could clear it
    line = (f"{point}; paired on {len(names)} samples ({lost} lost, {gained} gained against the reference): the drop "
            "is "
            f"at most {bound:.4f} at {confidence:.0%} confidence; limit {limit:g}")
    if short:
        line += f"; too few samples to certify it ({needed or 'no number of'} samples needed with none changed)"
    return Check(name="accuracy drop", passed=bound <= limit, line=line), bound, short


def _judgeable(samples: list, names: list[str], sides: tuple[Deployment, ...]) -> tuple[list[int], dict[str, int]]:
    """The samples a comparison may judge: none that calibrated or steered either build, told by content (the sha1 of
    each such sample, data.sample_key, as each manifest records it: a copy under another name is still a sample that
    build has seen; by name for folders from before content was recorded), each distinct input once. Returns their
    indices and how many were left out, by why."""
    seen_by: dict[str, str] = {}  # content key (or, for older manifests, name) -> the role it had
    for side in sides:
        data = read_manifest(side.files).data
        split, seen = data.get("split") or {}, data.get("seen_sha1")
        for role in ("calibration", "steering"):
            for key in (seen or {}).get(role, []) if seen is not None else split.get(role, []):
                seen_by.setdefault(key, role)
    kept, keys, left_out = [], set(), {"calibration": 0, "steering": 0, "copies": 0}
    for i, (sample, name) in enumerate(zip(samples, names)):
        key = sample_key(sample)
        why = seen_by.get(key) or seen_by.get(name) or ("copies" if key in keys else None)
        keys.add(key)
        if why:
            left_out[why] += 1
        else:
            kept.append(i)
    if not kept:
        raise InputRejected(f"every one of the {len(samples)} --data samples calibrated or steered one of the builds, "
                            "or "
                            "repeats another: give samples neither build has seen")
    return kept, {why: n for why, n in left_out.items() if n}


def _dtypes(samples: list) -> dict:
    return {name: array.dtype for name, array in samples[0].items()}


def _reference_samples(candidate: Deployment, reference: Path, data_dir, recipe: Recipe) -> tuple[list, DataSummary]:
    """The samples as the fp32 reference takes them: the candidate's own, unless its preprocessing is fused
    into the model, where the reference takes the host pipeline's floats from the same files."""
    pre = candidate.config.preprocessing
    if pre is None or not pre.fused:
        return candidate.samples(data_dir, SYNTHETIC_SAMPLES, recipe.accuracy.seed)
    inputs, _ = io_specs(onnx.load(str(reference), load_external_data=False))
    return load_samples(data_dir, inputs, pre.model_copy(update={"fused": False}))


def _quality_metric(report: AccuracyReport) -> str:
    if report.task_metrics:
        first = report.task_metrics[0]
        return f"{first.kind}:{next(iter(first.values))} on {first.output}"
    return "worst output cosine"


def _quality(report: AccuracyReport, metric: str) -> float:
    if report.task_metrics:
        first = report.task_metrics[0]
        return first.values[next(iter(first.values))]
    return report.worst_cosine


def comparison_markdown(c: Comparison) -> str:
    rows = [(side, label) for side, label in ((c.baseline, "baseline"), (c.candidate, "candidate"))]
    out = [
        "# Comparison",
        "",
        f"Reference: `{c.reference}`; data: {c.data.source} ({c.data.count} samples); interleaved in one run; "
        f"quality: {c.quality_metric}.",
        "",
        "| | artifact | backend | precision | batch | p50 ms | samples/s | quality "
        "| signed off against the reference |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    out += [f"| {label} | {Path(s.artifact).name} | {s.backend} | {s.precision} | {s.batch_size} | "
            f"{s.latency_p50_ms:.2f} | "
            f"{s.throughput_per_s:.1f} | {s.quality:.4f} | {'yes' if s.accuracy.passed else 'no'} |" for s,
            label in rows]
    out += ["", f"Throughput ratio candidate / baseline: {c.throughput_ratio:.2f}x; accuracy drop "
                f"{c.accuracy_drop:.4f}.", ""]
    if c.left_out:
        why = {"calibration": "calibrated a build", "steering": "steered a build", "copies": "repeated another sample"}
        out += ["Not judged (evidence a build has already seen, by manifest.json's split): "
                + ", ".join(f"{n} that {why[k]}" for k, n in c.left_out.items()) + ".", ""]
    for side, label in rows:  # each rate with its bound and counts: what these samples can certify
        rates = [ch.evidence.line() for ch in side.accuracy.checks if ch.evidence is not None
                 and ch.evidence.minimum < 1]
        how = (f"by the lower bound at {side.accuracy.confidence:.0%} confidence ({side.accuracy.method})"
               if side.accuracy.bounded else "as observed (fp32)")
        if rates:
            out.append(f"- {label}'s rates on {side.accuracy.sample_count} samples, judged {how}: " + "; ".join(rates))
    out.append("")
    out += [f"- {'pass' if check.passed else 'FAIL'}: {check.name}: {check.line}" for check in c.checks]
    return "\n".join(out) + "\n"
