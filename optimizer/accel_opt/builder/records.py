"""What a build records about itself and how it finds a finished twin: the measured resource config, the
artifact's identity (its folder name), the manifest, and the reuse of a complete, verified folder."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accel_opt import runtime
from accel_opt.accuracy import AccuracyReport
from accel_opt.artifact.config import RESOURCE_CONFIG, ResourceConfig
from accel_opt.artifact.folder import MANIFEST, Manifest, file_hashes
from accel_opt.artifact.signing import TrustPolicy
from accel_opt.artifact.usage import usage_markdown
from accel_opt.backends import CompiledModel
from accel_opt.bench import BenchmarkReport
from accel_opt.builder.samples import data_samples_needed
from accel_opt.files import (
    MADE_SUFFIX,
    command_line,
    made_here,
    now_utc,
    sha256_file,
    tool_versions,
    write_json,
    write_text,
)
from accel_opt.machine.gpu import gpu_class
from accel_opt.recipe.stages import BenchmarkConfig
from accel_opt.report.html import layer_error_png, render
from accel_opt.report.markdown import benchmark_markdown, signoff_markdown
from accel_opt.report.results import BuildResult, DataRecord, StageResult, fill_headline

if TYPE_CHECKING:
    from accel_opt.builder.context import BuildSoFar

log = logging.getLogger(__name__)


def reuse(ctx: BuildSoFar, final: Path, model: str, stages: list[StageResult], on_stage) -> BuildResult | None:
    """The BuildResult of an identical, complete folder that verifies here; None: build it (again).
    A folder that fails verification is never reused: the new build replaces it."""
    if not final.is_dir():
        return None
    # Reused only with proof a build made it: with --sign-key, that very key's signature (anything else, unsigned,
    # re-hashed or another key's, is built again, never signed as found); without, this user's mark of its manifest
    # (which holds every file's hash), left outside the folder when it was published. A folder edited in --out and
    # re-hashed carries neither.
    signer = ctx.setup.signer
    proof = signer.signed(final) if signer is not None else made_here(final / MANIFEST, made_mark(ctx, final))
    if not proof:
        log.info("not reusing %s: no proof this build made it (%s)", final,
                 "no signature by the --sign-key key" if signer is not None else "no mark of this user's build")
        return None
    problems = runtime.check(final, trust=TrustPolicy(trust_unsigned=True))  # its native code is this build's own
    if problems:
        log.info("not reusing %s: %s", final, problems[0].line)
        return None
    manifest = runtime.read_manifest(final)
    accuracy = AccuracyReport.model_validate_json((final / "accuracy.json").read_text())
    bench = BenchmarkReport.model_validate_json((final / "benchmark.json").read_text())
    stages.append(StageResult(name="reuse", status="passed", detail=f"an identical build verified: {final}"))
    if on_stage:
        on_stage(stages[-1])
    result = BuildResult(
        model=model, precision=manifest.precision, backend=manifest.backend, verdict=manifest.verdict,
        samples_needed=accuracy.samples_needed, data_samples_needed=data_samples_needed(ctx, accuracy.samples_needed),
        trial_unit=accuracy.trial_unit,
        artifact_dir=str(final), stages=stages,
        worst_cosine=accuracy.worst_cosine, data=data_record(ctx), evaluated=accuracy.evaluation.deployment,
        reused=True,
        timed_samples=ctx.dealt.samples.timed_deployed,
    )
    fill_headline(result, bench)
    return result


def made_mark(ctx: BuildSoFar, final: Path) -> Path:
    """Where a published folder's mark (files.mark_made of its manifest) is kept: in the build cache, outside it."""
    return ctx.setup.cache_dir / "made" / f"{final.name}{MADE_SUFFIX}"


def measured_config(ctx: BuildSoFar) -> ResourceConfig:
    """The resource config the runtime read, with what the benchmark measured added (nothing it reads changes)."""
    bench = ctx.measured
    candidate = bench.models[0]
    return ctx.compiled.resource_config.model_copy(update={
        "output_batch_axes": ctx.deployment.config.output_batch_axes,
        "batch_sizes_measured": [b.batch_size for b in candidate.batches],
        "memory": {
            "peak_rss_mib": candidate.peak_rss_mib,
            "model_memory_mib": candidate.model_memory_mib,
            "measured_at_batch": max(b.batch_size for b in candidate.batches),
        },
        "session_load_ms": candidate.session_load_ms,
        "recommended": recommended(ctx.compiled.compiled, bench, ctx.recipe.benchmark),
    })


