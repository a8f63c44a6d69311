"""The rescue of a reduced-precision build that fails its steering samples: a search, judged on the task, paid for in
speed.

Ranking layers by the error each adds in isolation does not say what restores the output (measured: a trained
mobile classifier's int8 fallback kept every block's worst-ranked 1x1 projection in fp32, 25% of the FLOPs, and the
steering samples' cosine went from 0.9859 to 0.9855). So every decision here is measured, cheapest remedy first:

1. Speed first: the naive build is timed against the same backend's fp32 build on the deployed kernels. If it is
   not `min_speedup` faster, no rescue can make it pay, and the search says so instead of spending its budget.
2. Remedies that keep every layer reduced, one build each (precision/remedies.py, planned cheapest first by their
   estimates from the model's size): the weights' granularity flipped, Relu/Clip kept explicit, bias correction (each
   bias absorbs the mean shift of its rounded weights), moving-average, percentile or entropy calibration of the
   activations, on the OpenVINO backend NNCF's quantizer of the OpenVINO model (alone, with SmoothQuant, with
   ChannelAlignment: another quantizer, tried instead of the remedies adopted, its IR shipped if it is better), then
   AdaRound (each layer's weights rounded to fit the float model's output; minutes) and the weight fit
   (quantization-aware distillation of the int8 weights to the float model's outputs; minutes). A remedy that makes
   the build better (`better`: passing, else fewer changed predictions, else a lower numeric error on every steering
   sample) is adopted and the next is tried on top of it; what is adopted is the base of what follows. One starts
   only where its estimate, scaled by how the builds before it ran against theirs, fits the budget left; AdaRound's
   and the weight fit's own loops get what is left and stop there with what they have. One that needs a missing
   package is recorded as skipped, with the install line; one whose build fails (NNCF's own error) as not better.
3. The gain of each unit (a group of same-shaped layers: the same layer of every repeated block; or the network's
   tail, its last few layers, measured first) measured when it alone is restored to float with everything else
   reduced: one build per unit (the worst `max_measured_units` by the diagnosis when there are more). Once a unit
   gains, measuring stops where the budget left would no longer cover adding one (a build and its timing, twice).
4. Units added in the order of their measured gain (those that pass alone first, fewest FLOPs first), each kept only
   if it lowers the loss, each timed: a unit that would take the build below `min_speedup` is not added, and the search
   stops there.
5. Once units are restored, every adopted remedy is tried without: one that helped the all-reduced build may stand in
   the way once a layer is restored, and is dropped where the build is better without it (`better` again; remedies
   cost no speed, so one that still helps stays). Once the steering samples pass, every kept unit is tried without
   (least gain first): what the steering samples pass without is dropped.

The loss is how far the steering samples are from passing, in units of each threshold: the largest of each output's
error, worst-sample error, cosine and gain shortfall, and each task metric's (top-k agreement, detection recall,
embedding cosine) against its limit; at most 1 passes. The task metric therefore decides as much as the tensors do.
Every build, measure and decision is a step of the report, with its loss, gain, speed and seconds, so a reviewer can
replay the search. A wall-clock budget (`time_budget_s`) bounds it: checked before each build, and inside the long
remedies' loops, so the search ends at most one step past it."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from accel_opt.files import progress
from accel_opt.precision.callbacks import SearchActions
from accel_opt.precision.remedies import Planned


@dataclass
class Unit:
    """What the search restores at once: the same layer of every repeated block (op and weight shape), or the
    network's tail (its last layers, whatever their shapes)."""

    key: str  # "Conv 32x1x3x3", "the last 10 of 50 layers"
    nodes: list[str]
    flops: int = 0
    added_error: float = 0.0  # the diagnosis's sum over its nodes: only to choose which units to measure
    tail: bool = False

    @property
    def label(self) -> str:
        return self.key if self.tail else f"{self.key} ({len(self.nodes)} layer{'s' if len(self.nodes) > 1 else ''})"


