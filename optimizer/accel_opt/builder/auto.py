"""`--backend auto` / `--precision auto`: build every (backend, precision) pair that makes sense on this machine, within
one time budget for the whole run, and ship the fastest build whose held-out verdict holds.

The choice is made without looking at the held-out samples, then the verdict is looked at once per choice:
1. Each candidate is an ordinary build (its own folder, its own sign-off on the held-out samples), fp32 first: they
   are the speed floors, cost no search, and tell how long a build takes here. Every candidate of one run is steered by
   the same steering samples (data.split_roles), int8 candidates share one calibration (the content-keyed cache), and
   the reference runs once per sample for all of them (accuracy.run.ReferenceCache).
2. The shortlist is made on the steering samples only: a candidate whose deployed build fails the gate there, aimed
   at what the held-out samples can certify (accuracy.metrics.aimed_gate), is out. The shortlisted builds are timed
   against each other in interleaved rounds (a runoff), since on a shared machine a build that happened to run in a
   busy minute would otherwise lose for that alone; a candidate not faster than fp32 on the objective never wins.
3. In the runoff's order, each shortlisted reduced candidate's held-out verdict is read until one passes. Reading
   several verdicts is several chances to pass by luck, so each is judged at the family-wise level 1 - (1 - c) / k
   for the k candidates that may be read (Bonferroni): the winner holds at the recipe's confidence c. When none
   passes, the fastest signed-off fp32 build wins.

The time budget (selection.time_budget_s, --time-budget) covers every build. Reduced candidates get the time left
after what a build costs here (measured on the fp32 builds), shared by their promise on this CPU; a candidate whose
held-out samples cannot certify it, whose first measurement is far outside what a rescue recovers, or which even
fully rescued could not beat a build already signed off is dropped with its reason (errors.CandidateDropped). What
the budget left untried is said. Every stage and search step is reported as progress with the time left.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from accel_opt import runtime
from accel_opt.accuracy import AccuracyReport
from accel_opt.artifact.signing import Signer, TrustPolicy
from accel_opt.backends.select import auto_backend_choice, candidate_precisions
from accel_opt.bench import deployment_target, run_benchmark
from accel_opt.builder.checks import refuse_oversubscribed_threads
from accel_opt.builder.choice import choose, family_level, objective_batches, speed_floors
from accel_opt.builder.context import CandidateLimits
from accel_opt.builder.pipeline import build
from accel_opt.data import Sample
from accel_opt.errors import AccelOptError, CandidateDropped, TooFewToCertify, UsageError, write_crash_log
from accel_opt.files import write_json, write_text
from accel_opt.machine.cpu import CpuProfile, available_cpus
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.types import BackendName, Precision
from accel_opt.report.markdown import selection_markdown
from accel_opt.report.results import BuildResult, StageResult
from accel_opt.report.selection import AutoSelection, Candidate, ProgressEvent, RunoffPoint

log = logging.getLogger(__name__)
AUTO = "auto"
# Promise of a reduced candidate on this CPU, for sharing the search's time: where the hardware has the instructions
# for it, int8 and bf16 ran 2.2-9x fp32 here (ResNet-50, AMX/VNNI); without VNNI, int8 was no faster than fp32.
PROMISE_FAST, PROMISE_SLOW = 2.0, 1.0


def selection_report_path(out_dir: str | Path, model: str | Path, suffix: str = ".md") -> Path:
    """Where build_auto writes its selection report (`suffix` .json for the record)."""
    return Path(out_dir) / f"{Path(str(model)).stem}-auto-selection{suffix}"


def plan(recipe: Recipe, backend: str, precision: str, has_data: bool, cpu: CpuProfile,
         torch_source: bool = False) -> tuple[list[tuple[str, str, str]], str]:
    """The (backend, precision, why) pairs to build on the CPU `cpu`, and the reason for the backend choice. A model
    given as a PyTorch factory (`torch_source`) also runs off on the torch backend (torch.export + AOTInductor)."""
    if backend == AUTO:
        choice = auto_backend_choice(cpu)  # TensorRT on a GPU with TensorRT, else the CPU choice
        chosen, backend_reason = choice.backend, choice.reason
        backends = [chosen] + ([BackendName.onnxruntime] if chosen is not BackendName.onnxruntime else [])
        if torch_source:
            backends.append(BackendName.torch)
            backend_reason += "; a PyTorch factory also runs off on torch (AOTInductor)"
    else:
        backends, backend_reason = [BackendName(backend)], "given on the command line or in the recipe"
    pairs = []
    for b in backends:
        options = candidate_precisions(b, cpu) if precision == AUTO else [(Precision(precision), "given")]
        for p, why in options:
            if p is Precision.int8 and not has_data:
                log.warning("skipping int8 on %s: calibration needs --data", b.value)
                continue
            pairs.append((b.value, p.value, why))
    return pairs, backend_reason


def build_order(pairs: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """fp32 builds first (the speed floors: no search, and they measure what a build costs here), then the rest in
    the plan's order."""
    return sorted(pairs, key=lambda pair: pair[1] != Precision.fp32.value)