def recommended(compiled: CompiledModel, bench: BenchmarkReport, config: BenchmarkConfig) -> dict[str, Any]:
    """What the sweep found best within the budgets (the deployed `batch_size` is what `run` uses)."""
    rec = bench.recommended
    recommended: dict[str, Any] = {
        "batch_size": rec.batch_size if rec else None, "concurrency": rec.concurrency if rec else None,
        "threads": compiled.threads, "throughput_per_s": rec.throughput_per_s if rec else None,
        "p99_ms": rec.p99_ms if rec else None, "peak_memory_mib": rec.peak_memory_mib if rec else None,
        "budgets": {"p99_ms": config.p99_budget_ms, "memory_mib": config.memory_budget_mib},
        "reason": bench.recommendation,
    }
    if bench.length_buckets:  # text: the batch that fits the memory budget at each length (None: no budget given)
        recommended["batch_per_length"] = {str(b.length): b.recommended_batch for b in bench.length_buckets}
        recommended["memory_per_length_mib"] = {str(b.length): {"peak": b.peak_memory_mib, "per_row": b.per_row_mib}
                                                for b in bench.length_buckets}
    if bench.concurrency:
        best = max(bench.concurrency, key=lambda row: row["samples_per_s"])
        recommended.update(performance_hint=best["hint"], threads=best["threads"], streams=best["streams"],
                           requests_in_flight=best["requests"],
                           concurrency_reason=f"{best['samples_per_s']:.1f} samples/s at batch {best['batch_size']}, "
                                              "the best of the threads x streams x hint sweep")
    return recommended


def artifact_name(ctx: BuildSoFar) -> str:
    cpu, loaded, dealt = ctx.setup.cpu.record(), ctx.loaded, ctx.dealt
    identity = json.dumps(
        {"model": loaded.model_sha256, "external_data": loaded.external_data_sha256, "recipe": ctx.recipe.fingerprint(),
         "data": dealt.data.sha256, "eval_data": dealt.eval_data.sha256 if dealt.eval_data is not None else None,
         "tools": tool_versions(), "hardware": {k: cpu[k] for k in ("model", "machine", "flags", "available_cpus")}},
        sort_keys=True,
    )
    digest = hashlib.sha256(identity.encode()).hexdigest()[:10]
    return f"{ctx.model_path.stem}-{ctx.recipe.precision.value}-{ctx.setup.backend.name}-{digest}"


def input_record(ctx: BuildSoFar) -> dict[str, Any]:
    loaded, factory = ctx.loaded, ctx.setup.factory
    record: dict[str, Any] = {"path": str(loaded.source_path), "sha256": loaded.model_sha256,
                              "external_data": loaded.external_data_sha256}
    if factory is not None:
        source = Path(factory.spec.rpartition(":")[0])
        record = {"factory": factory.spec, "exported_onnx_sha256": loaded.model_sha256,
                  "source_sha256": sha256_file(source) if source.is_file() else None}
    return record


def data_record(ctx: BuildSoFar) -> DataRecord:
    dealt = ctx.dealt
    data, eval_data, samples = dealt.data, dealt.eval_data, dealt.samples
    held = eval_data if eval_data is not None and eval_data is not data else None
    return DataRecord(source=data.source, path=data.path, synthetic=data.synthetic,
                      samples=data.count + (held.count if held else 0), evaluation_samples=len(samples.held_out),
                      calibration_samples=len(samples.calibration), steering_samples=len(samples.steering),
                      eval_path=eval_data.path if eval_data is not None else None, held_out_max=dealt.verdict_max)


