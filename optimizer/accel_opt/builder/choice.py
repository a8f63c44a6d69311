"""`--precision auto`'s choice among the built candidates: the objective each is timed on, the fp32 speed floors, and
`choose`, which reads held-out verdicts down the runoff's ranking at the family-wise level."""

from __future__ import annotations

from accel_opt.accuracy.evidence import DEFAULT_CONFIDENCE
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.stages import OBJECTIVES
from accel_opt.report.selection import Candidate


def objective_batches(objective: str, recipe: Recipe) -> list[int]:
    return {"latency": [1], "throughput": [recipe.selection.target_batch_size]}.get(
        objective, sorted(set(recipe.benchmark.batch_sizes)))


def speed_floors(candidates: list[Candidate]) -> list[Candidate]:
    """The fp32 builds that failed the gate, timed only as the speed a reduced precision must beat, when no
    fp32 build signed off: a lossy preprocessing option (draft decoding) fails every fp32 build by its tight
    tolerance, and an int8 build slower than those fp32 builds still does not pay."""
    fp32 = [c for c in candidates if not c.reduced]
    return [] if any(c.signed_off for c in fp32) else [c for c in fp32 if c.artifact_dir]


def family_level(confidence: float, candidates: list[Candidate]) -> float:
    """The level each reduced candidate's held-out verdict is read at: 1 - (1 - confidence) / k, k the reduced
    candidates auto planned (Bonferroni), fixed before any verdict is read, so the winner's verdict holds at
    `confidence` whichever candidate it is and whatever the verdicts read before it said."""
    return 1 - (1 - confidence) / max(sum(c.reduced for c in candidates), 1)


def choose(candidates: list[Candidate], objective: str, budget_ms: float | None, target: int,
           confidence: float = DEFAULT_CONFIDENCE) -> Candidate | None:
    """The winner on `objective`, with every verdict set. The candidates timed in the runoff (those with points) are
    ranked on the objective; a reduced one not better than the best fp32 candidate never wins (the best signed-off
    fp32 build, or where none signed off, the best fp32 build timed as the floor: `speed_floors`). Down that ranking,
    each reduced candidate's held-out verdict is read at the family-wise level (family_level: k is every reduced
    candidate planned), and the first that passes wins; an fp32 build wins if it signed off."""
    lower_is_better = objective == "latency"
    floors = speed_floors(candidates)
    for c in candidates:
        if not c.points:
            continue
        within = [p for p in c.points if budget_ms is None or p.p99_ms <= budget_ms]
        if objective == "throughput_within_p99":
            best = max(within, key=lambda p: p.throughput_per_s, default=None)
        else:
            best = next((p for p in within if p.batch_size == (1 if lower_is_better else target)),
                        within[0] if within else None)
        if best is None:
            c.verdict = f"p99 {min(p.p99_ms for p in c.points):.2f} ms over the {budget_ms} ms budget at every batch"
            continue
        c.objective_batch = best.batch_size
        c.objective_value = best.p50_ms if lower_is_better else best.throughput_per_s
        c.latency_p50_ms, c.throughput_per_s, c.batch_size = best.p50_ms, best.throughput_per_s, best.batch_size

    def better(a: float, b: float) -> bool:
        return a < b if lower_is_better else a > b

    unit = "ms p50" if lower_is_better else "samples/s"
    valued = [c for c in candidates if c.objective_value is not None]
    fp32 = [c for c in valued if not c.reduced and c.signed_off] or [c for c in valued if c in floors]
    pick = min if lower_is_better else max
    floor = pick(fp32, key=lambda c: c.objective_value) if fp32 else None
    if floor is not None and not floor.signed_off and "speed floor" not in floor.verdict:
        floor.verdict += f" (timed as the fp32 speed floor: {floor.objective_value:.2f} {unit})"
    ranked = []
    for c in valued:
        if not c.reduced:
            if c.signed_off:
                ranked.append(c)
        elif floor is not None and not better(c.objective_value, floor.objective_value):
            c.verdict = (f"not faster than fp32 on the objective: {c.objective_value:.2f} vs {floor.backend} fp32 "
                         f"{floor.objective_value:.2f} {unit}" + ("" if floor.signed_off
                                                                  else " (that fp32 build failed the gate)"))
        else:
            ranked.append(c)
    ranked.sort(key=lambda c: c.objective_value, reverse=not lower_is_better)
    readable = sum(c.reduced for c in candidates)  # planned, not those left after earlier verdicts
    family = family_level(confidence, candidates)
    winner = None
    for c in ranked:
        if not c.reduced:
            winner = c
            break
        if c.benefit is not None and not c.benefit.passed:  # its own verdict: runtime.load would refuse its folder
            c.verdict = f"no measured benefit in its own build: {c.benefit.line()}"
            continue
        c.family_confidence = family
        held_out = c.held_out_at(family)
        if held_out == "pass":
            winner = c
            break
        level = (f"{family:.2%} ({confidence:.0%} family-wise over {readable} planned)" if readable > 1
                 else f"{family:.0%}")
        c.verdict = (f"fastest left, but its held-out verdict at {level} is "
                     + {"fail": "a failure", "insufficient": "not enough evidence"}[held_out]
                     + (f": {'; '.join(r.line() for r in c.rates if r.status_at(family) != 'pass')[:300]}"
                        if c.rates else ""))
    for c in ranked:
        if c is winner:
            c.verdict = (f"won: best on the objective ({OBJECTIVES[objective]}): {c.objective_value:.2f} {unit} at "
                         "batch "
                         f"{c.objective_batch}" + (f"; held-out verdict passes at {c.family_confidence:.2%}"
                                                   if c.family_confidence and readable > 1 else "")
                         + (f"; benefit: {c.benefit.line()}" if c.benefit is not None else ""))
        elif winner is not None and not c.verdict.startswith("fastest left"):
            ratio = c.objective_value / winner.objective_value
            c.verdict = f"lost: {ratio:.2f}x the winner's {unit} at batch {c.objective_batch}"
    return winner