def promise(precision: str, cpu: CpuProfile) -> float:
    """How much of the search's time a reduced candidate gets on `cpu`, relative to the others (see PROMISE_FAST)."""
    fast = {"int8": cpu.int8_dot_products, "bf16": cpu.native_bf16, "fp16": cpu.native_fp16}.get(precision, False)
    return PROMISE_FAST if fast else PROMISE_SLOW


class _Clock:
    """The run's time budget and its progress record."""

    def __init__(self, budget_s: float | None, on_progress: Callable[[ProgressEvent], None] | None,
                 now: Callable[[], float] = time.monotonic):
        self.now = now  # seconds (injected by tests)
        self.started, self.budget_s, self.on_progress = now(), budget_s, on_progress
        self.events: list[ProgressEvent] = []

    @property
    def elapsed(self) -> float:
        return self.now() - self.started

    @property
    def remaining(self) -> float | None:
        return None if self.budget_s is None else max(0.0, self.budget_s - self.elapsed)

    def say(self, candidate: str, step: str, detail: str) -> None:
        event = ProgressEvent(elapsed_s=round(self.elapsed, 1), remaining_s=None if self.remaining is None else
                              round(self.remaining, 1), candidate=candidate, step=step, detail=detail)
        self.events.append(event)
        if self.on_progress is not None:
            self.on_progress(event)