def write_manifest(ctx: BuildSoFar, folder: Path, result: BuildResult) -> None:
    dealt, cpu, device = ctx.dealt, ctx.setup.cpu, ctx.compiled.compiled.device
    manifest = Manifest(
        created_utc=now_utc(),
        verdict=result.verdict,
        precision=ctx.recipe.precision.value,
        backend=ctx.setup.backend.name,
        input_model=input_record(ctx),
        recipe={"name": ctx.recipe.name, "fingerprint": ctx.recipe.fingerprint(),
                "resolved": ctx.recipe.model_dump(mode="json")},
        # Which sample had which role, by name: no sample in two (checked by anyone reading this file).
        data={**dealt.data.model_dump(mode="json", exclude={"names"}), **result.data.model_dump(mode="json"),
              "eval_data_sha256": dealt.eval_data.sha256 if dealt.eval_data is not None else None,
              "split": {"seed": dealt.split.seed, **dealt.split.names(dealt.sample_names)},
              # The content hash (data.sample_key) of every sample that calibrated or steered this build: `compare`
              # leaves
              # them out by content, whatever they are named later.
              "seen_sha1": {role: [dealt.sample_keys[i] for i in getattr(dealt.split, role)
                                   if i < len(dealt.sample_keys)]
                            for role in ("calibration", "steering")}},
        artifacts=file_hashes(folder),
        stages=[s.model_dump() for s in result.stages],
        tools=tool_versions(),
        cpu=cpu.record(),
        command_line=command_line(),
        cpu_class=cpu.kernel_class(ctx.setup.backend.name),
        gpu=gpu_class(device) if device.startswith("cuda") else None,
    )
    write_json(folder / MANIFEST, manifest)


def write_probe_set(ctx: BuildSoFar, folder: Path) -> int:
    """The folder's probe set: the first evaluation samples as the artifact takes them, the reference's outputs on
    them and the gate's tolerance, so another CPU can re-check the sign-off (runtime.probe)."""
    from accel_opt.runtime import probe

    noise = {o.name: o.noise_floor for o in ctx.checked.accuracy.outputs if o.noise_floor}
    count = probe.probe_count(len(ctx.dealt.samples.held_out_names), ctx.recipe.accuracy.probe_samples)
    config = ctx.compiled.resource_config
    preprocessing = config.preprocessing
    return probe.write_probe(folder, ctx.dealt.samples.held_out_deployed, ctx.checked.accuracy._reference_outputs,
                             ctx.dealt.samples.held_out_names, count,
                             ctx.recipe.tolerance, ctx.recipe.accuracy.task_metrics, noise,
                             runtime.machine_class(config, ctx.setup.cpu),
                             preprocessing.host_part() if preprocessing else None,
                             ctx.eval_labels, ctx.recipe.accuracy.labels)


def write_reports(ctx: BuildSoFar) -> str:
    """Every report of the staged folder, JSON first and the rest rendered from it, the probe set and build.json
    (the manifest comes after, in write_manifest); returns the stage's one-line detail."""
    staging, name, bench, reduced = ctx.setup.staging, ctx.model_path.stem, ctx.measured, ctx.reduced
    precision, limits, config = reduced.precision if reduced else None, ctx.setup.limits, ctx.compiled.resource_config
    accuracy = ctx.checked.accuracy
    write_json(staging / "accuracy.json", accuracy)
    write_text(
        staging / "signoff.md",
        signoff_markdown(name, ctx.verdict, accuracy, precision, ctx.dealt.data, len(ctx.dealt.samples.calibration),
                         ctx.notes + (precision.notes if precision else [])
                         + ([limits.family_note] if limits and limits.family_note else [])
                         + [f"Benchmark gate failed: {line}" for line in bench.failures],
                         fallback=ctx.fallback, bench=bench)
        + "\n".join(usage_markdown(artifact_name(ctx), config)) + "\n",
    )
    if ctx.fallback is not None and ctx.fallback.naive_profile:
        (staging / "layer_error.png").write_bytes(layer_error_png(ctx.fallback.model_dump(mode="json")))
    write_json(staging / "benchmark.json", bench)
    write_text(staging / "benchmark.md", benchmark_markdown(name, bench))
    write_json(staging / RESOURCE_CONFIG, measured_config(ctx))
    build_info = {
        "model_name": name,
        "created_utc": now_utc(),
        "cleanup": ctx.cleaned.report.model_dump(mode="json") if ctx.cleaned and ctx.cleaned.report else None,
        "precision": precision.model_dump(mode="json") if precision else None,
        "fallback": ctx.fallback.model_dump(mode="json") if ctx.fallback else None,
        "data": ctx.dealt.data.model_dump(mode="json"),
        "export": ctx.exported.record if ctx.exported else None,
        "notes": ctx.notes,
        "environment": {"tools": tool_versions(), "cpu": ctx.setup.cpu.record()},
        "files_sha256": {f: ctx.compiled.deployed_hashes[f] for f in [config.model_file, *config.extra_files]},
    }
    write_probe_set(ctx, staging)
    write_json(staging / "build.json", build_info)
    write_text(staging / "signoff.html", render(staging, ctx.verdict))  # from the JSON reports above and the verdict
    return f"{len(list(staging.iterdir()))} files"
