"""`--backend auto` / `--precision auto`: build every (backend, precision) pair that makes sense on
this machine, keep those that pass the gate, pick the best on the recipe's objective (latency at
batch 1, throughput at batch N, or the best throughput within a p99 budget), and report every
candidate with why it won or lost. A candidate worse than fp32 on the objective never wins.

Each candidate is an ordinary build (its own signed artifact folder); int8 candidates on different
CPU backends share one calibration through the content-keyed cache. The builds run one after another,
so the signed-off ones are then timed against each other in interleaved rounds (a runoff): on a
shared machine a build that happened to run in a busy minute would otherwise lose for that alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from accel_opt import runtime
from accel_opt.artifact.folder import write_json, write_text
from accel_opt.backends.select import auto_backend_choice, candidate_precisions
from accel_opt.bench import deployment_target, run_benchmark
from accel_opt.data import Sample
from accel_opt.errors import AccelOptError, UsageError, write_crash_log
from accel_opt.machine.cpu import available_cpus
from accel_opt.pipeline import build
from accel_opt.recipe import OBJECTIVES, BackendName, Precision, Recipe
from accel_opt.report.markdown import selection_markdown
from accel_opt.report.results import BuildResult, StageResult

log = logging.getLogger(__name__)
AUTO = "auto"


class RunoffPoint(BaseModel):
    batch_size: int
    p50_ms: float
    p99_ms: float
    throughput_per_s: float


class Candidate(BaseModel):
    backend: str
    precision: str
    why_tried: str
    signed_off: bool = False
    batch_size: int | None = None  # the target batch, or the build's largest when it could not run that
    latency_p50_ms: float | None = None  # at batch_size: from the runoff when there was one, else the build's
    build_latency_p50_ms: float | None = None  # at batch_size, measured during the candidate's own build
    throughput_per_s: float | None = None
    cosine: float | None = None  # worst output cosine vs the fp32 reference
    artifact_dir: str | None = None
    points: list[RunoffPoint] = []  # the runoff, one point per batch size the objective looks at
    objective_value: float | None = None  # ms (latency) or samples/s (throughput objectives); None: budget not met
    objective_batch: int | None = None
    verdict: str = ""  # why it won or lost


class AutoSelection(BaseModel):
    objective: str = "throughput"
    target_batch_size: int
    latency_budget_ms: float | None
    backend_reason: str
    timing: str = ""  # where the compared latencies come from
    winner: Candidate | None
    candidates: list[Candidate]

    def no_winner_reason(self) -> str | None:
        """Why nothing was chosen, in a few words (None: there is a winner)."""
        if self.winner is not None:
            return None
        if any(c.signed_off for c in self.candidates):
            return "the signed-off candidates lose on the objective"
        return "no candidate passed the gate"


def selection_report_path(out_dir: str | Path, model: str | Path, suffix: str = ".md") -> Path:
    """Where build_auto writes its selection report (`suffix` .json for the record)."""
    return Path(out_dir) / f"{Path(str(model)).stem}-auto-selection{suffix}"


def plan(recipe: Recipe, backend: str, precision: str, has_data: bool,
         torch_source: bool = False) -> tuple[list[tuple[str, str, str]], str]:
    """The (backend, precision, why) pairs to build, and the reason for the backend choice. A model given as a
    PyTorch factory (`torch_source`) also runs off on the torch backend (torch.export + AOTInductor)."""
    if backend == AUTO:
        choice = auto_backend_choice()  # TensorRT on a GPU with TensorRT, else the CPU choice
        chosen, backend_reason = choice.backend, choice.reason
        backends = [chosen] + ([BackendName.onnxruntime] if chosen is not BackendName.onnxruntime else [])
        if torch_source:
            backends.append(BackendName.torch)
            backend_reason += "; a PyTorch factory also runs off on torch (AOTInductor)"
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
    force: bool = False,
) -> tuple[BuildResult | None, AutoSelection]:
    """Build the candidates and return (the winner's BuildResult or None, the selection report)."""
    from accel_opt.backends.torch import looks_like_factory

    pairs, backend_reason = plan(recipe, backend, precision, data_dir is not None, looks_like_factory(str(model)))
    if backend == AUTO:  # ONNX Runtime on a GPU: its CUDA EP, as the choice says
        choice = auto_backend_choice()
        if choice.backend is BackendName.onnxruntime and choice.providers and choice.providers[0] != "CPUExecutionProvider":
            recipe = recipe.with_overrides(**{"onnxruntime.providers": [choice.providers[0]]})
    target = recipe.selection.target_batch_size
    budget = recipe.selection.latency_budget_ms
    results: dict[tuple[str, str], BuildResult] = {}
    candidates: list[Candidate] = []
    errors: list[BaseException] = []
    for b, p, why in pairs:
        candidate = Candidate(backend=b, precision=p, why_tried=why)
        try:
            result = build(model, recipe.with_overrides(backend=b, precision=p), data_dir=data_dir, out_dir=out_dir,
                           on_stage=on_stage, force=force)
        except UsageError:  # the command line or the recipe is wrong: no candidate will do better
            raise
        except Exception as exc:  # noqa: BLE001 - one candidate failing for any reason must not end the others
            errors.append(exc)
            candidate.verdict = f"could not build: {_failure_line(exc)}"
        else:
            results[(b, p)] = result
            at_target = next((h for h in result.headline if h.batch_size == target), result.headline[-1])
            candidate.signed_off = result.signed_off
            candidate.batch_size = at_target.batch_size
            candidate.latency_p50_ms = candidate.build_latency_p50_ms = at_target.latency_p50_ms
            candidate.throughput_per_s = at_target.throughput_per_s
            candidate.cosine = result.worst_cosine
            candidate.artifact_dir = result.artifact_dir
            if not result.signed_off:
                more = f" (+{len(result.failures) - 2} more in its signoff.md)" if len(result.failures) > 2 else ""
                candidate.verdict = "failed the gate: " + "; ".join(result.failures[:2]) + more
        candidates.append(candidate)
        if on_candidate:
            on_candidate(candidate)

    signed = [c for c in candidates if c.signed_off]
    timing = "no candidate signed off"
    if signed:
        timed = signed + speed_floors(candidates)
        timing = _runoff(timed, results[(signed[0].backend, signed[0].precision)].eval_samples, recipe)
    winner = choose(candidates, recipe.selection.objective, budget, target)
    selection = AutoSelection(objective=recipe.selection.objective, target_batch_size=target, latency_budget_ms=budget,
                              backend_reason=backend_reason, timing=timing, winner=winner, candidates=candidates)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    write_json(selection_report_path(out_dir, model, ".json"), selection)
    write_text(selection_report_path(out_dir, model), selection_markdown(Path(model).stem, selection))
    if not results and errors:  # nothing built at all: the (first) error is the answer, with its exit code
        raise errors[0]
    return (results[(winner.backend, winner.precision)] if winner else None), selection


def _failure_line(exc: BaseException) -> str:
    """A candidate's failure in one line; a bug's traceback goes to a log file named in the line."""
    if isinstance(exc, AccelOptError):
        return f"(exit {exc.exit_code}) {exc}"
    return f"(internal error, a bug: please report it) {type(exc).__name__}: {exc}; log: {write_crash_log(exc)}"


def objective_batches(objective: str, recipe: Recipe) -> list[int]:
    return {"latency": [1], "throughput": [recipe.selection.target_batch_size]}.get(
        objective, sorted(set(recipe.benchmark.batch_sizes)))


def speed_floors(candidates: list[Candidate]) -> list[Candidate]:
    """The fp32 builds that failed the gate, timed only as the speed a reduced precision must beat, when no
    fp32 build signed off: a lossy preprocessing option (draft decoding) fails every fp32 build by its tight
    tolerance, and an int8 build slower than those fp32 builds still does not pay."""
    fp32 = [c for c in candidates if c.precision == Precision.fp32.value]
    return [] if any(c.signed_off for c in fp32) else [c for c in fp32 if c.artifact_dir]


def choose(candidates: list[Candidate], objective: str, budget_ms: float | None, target: int) -> Candidate | None:
    """The winner on `objective` among the signed-off candidates with runoff points; sets every verdict.
    A candidate worse than the best fp32 candidate on the objective never wins: the best signed-off fp32
    candidate, or where none signed off, the best fp32 build timed as the floor (`speed_floors`)."""
    lower_is_better = objective == "latency"
    floors = speed_floors(candidates)
    for c in candidates:
        if not c.points or not (c.signed_off or c in floors):
            continue
        within = [p for p in c.points if budget_ms is None or p.p99_ms <= budget_ms]
        if objective == "throughput_within_p99":
            best = max(within, key=lambda p: p.throughput_per_s, default=None)
        else:
            best = next((p for p in within if p.batch_size == (1 if lower_is_better else target)), within[0] if within else None)
        if best is None:
            if c.signed_off:
                c.verdict = f"p99 {min(p.p99_ms for p in c.points):.2f} ms over the {budget_ms} ms budget at every batch"
            continue
        c.objective_batch = best.batch_size
        c.objective_value = best.p50_ms if lower_is_better else best.throughput_per_s
        c.latency_p50_ms, c.throughput_per_s, c.batch_size = best.p50_ms, best.throughput_per_s, best.batch_size

    def better(a: float, b: float) -> bool:
        return a < b if lower_is_better else a > b

    unit = "ms p50" if lower_is_better else "samples/s"
    ranked = [c for c in candidates if c.objective_value is not None and c.signed_off]
    fp32 = [c for c in candidates if c.objective_value is not None and c.precision == Precision.fp32.value]
    fp32 = [c for c in fp32 if c.signed_off] or fp32
    pick = min if lower_is_better else max
    floor = pick(fp32, key=lambda c: c.objective_value) if fp32 else None
    if floor is not None and not floor.signed_off and "speed floor" not in floor.verdict:
        floor.verdict += f" (timed as the fp32 speed floor: {floor.objective_value:.2f} {unit})"
    eligible = []
    for c in ranked:
        if floor is not None and c is not floor and c.precision != Precision.fp32.value and not better(c.objective_value, floor.objective_value):
            c.verdict = (f"not faster than fp32 on the objective: {c.objective_value:.2f} vs {floor.backend} fp32 "
                         f"{floor.objective_value:.2f} {unit}" + ("" if floor.signed_off else " (that fp32 build failed the gate)"))
        else:
            eligible.append(c)
    winner = None
    for c in eligible:
        if winner is None or better(c.objective_value, winner.objective_value):
            winner = c
    for c in eligible:
        ratio = c.objective_value / winner.objective_value
        c.verdict = (f"won: best on the objective ({OBJECTIVES[objective]}): {c.objective_value:.2f} {unit} at batch "
                     f"{c.objective_batch}" if c is winner else f"lost: {ratio:.2f}x the winner's {unit} at batch {c.objective_batch}")
    return winner


def _runoff(candidates: list[Candidate], samples: list[Sample], recipe: Recipe) -> str:
    """Time the candidates' published builds, loaded through the runtime as deployed, against each other in
    interleaved rounds at the objective's batch sizes (the same samples every build timed)."""
    threads = recipe.benchmark.threads or available_cpus()
    deployments = [runtime.load(c.artifact_dir) for c in candidates]
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
    floors = sum(not c.signed_off for c in candidates)
    return (f"one interleaved runoff of the {len(candidates) - floors} signed-off builds at batch {sizes}"
            + (f", with {floors} fp32 build(s) that failed the gate timed as the speed floor" if floors else ""))