def build_auto(
    model: str | Path,
    recipe: Recipe,
    backend: str,
    precision: str,
    data_dir: str | Path | None,
    out_dir: str | Path = "artifacts",
    on_candidate: Callable[[Candidate], None] | None = None,
    on_progress: Callable[[ProgressEvent], None] | None = None,
    force: bool = False,
    eval_data_dir: str | Path | None = None,
    cpu: CpuProfile | None = None,
    signer: Signer | None = None,
    task: str | None = None,
    export_hints: dict | None = None,
) -> tuple[BuildResult | None, AutoSelection]:
    """Build the candidates within the time budget and return (the winner's BuildResult or None, the selection).
    `cpu`: the CPU every class-dependent choice is made for (this machine's, read here, by default); `task` and
    `export_hints` pass to every candidate's build (pipeline.build)."""
    from accel_opt.backends.torch.factory import looks_like_factory

    cpu = cpu or CpuProfile.here()
    refuse_oversubscribed_threads(recipe.benchmark.threads)
    pairs, backend_reason = plan(recipe, backend, precision, data_dir is not None or eval_data_dir is not None,
                                 cpu, looks_like_factory(str(model)))
    if backend == AUTO:  # ONNX Runtime on a GPU: its CUDA EP, as the choice says
        choice = auto_backend_choice(cpu)
        if (choice.backend is BackendName.onnxruntime and choice.providers
                and choice.providers[0] != "CPUExecutionProvider"):
            recipe = recipe.with_overrides(**{"onnxruntime.providers": [choice.providers[0]]})
    selection_config = recipe.selection
    target = selection_config.target_batch_size
    clock = _Clock(selection_config.time_budget_s, on_progress)
    results: dict[tuple[str, str], BuildResult] = {}
    candidates = [Candidate(backend=b, precision=p, why_tried=why) for b, p, why in build_order(pairs)]
    family, family_size = family_level(recipe.accuracy.confidence, candidates), sum(c.reduced for c in candidates)
    family_note = (f"Held-out verdict judged at {family:.2%} confidence: {recipe.accuracy.confidence:.0%} family-wise "
                   f"over the {family_size} reduced candidates --precision auto planned (Bonferroni), fixed before any "
                   "verdict was read.") if family_size > 1 else ""
    errors: list[BaseException] = []
    untried: list[str] = []
    references: dict = {}  # the reference's outputs, run once per sample for every candidate (pipeline.build)
    for number, candidate in enumerate(candidates, start=1):
        tag = f"{candidate.label} ({number}/{len(candidates)})"
        left_out = _out_of_time(candidate, candidates, clock)
        if left_out:
            candidate.verdict = left_out
            untried.append(f"{candidate.label}: {left_out}")
            clock.say(tag, "skipped", left_out)
            if on_candidate:
                on_candidate(candidate)
            continue
        limits = _limits(candidate, candidates, clock, tag, recipe, cpu, family_note) if candidate.reduced else None
        started = time.monotonic()
        stages: list[StageResult] = []

        def staged(stage: StageResult, tag=tag, stages=stages) -> None:
            stages.append(stage)
            mark = {"passed": "ok", "failed": "FAILED", "skipped": "skipped"}[stage.status]
            clock.say(tag, stage.name, f"{mark} in {stage.seconds:.1f} s: {stage.detail}")

        try:
            # A reduced candidate's own gate judges at the family-wise level: its signoff.md, JUnit and manifest.json
            # state the level auto reads its verdict at.
            level = {"accuracy.confidence": family} if candidate.reduced and family_size > 1 else {}
            result = build(model, recipe.with_overrides(backend=candidate.backend,
                                                        precision=candidate.precision, **level),
                           data_dir=data_dir, out_dir=out_dir, on_stage=staged, force=force,
                           eval_data_dir=eval_data_dir, limits=limits, reference_caches=references, cpu=cpu,
                           signer=signer, task=task, export_hints=export_hints)
        except UsageError:  # the command line or the recipe is wrong: no candidate will do better
            raise
        except CandidateDropped as exc:
            candidate.verdict = f"dropped: {exc}"
            if isinstance(exc, TooFewToCertify):
                candidate.samples_needed, candidate.data_samples_needed = exc.samples_needed, exc.data_samples_needed
        except Exception as exc:  # noqa: BLE001 - one candidate failing for any reason must not end the others
            errors.append(exc)
            candidate.verdict = f"could not build: {_failure_line(exc)}"
        else:
            results[(candidate.backend, candidate.precision)] = result
            _fill(candidate, result, target)
        candidate.seconds = round(time.monotonic() - started, 1)
        candidate.stage_seconds = {s.name: round(s.seconds, 1) for s in stages}
        clock.say(tag, "done", candidate.verdict or ("signed off" if candidate.signed_off else "built"))
        if on_candidate:
            on_candidate(candidate)

    timed = [c for c in candidates if c.artifact_dir and c.steering_passed is not False
             and (c.reduced or c.signed_off)] + speed_floors(candidates)
    timing = "no candidate passed on the steering samples"
    if timed:
        timing = _runoff(timed, results[(timed[0].backend, timed[0].precision)].timed_samples, recipe, cpu)
    winner = choose(candidates, selection_config.objective, selection_config.latency_budget_ms, target,
                    recipe.accuracy.confidence)
    selection = AutoSelection(objective=selection_config.objective, target_batch_size=target,
                              latency_budget_ms=selection_config.latency_budget_ms, backend_reason=backend_reason,
                              timing=timing, confidence=recipe.accuracy.confidence,
                              time_budget_s=selection_config.time_budget_s, seconds=round(clock.elapsed, 1),
                              untried=untried, winner=winner, candidates=candidates, progress=clock.events)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    write_json(selection_report_path(out_dir, model, ".json"), selection)
    write_text(selection_report_path(out_dir, model), selection_markdown(Path(model).stem, selection))
    if not results and errors:  # nothing built at all: the (first) error is the answer, with its exit code
        raise errors[0]
    return (results[(winner.backend, winner.precision)] if winner else None), selection