def tail_units(layers: Sequence[str], sizes: Sequence[int], flops: dict[str, int] | None = None) -> list[Unit]:
    """The network's last `k` weighted layers (`layers` in graph order), one unit for each k of `sizes` up to a
    quarter of them (a head, not a section of the network). Keeping the last layers in higher precision is a common
    remedy, and no group of same-shaped layers covers it: a repeated block's layers are spread over the network, the
    head is not. Measured, not assumed: on a trained EfficientNet-Lite0 with OpenVINO (AVX-512 VNNI), its last 10 of
    50 layers in float changed 4 held-out top-1 answers of 144 against the all-int8 build's 6 (within chance), and on
    the search's 32 steering samples neither tail gained."""
    flops = flops or {}
    return [Unit(key=f"the last {k} of {len(layers)} layers", nodes=list(layers[-k:]), tail=True,
                 flops=sum(flops.get(n, 0) for n in layers[-k:]))
            for k in sorted(set(sizes)) if 0 < k <= len(layers) // 4]


class SearchStep(BaseModel):
    """One decision of the search: what was built or timed, what it showed, what was done with it."""

    step: int
    kind: Literal["speed", "remedy", "calibration", "measure", "add", "drop", "stop"]  # "calibration": older folders
    what: str
    loss: float | None = None  # the steering samples' loss of this build (<= 1 passes)
    gain: float | None = None  # the loss it took away, against the build it was compared with
    passed: bool | None = None
    speedup: float | None = None  # against the same backend's fp32 build, on the deployed kernels
    seconds: float = 0.0
    decision: str = ""


@dataclass
class Build:
    path: Path
    loss: float
    passed: bool
    failures: list[str]
    worst_cosine: float
    output_loss: float | None = None  # the outputs' numeric part of `loss`: continuous
    # the steering samples whose task outcome changed (None: no metric counts them)
    changed: frozenset[str] | None = None


# The share of the budget left that a long remedy's own loop may take (AdaRound's layers, the weight fit's steps): the
# rest finishes its build and judges it.
LOOP_SHARE = 0.9


def better(tried: Build, base: Build) -> tuple[bool, str]:
    """Whether `tried` is a better build than `base` on the same steering samples, and on what. Passing beats failing;
    then the verdict's own measure, the task outcome: a build that changes more steering predictions is worse, one that
    changes fewer better, whatever their numeric errors; the outputs' numeric loss ranks only where the counts tie.
    (The committed OpenVINO search on EfficientNet-Lite0 adopted AdaRound on its lower output error while its changed
    predictions went 1 -> 3: the numeric tie-break moved the held-out verdict's measure the wrong way.) The paired
    sign test's p-value on the samples that changed in one build alone says how much the count difference is worth.
    Without those measures: the loss."""
    if tried.passed != base.passed:
        return tried.passed, "passes" if tried.passed else "fails"
    if tried.changed is None or base.changed is None or tried.output_loss is None or base.output_loss is None:
        return tried.loss < base.loss, f"loss {base.loss:.3g} -> {tried.loss:.3g}"
    from scipy.stats import binomtest

    only_tried, only_base = len(tried.changed - base.changed), len(base.changed - tried.changed)
    counts = f"changed predictions {len(base.changed)} -> {len(tried.changed)}"
    if only_tried != only_base:
        p_value = binomtest(only_tried, only_tried + only_base).pvalue
        return only_tried < only_base, f"{counts} (sign test p = {p_value:.2g})"
    return (tried.output_loss < base.output_loss,
            f"{counts}; output error {base.output_loss:.3g} -> {tried.output_loss:.3g} of its limit")


@dataclass
class SearchResult:
    status: Literal["rescued", "budget exhausted", "no speed-up", "time budget", "cannot win"]
    reason: str
    best: Build
    kept_units: list[Unit]  # restored to float, unit by unit (a tail and a group may share a node)
    remedies: dict[str, dict[str, object]]  # adopted: name -> the recipe keys it sets
    steps: list[SearchStep] = field(default_factory=list)
    gains: dict[str, float] = field(default_factory=dict)  # unit label -> measured gain

    @property
    def kept(self) -> list[str]:
        """The nodes restored to float, each once."""
        return _nodes(self.kept_units)


def search(naive: Build, units: Sequence[Unit], actions: SearchActions, work: Path, *, time_budget_s: float,
           min_speedup: float, max_additions: int, remedies: Sequence[Planned] = (),
           max_flops_fraction: float = 1.0, total_flops: int = 1,
           cannot_win: Callable[[float | None], str | None] | None = None,
           on_step: Callable[[SearchStep], None] | None = None,
           clock: Callable[[], float] = time.monotonic) -> SearchResult:
    """Search for a passing build from the failing `naive` one (see the module's docstring). `remedies`: tried in
    their order (remedies.plan: cheapest first). `cannot_win`: given the naive build's speed-up, why no rescue of it
    could win (auto's other candidates); the search then stops there. `on_step`: called with every step as it is
    recorded (the live progress line). `clock`: seconds, what the budget is read on (injected by tests)."""
    deadline = clock() + time_budget_s
    steps: list[SearchStep] = []

    def record(kind, what, build: Build | None = None, gain=None, speedup=None, started=None,
               decision="") -> SearchStep:
        step = SearchStep(step=len(steps) + 1, kind=kind, what=what, loss=build.loss if build else None, gain=gain,
                          passed=build.passed if build else None, speedup=speedup, decision=decision,
                          seconds=round(clock() - started, 2) if started else 0.0)
        steps.append(step)
        progress.info("step %d: %s %s%s (%.0f s of %.0f s left)", step.step, kind, what,
                      f": {decision}" if decision else "", max(0.0, deadline - clock()), time_budget_s)
        if on_step is not None:
            on_step(step)
        return step

    def out_of_time() -> bool:
        return clock() >= deadline

    def result(status, reason, best, kept, adopted, gains=None) -> SearchResult:
        record("stop", status, decision=reason)
        return SearchResult(status, reason, best, list(kept), dict(adopted), steps, gains or {})

    started = clock()
    speed = actions.speedup(naive.path)
    timing_s = clock() - started  # what timing a build takes: every unit added is timed
    record("speed", "the naive build against fp32", naive, speedup=speed, started=started,
           decision="not timed here: the build's benchmark times the result" if speed is None else
           "fast enough to search" if speed >= min_speedup else "too slow to rescue")
    if speed is not None and speed < min_speedup:
        return result("no speed-up", f"the naive build runs {speed:.2f}x the fp32 build's speed on this machine's "
                      f"kernels (the search needs >= {min_speedup:.2f}x): keeping layers in float only slows it "
                      "further, so nothing was searched", naive, [], {})
    why = cannot_win(speed) if cannot_win is not None else None
    if why:
        return result("cannot win", why, naive, [], {})

    base, adopted = naive, {}
    remedy_seconds: dict[str, float] = {}  # what each remedy's build took: what a build relearning it will take again
    # How long the remedies' builds took against their estimates (measured on another host, for another model): the
    # median scales the estimates of those still to come.
    host_ratios: list[float] = []
    for remedy in remedies:  # 2. remedies on the whole graph, each on top of those adopted before it
        if out_of_time():
            return result("time budget", f"the {time_budget_s:.0f} s budget ran out trying remedies", base, [], adopted)
        if remedy.unavailable:
            record("remedy", remedy.name, decision=f"skipped: {remedy.unavailable}")
            continue
        left_s = deadline - clock()
        expected_s = remedy.estimate_s * (statistics.median(host_ratios) if host_ratios else 1.0)
        if expected_s > left_s:
            record("remedy", remedy.name, decision=f"skipped: ~{expected_s:.0f} s estimated, {left_s:.0f} s of the "
                   "budget left")
            continue
        own = dict(remedy.overrides)
        if remedy.budget_key and remedy.budget_s is not None and LOOP_SHARE * left_s < remedy.budget_s:
            own[remedy.budget_key] = round(max(1.0, LOOP_SHARE * left_s))  # its loop stops with what it has
        started = clock()
        # A remedy that sets the keys of one adopted before (another calibration method) replaces it.
        trial = {n: o for n, o in adopted.items() if not o.keys() & own.keys()} | {remedy.name: own}
        tried = actions.build_and_judge([], work / f"remedy-{len(steps)}.onnx", _merged(trial))
        adopt, why = better(tried, base)
        if tried.loss == math.inf and tried.failures:  # not built (NNCF's own error): say why
            why = tried.failures[0]
        remedy_seconds[remedy.name] = clock() - started
        host_ratios.append(remedy_seconds[remedy.name] / max(remedy.estimate_s, 0.5))
        record("remedy", remedy.name + _alongside(trial, adopted, remedy.name), tried,
               gain=base.loss - tried.loss, started=started, decision=("adopted: " if adopt else "not better: ") + why)
        if adopt:
            base, adopted = tried, trial
        if tried.passed:
            return result("rescued",
                          f"the steering samples pass with every layer reduced, with {' and '.join(adopted)}", tried,
                          [], adopted)
    overrides = _merged(adopted) or None

    gains: dict[str, float] = {}
    measured: list[tuple[float, Unit, bool]] = []  # gain, unit, whether it passes alone
    reserve_s = 0.0  # what adding a measured unit takes (a build and its timing), twice: kept from measuring
    for unit in units:  # 3. what restoring each unit alone gains, everything else reduced
        if out_of_time():
            break
        left_s = deadline - clock()
        if left_s < reserve_s and any(gain > 0 for gain, _, _ in measured):
            # Measured on EfficientNet-Lite0: AdaRound left 195 s, measuring all 31 units took them, 24 of which
            # passed alone, and the search ended with none added.
            record("measure", f"the other {len(units) - len(measured)} unit(s)", decision=f"skipped: {left_s:.0f} s "
                   f"of the budget left, kept to add what was measured (~{reserve_s / 2:.0f} s a unit)")
            break
        started = clock()
        alone = actions.build_and_judge(unit.nodes, work / f"measure-{len(steps)}.onnx", overrides)
        reserve_s = max(reserve_s, 2 * (clock() - started + timing_s))
        gain = base.loss - alone.loss
        gains[unit.label] = gain
        record("measure", f"restore {unit.label} alone", alone, gain=gain, started=started,
               decision="gains" if gain > 0 else "no gain")
        measured.append((gain, unit, alone.passed))
    # The units that pass alone first, cheapest first: on a few dozen steering samples one flipped near-tie can be what
    # fails, and then most units pass alone, their gains apart only by their numeric error, which the unit with the most
    # FLOPs lowers most (measured on EfficientNet-Lite0 with AdaRound: 24 of 32 units passed alone; the four 1152x192
    # 1x1 convs, taken by gain, left the build at 1.37x fp32's speed; one 240-channel 3x3 depthwise conv, taken
    # cheapest first, passed too and left 1.56x). Then by gain.
    ranked = [unit for gain, unit, _ in sorted(measured, key=lambda m: (0, m[1].flops) if m[2] else (1, -m[0]))
              if gain > 0]
    if not ranked:
        why = "no unit's restoration lowered the loss" if measured else f"the {time_budget_s:.0f} s budget ran out"
        return result("budget exhausted" if measured else "time budget", why, base, [], adopted, gains)

    kept: list[Unit] = []
    current = base
    for unit in ranked[:max_additions]:  # 4. add in that order; keep only what helps
        if out_of_time():
            return result("time budget", f"the {time_budget_s:.0f} s budget ran out after {len(kept)} unit(s)", current,
                          kept, adopted, gains)
        flops = sum(u.flops for u in [*kept, unit])  # a node in two units (a tail's, a block's) twice: an upper bound
        if max_flops_fraction < 1.0 and flops / max(total_flops, 1) > max_flops_fraction:
            record("add", f"restore {unit.label}", decision=f"skipped: {flops / total_flops:.0%} of the FLOPs in float "
                   f"> the recipe's cap {max_flops_fraction:.0%}")
            continue
        started = clock()
        tried = actions.build_and_judge(_nodes([*kept, unit]), work / f"add-{len(steps)}.onnx", overrides)
        gain = current.loss - tried.loss
        if gain <= 0 and not tried.passed:
            record("add", f"restore {unit.label}", tried, gain=gain, started=started,
                   decision="dropped: no gain together")
            continue
        speed = actions.speedup(tried.path)
        if speed is not None and speed < min_speedup:
            record("add", f"restore {unit.label}", tried, gain=gain, speedup=speed, started=started,
                   decision=f"not kept: {speed:.2f}x fp32 < {min_speedup:.2f}x")
            return result("budget exhausted", f"restoring {unit.label} as well would take the build to {speed:.2f}x "
                          f"the fp32 build's speed (< {min_speedup:.2f}x): it would no longer pay", current,
                          kept, adopted, gains)
        kept.append(unit)
        current = tried
        record("add", f"restore {unit.label}", tried, gain=gain, speedup=speed, started=started, decision="kept")
        if tried.passed:
            break
    for name in reversed(list(adopted) if kept else []):  # 4b. a remedy adopted before any layer was restored may
        if out_of_time():  # no longer help once one is (measured: the right unit restored passed without them)
            break
        rest = {n: o for n, o in adopted.items() if n != name}
        # Without a remedy learned before another (percentile ranges before AdaRound), the later one is learned
        # again: a build as long as its own (AdaRound on EfficientNet-Lite0: ~285 s on 2 vCPUs). One that would
        # overrun the budget is not started (measured: begun with little time left, it took a 600 s search to 868 s).
        expected_s, left_s = max((remedy_seconds.get(n, 0.0) for n in rest), default=0.0), deadline - clock()
        if expected_s > left_s:
            record("drop", f"without {name}", decision=f"skipped: its build may take ~{expected_s:.0f} s, "
                   f"{left_s:.0f} s of the budget left")
            continue
        started = clock()
        tried = actions.build_and_judge(_nodes(kept), work / f"unremedy-{len(steps)}.onnx", _merged(rest) or None)
        drop, why = better(tried, current)  # remedies cost no speed: kept while they help
        record("drop", f"without {name}", tried, gain=current.loss - tried.loss, started=started,
               decision=("dropped: better without it: " if drop else "kept: needed: ") + why)
        if drop:
            adopted, current, overrides = rest, tried, _merged(rest) or None
    if not current.passed:
        return result("budget exhausted", f"still failing with {len(kept)} unit(s) restored (loss {current.loss:.3g})",
                      current, kept, adopted, gains)

    for unit in sorted(kept, key=lambda u: gains.get(u.label, 0.0)):  # 5. drop what did not help
        if len(kept) == 1 or out_of_time():
            break
        rest = [u for u in kept if u is not unit]
        started = clock()
        tried = actions.build_and_judge(_nodes(rest), work / f"drop-{len(steps)}.onnx", overrides)
        if tried.passed:
            kept, current = rest, tried
            record("drop", f"without {unit.label}", tried, started=started, decision="dropped: passes without it")
        else:
            record("drop", f"without {unit.label}", tried, started=started, decision="kept: needed")
    return result("rescued",
                  f"passes the steering samples with {len(kept)} unit(s) ({len(_nodes(kept))} layers) restored"
                  + (f" with {' and '.join(adopted)}" if adopted else ""), current, kept, adopted, gains)


def _alongside(trial: dict[str, dict], adopted: dict[str, dict], name: str) -> str:
    """What a remedy's build holds besides it: the adopted remedies it kept (with) and those it replaced (instead of).
    """
    kept = [n for n in trial if n != name]
    replaced = [n for n in adopted if n not in trial]
    parts = ([f"with {', '.join(kept)}"] if kept else []) + ([f"instead of {', '.join(replaced)}"] if replaced else [])
    return f" ({'; '.join(parts)})" if parts else ""


def _nodes(units: Sequence[Unit]) -> list[str]:
    return list(dict.fromkeys(n for u in units for n in u.nodes))


def _merged(adopted: dict[str, dict[str, object]]) -> dict[str, object]:
    """The recipe keys of the adopted remedies together."""
    return {key: value for overrides in adopted.values() for key, value in overrides.items()}