def _fill(candidate: Candidate, result: BuildResult, target: int) -> None:
    """The candidate's record from its finished build: its held-out verdict with the rates behind it, its steering
    verdict, its speed in its own build."""
    accuracy = AccuracyReport.model_validate_json((Path(result.artifact_dir) / "accuracy.json").read_text())
    at_target = next((h for h in result.headline if h.batch_size == target), result.headline[-1])
    candidate.signed_off = result.signed_off
    candidate.held_out = accuracy.verdict
    if accuracy.verdict == "insufficient":
        candidate.samples_needed, candidate.data_samples_needed = result.samples_needed, result.data_samples_needed
    # Its own verdict's checks only: what the recipe reports but does not gate (agreement under accuracy.labels.gate:
    # labels) never decides a selection.
    gated = [c for c in accuracy.checks if c.gated]
    candidate.rates = [c.evidence for c in gated if c.evidence is not None and c.labeled is None]
    candidate.labeled = [c.labeled for c in gated if c.labeled is not None]
    # The benchmark gate's failures are not rates: they are the verdict's reasons beyond the accuracy gate's (a missing
    # benefit is read on its own, candidate.benefit).
    bench_failed = result.verdict.outcome == "gate failed" and len(result.verdict.reasons) > len(accuracy.failures)
    candidate.checks_passed = all(c.passed for c in gated if c.evidence is None
                                  and c.labeled is None) and not bench_failed
    candidate.benefit = result.verdict.benefit
    if accuracy.steering is not None:
        candidate.steering_passed, candidate.steering_loss = accuracy.steering.passed, accuracy.steering.loss
    candidate.samples = accuracy.roles
    candidate.batch_size = at_target.batch_size
    candidate.latency_p50_ms = candidate.build_latency_p50_ms = at_target.latency_p50_ms
    candidate.throughput_per_s = at_target.throughput_per_s
    candidate.cosine = result.worst_cosine
    candidate.artifact_dir = result.artifact_dir
    if candidate.steering_passed is False:
        why = accuracy.steering.failures[:2]
        candidate.verdict = "failed on the steering samples: " + ("; ".join(why) or "the gate")
    elif not result.signed_off and not candidate.reduced:
        more = f" (+{len(result.failures) - 2} more in its signoff.md)" if len(result.failures) > 2 else ""
        candidate.verdict = "failed the gate: " + "; ".join(result.failures[:2]) + more


def _out_of_time(candidate: Candidate, candidates: list[Candidate], clock: _Clock) -> str | None:
    """Why `candidate` is not started: the budget left is less than a build costs here (the fp32 builds' mean time;
    the first build always starts)."""
    built = [c.seconds for c in candidates if c.seconds and not c.reduced]
    if clock.remaining is None or not built:
        return None
    cost = sum(built) / len(built)
    if clock.remaining >= cost:
        return None
    return (f"not tried: the time budget ran out ({clock.remaining:.0f} s left of {clock.budget_s:.0f} s; a build "
            f"takes about {cost:.0f} s here)")


def _limits(candidate: Candidate, candidates: list[Candidate], clock: _Clock, tag: str,
            recipe: Recipe, cpu: CpuProfile, family_note: str = "") -> CandidateLimits:
    """A reduced candidate's share of the time left for its search, and what it must beat."""
    configured = recipe.precision_options.fallback.time_budget_s
    pending = [c for c in candidates if c.reduced and not c.seconds and not c.verdict]
    built = [c.seconds for c in candidates if c.seconds and not c.reduced]
    fixed = sum(built) / len(built) if built else 0.0  # what each pending build costs besides its search
    share = promise(candidate.precision, cpu) / sum(promise(c.precision, cpu) for c in pending)
    search_budget = configured if clock.remaining is None else \
        min(configured, max(0.0, (clock.remaining - fixed * len(pending)) * share))
    candidate.search_budget_s = round(search_budget, 1)
    signed = [c for c in candidates if c.signed_off and c.throughput_per_s and c.steering_passed is not False]
    best = max(signed, key=lambda c: c.throughput_per_s, default=None)
    fp32 = next((c for c in candidates if c.backend == candidate.backend and not c.reduced
                 and c.throughput_per_s), None)

    def on_step(step) -> None:
        clock.say(tag, "search", f"step {step.step} {step.kind}: {step.what}"
                  + (f", loss {step.loss:.3g}" if step.loss is not None else "")
                  + (f", {step.speedup:.2f}x fp32" if step.speedup is not None else "")
                  + (f": {step.decision}" if step.decision else ""))

    return CandidateLimits(label=candidate.label, search_budget_s=search_budget,
                           beat_per_s=best.throughput_per_s if best else None, beat_label=best.label if best else "",
                           fp32_per_s=fp32.throughput_per_s if fp32 else None, on_step=on_step,
                           family_note=family_note)


def _failure_line(exc: BaseException) -> str:
    """A candidate's failure in one line; a bug's traceback goes to a log file named in the line."""
    if isinstance(exc, AccelOptError):
        return f"(exit {exc.exit_code}) {exc}"
    return f"(internal error, a bug: please report it) {type(exc).__name__}: {exc}; log: {write_crash_log(exc)}"


def _runoff(candidates: list[Candidate], samples: list[Sample], recipe: Recipe, cpu: CpuProfile) -> str:
    """Time the candidates' published builds, loaded through the runtime as deployed, against each other in
    interleaved rounds at the objective's batch sizes (the same samples every build timed)."""
    threads = recipe.benchmark.threads or available_cpus()
    # Folders this build published moments ago, under its own --out: its own native code, trusted as such. Timed
    # whatever their verdicts (a held-out verdict is read only down the ranking; an fp32 floor failed its gate); the
    # winner is one whose own verdict signed it off (choice.choose).
    deployments = [runtime.load(c.artifact_dir, cpu=cpu, trust=TrustPolicy(trust_unsigned=True),
                                allow_not_signed_off=True)
                   for c in candidates]
    for deployment in deployments:  # timed, not shipped: the selection report gives each candidate's verdict
        deployment.said_not_signed_off = True
    batches = objective_batches(recipe.selection.objective, recipe)
    if not deployments[0].config.batch_dynamic:
        batches = [deployments[0].batch_size]
    if deployments[0].padding is not None:  # texts: timed batches take one shape
        samples = deployments[0].padding.same_length(samples)
    targets = [deployment_target(d, runtime.feed_dtypes_of(samples)) for d in deployments]
    bench = run_benchmark(targets, samples, batches, recipe.benchmark, threads, deployments[0].batch_axes)
    for c, timed in zip(candidates, bench.models, strict=True):
        c.points = [RunoffPoint(batch_size=b.batch_size, p50_ms=b.latency.p50_ms, p99_ms=b.latency.p99_ms,
                                throughput_per_s=b.throughput_per_s) for b in timed.batches]
    sizes = ", ".join(map(str, batches))
    floors = sum(not c.reduced and not c.signed_off for c in candidates)
    return (f"one interleaved runoff of the {len(candidates) - floors} builds that passed on the steering samples at "
            f"batch {sizes}" + (f", with {floors} fp32 build(s) that failed the gate timed as the speed floor"
                                if floors else ""))
