"""The rescue search's decisions, on an explicit loss model: each unit takes a known share of the loss away when it is
restored, and restoring costs a known share of the speed-up. (The search on real builds: test_fallback.py, the
torch backend's in tests/backends/torch/test_torch_package.py, and benchmarks/rescue.py.)"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from accel_opt.precision.callbacks import SearchActions
from accel_opt.precision.remedies import REMEDIES as REGISTRY
from accel_opt.precision.remedies import REMEDY_KEYS, ModelSize, Planned, plan
from accel_opt.precision.search import LOOP_SHARE, Build, Unit, better, search, tail_units
from accel_opt.recipe.stages import CalibrationConfig

UNITS = [Unit("Conv 16x16x1x1", ["p1", "p2", "p3"], flops=300, added_error=9.0),  # the diagnosis blames it most...
         Unit("Conv 16x1x3x3", ["d1", "d2"], flops=20, added_error=1.0),  # ...but this one carries the loss
         Unit("Gemm 10x16", ["fc"], flops=10, added_error=0.5)]


class Model:
    """loss = 3 - what each restored unit takes away (capped at 0); speed-up = 2.0 - 0.2 per restored layer."""

    def __init__(self, gains: dict[str, float], remedy_gains: dict[tuple, float] | None = None):
        self.gains, self.remedy_gains = gains, remedy_gains or {}
        self.builds: list[list[str]] = []
        self.overrides: list[dict | None] = []

    def build_and_judge(self, keep: list[str], path: Path, overrides: dict | None) -> Build:
        self.builds.append(sorted(keep))
        self.overrides.append(overrides)
        loss = 3.0 - sum(g for key, g in self.gains.items() if set(_unit(key).nodes) <= set(keep))
        loss = max(loss - sum(g for item, g in self.remedy_gains.items() if item in (overrides or {}).items()), 0.0)
        return Build(path=path.with_name("+".join(sorted(keep)) or "naive"), loss=loss, passed=loss <= 1.0,
                     failures=[] if loss <= 1.0 else [f"loss {loss}"], worst_cosine=1.0)

    def speedup(self, path: Path) -> float:
        return 2.0 - 0.2 * len([n for n in path.name.split("+") if n and n != "naive"])


def _unit(key: str) -> Unit:
    return next(u for u in UNITS if u.key == key)


def _run(model: Model, tmp_path: Path, **options):
    """The search on `model`, on an injected clock (a frozen one unless the test gives its own): what it reaches never
    depends on this host's speed."""
    naive = model.build_and_judge([], tmp_path / "naive", None)
    settings = {"time_budget_s": 60.0, "min_speedup": 1.1, "max_additions": 8, "clock": Clock().monotonic, **options}
    return search(naive, UNITS, SearchActions(model.build_and_judge, model.speedup), tmp_path, **settings)


def test_what_is_kept_is_what_the_measurement_shows_not_the_diagnosis(tmp_path):
    model = Model({"Conv 16x1x3x3": 2.5})
    found = _run(model, tmp_path)
    assert found.status == "rescued" and sorted(found.kept) == ["d1", "d2"]
    assert found.gains == {"Conv 16x16x1x1 (3 layers)": 0.0, "Conv 16x1x3x3 (2 layers)": 2.5,
                           "Gemm 10x16 (1 layer)": 0.0}
    assert [s.kind for s in found.steps] == ["speed", "measure", "measure", "measure", "add", "stop"]


def test_units_are_added_by_measured_gain_until_the_probes_pass(tmp_path):
    model = Model({"Conv 16x1x3x3": 1.2, "Gemm 10x16": 0.9})
    found = _run(model, tmp_path)
    assert found.status == "rescued" and sorted(found.kept) == ["d1", "d2", "fc"]  # 3 - 1.2 - 0.9 = 0.9 passes
    assert [s.decision for s in found.steps if s.kind == "add"] == ["kept", "kept"]



def test_of_the_units_that_pass_alone_the_cheapest_is_restored_first(tmp_path):
    """The 1x1 group gains most (3 -> 0.2) but the depthwise pair, 1/15 of its FLOPs, passes alone too (3 -> 0.8)."""
    found = _run(Model({"Conv 16x16x1x1": 2.8, "Conv 16x1x3x3": 2.2}), tmp_path)
    assert found.status == "rescued" and sorted(found.kept) == ["d1", "d2"]
    assert [s.what for s in found.steps if s.kind == "add"] == ["restore Conv 16x1x3x3 (2 layers)"]

class Overlapping(Model):
    """Restorations that overlap: the unit that gains most alone (the 1x1 group) is redundant once the other two are
    kept, which pass without it."""

    LOSS = {(): 3.0, ("p",): 1.2, ("d",): 1.5, ("f",): 1.6, ("d", "p"): 1.1, ("d", "f", "p"): 0.5, ("d", "f"): 0.9,
            ("f", "p"): 1.05}

    def build_and_judge(self, keep, path, overrides):
        self.builds.append(sorted(keep))
        key = tuple(sorted({n[0] for n in keep}))
        loss = self.LOSS[key]
        return Build(path=path.with_name("+".join(sorted(keep)) or "naive"), loss=loss, passed=loss <= 1.0,
                     failures=[], worst_cosine=1.0)


def test_what_did_not_help_once_the_probes_pass_is_dropped(tmp_path):
    found = _run(Overlapping({}), tmp_path, min_speedup=0.0)
    assert found.status == "rescued" and sorted(found.kept) == ["d1", "d2", "fc"]
    drops = [(s.what, s.decision) for s in found.steps if s.kind == "drop"]
    assert drops[-1] == ("without Conv 16x16x1x1 (3 layers)", "dropped: passes without it")


def test_the_search_never_trades_for_a_build_below_the_speed_budget(tmp_path):
    """Restoring the big 1x1 group would pass, but at 1.4x the build is below the 1.5x budget: not kept, and the
    search stops saying so, returning the last build that met it."""
    model = Model({"Conv 16x16x1x1": 2.5})
    found = _run(model, tmp_path, min_speedup=1.5)
    assert found.status == "budget exhausted" and found.kept == [] and "would no longer pay" in found.reason
    assert found.best.loss == 3.0 and model.speedup(found.best.path) >= 1.5
    slow = _run(Model({"Conv 16x1x3x3": 2.5}), tmp_path, min_speedup=2.5)
    assert slow.status == "no speed-up" and [s.kind for s in slow.steps] == ["speed", "stop"]


BIAS = ("precision_options.calibration.bias_correction", True)
PERCENTILE = ("precision_options.calibration.method", "percentile")
ENTROPY = ("precision_options.calibration.method", "entropy")
NOT_AVERAGED = ("precision_options.calibration.moving_average", False)
REMEDIES = plan(CalibrationConfig())


def _named(*names: str) -> list[Planned]:
    return [r for r in REMEDIES if r.name in names]


def test_a_remedy_that_passes_ends_the_search_before_any_layer_leaves_int8(tmp_path):
    model = Model({"Conv 16x1x3x3": 2.5}, remedy_gains={PERCENTILE: 2.5})
    found = _run(model, tmp_path, remedies=REMEDIES)
    assert found.status == "rescued" and list(found.remedies) == ["percentile calibration"] and found.kept == []
    assert [(s.kind, s.decision.split(":")[0]) for s in found.steps] == [
        ("speed", "fast enough to search"), *[("remedy", "not better")] * 4, ("remedy", "adopted"),
        ("stop", found.reason)]
    assert "AdaRound" not in [s.what for s in found.steps]  # minutes: only once the cheap remedies have not passed


def test_remedies_add_up_and_what_follows_is_built_with_them(tmp_path):
    """Bias correction gains, percentile gains on top of it; entropy would replace percentile and gains less: not
    adopted; AdaRound gains nothing here. Every later build carries both adopted remedies."""
    model = Model({"Conv 16x1x3x3": 1.3}, remedy_gains={BIAS: 0.5, PERCENTILE: 0.3, ENTROPY: 0.1})
    found = _run(model, tmp_path, remedies=REMEDIES)
    assert [r.name for r in REMEDIES] == ["per-tensor weights", "Relu/Clip kept explicit", "bias correction",
                                          "moving-average calibration", "percentile calibration", "entropy calibration",
                                          "AdaRound"]  # cheapest first; the weight fit needs 256 calibration samples
    assert [s.decision.split(":")[0] for s in found.steps if s.kind == "remedy"] == [
        "not better", "not better", "adopted", "not better", "adopted", "not better", "not better"]
    assert found.status == "rescued" and list(found.remedies) == ["bias correction", "percentile calibration"]
    assert sorted(found.kept) == ["d1", "d2"]  # 3 - 0.5 - 0.3 = 2.2; with the depthwise pair restored, 0.9 passes
    with_both = dict([BIAS, PERCENTILE, NOT_AVERAGED])
    assert all(with_both == o for o in model.overrides[1 + len(REMEDIES):-2])  # measured and added with both
    assert [(s.what, s.decision) for s in found.steps if s.kind == "drop"] == [  # each still needed: 1.2, 1.4 without
        ("without percentile calibration", "kept: needed: fails"), ("without bias correction", "kept: needed: fails")]
    assert not plan(CalibrationConfig(bias_correction=True, method="percentile"))[0].name.startswith("bias")


ADAROUND = ("precision_options.calibration.weight_rounding", "adaround")


def test_adaround_is_adopted_on_its_gain_and_skipped_with_the_install_line_without_torch(tmp_path):
    model = Model({"Conv 16x1x3x3": 1.5}, remedy_gains={ADAROUND: 2.2})
    found = _run(model, tmp_path, remedies=REMEDIES)
    assert found.status == "rescued" and list(found.remedies) == ["AdaRound"] and found.kept == []
    without_torch = [r if r.name != "AdaRound" else replace(r, unavailable="needs PyTorch: pip install '.[ptq]'")
                     for r in REMEDIES]
    model = Model({"Conv 16x1x3x3": 2.5}, remedy_gains={ADAROUND: 2.2})
    found = _run(model, tmp_path, remedies=without_torch)
    assert ("remedy", "AdaRound", "skipped: needs PyTorch: pip install '.[ptq]'") in [
        (s.kind, s.what, s.decision) for s in found.steps]
    assert ADAROUND not in [item for o in model.overrides for item in (o or {}).items()]  # never built
    assert found.status == "rescued" and sorted(found.kept) == ["d1", "d2"]


def test_the_time_budget_is_exceeded_by_one_build_at_most(tmp_path):
    clock = Clock()  # the search's clock, injected: what it reaches may not depend on this host's speed
    model = TimedBuilds(clock, 0.2, gains={"Conv 16x1x3x3": 2.5})
    found = _run(model, tmp_path, time_budget_s=0.3, clock=clock.monotonic)
    searched_s = clock.now - 0.2  # the naive build (_run's, before the search starts) took one build's 0.2 s
    assert found.status == "time budget" and 0.3 <= searched_s <= 0.3 + 0.2


class Interfering(Model):
    """A remedy that lowers the all-int8 loss (3 -> 2.5) but stands in the way of the unit that rescues: with it the
    depthwise pair restored leaves 1.2, without it 0.9 (the spiky CNN's case, measured: entropy calibration and bias
    correction adopted, then the 1x1 conv restored, failed at 1.28 where minmax passed)."""

    def build_and_judge(self, keep, path, overrides):
        self.builds.append(sorted(keep))
        remedied = bool(overrides)
        restored = {"d1", "d2"} <= set(keep)
        loss = {(False, False): 3.0, (True, False): 2.5, (True, True): 1.2, (False, True): 0.9}[(remedied, restored)]
        return Build(path=path.with_name("+".join(sorted(keep)) or "naive"), loss=loss, passed=loss <= 1.0,
                     failures=[], worst_cosine=1.0)


def test_a_remedy_in_the_way_of_the_rescue_is_dropped_once_units_are_restored(tmp_path):
    found = _run(Interfering({}), tmp_path, remedies=_named("bias correction"), min_speedup=0.0)
    assert found.status == "rescued" and sorted(found.kept) == ["d1", "d2"] and found.remedies == {}
    assert ("drop", "without bias correction", "dropped: better without it: passes") in [
        (s.kind, s.what, s.decision) for s in found.steps]


def _judged(loss: float, output_loss: float, changed: str) -> Build:
    return Build(path=Path(f"{loss}-{changed}"), loss=loss, passed=loss <= 1.0, failures=[], worst_cosine=1.0,
                 output_loss=output_loss, changed=frozenset(changed))


def test_changed_predictions_decide_and_the_numeric_error_only_breaks_their_ties():
    base = _judged(1.96, 1.96, "")  # no steering sample changed; its numeric error is twice its limit
    two_flips = _judged(12.0, 0.8, "ab")  # 2 of 32 changed (each ~6 loss units), error on every sample 2.4x lower
    adopt, why = better(two_flips, base)
    assert not adopt and why == "changed predictions 0 -> 2 (sign test p = 0.5)"  # never adopted on its error
    adopt, why = better(_judged(36.0, 0.8, "abcdef"), base)
    assert not adopt and "changed predictions 0 -> 6 (sign test p = 0.031)" in why
    # Paired: the steering samples that changed in both builds count for neither.
    assert better(_judged(30.0, 2.5, "uvwxyz"), _judged(36.0, 2.0, "abcdefuvwxyz"))[0]  # fewer changed: better
    assert not better(_judged(42.0, 0.5, "abcdefg"), _judged(36.0, 2.0, "abcdef"))[0]  # 1 more changed: worse
    adopt, why = better(_judged(12.0, 0.5, "ab"), _judged(12.0, 0.9, "cd"))  # as many changed: the error decides
    assert adopt and why == "changed predictions 2 -> 2; output error 0.9 -> 0.5 of its limit"
    assert better(_judged(0.9, 0.9, "a"), _judged(0.5, 0.5, ""))[0] is False  # both pass: one more changed is worse
    no_counts = Build(Path("x"), loss=2.0, passed=False, failures=[], worst_cosine=1.0)  # a detector: loss alone
    assert better(no_counts, _judged(3.0, 0.1, ""))[0] and not better(_judged(3.0, 0.1, ""), no_counts)[0]


class Flipping(Model):
    """EfficientNet-Lite0's case, measured: AdaRound flips 2 steering crops (loss 12 against the naive build's 3) but
    lowers the error on all of them; with the depthwise pair restored on top it passes, without AdaRound it does
    not."""

    def build_and_judge(self, keep, path, overrides):
        self.builds.append(sorted(keep))
        rounded, restored = ADAROUND in (overrides or {}).items(), {"d1", "d2"} <= set(keep)
        loss, output_loss, changed = {(False, False): (3.0, 3.0, ""), (True, False): (12.0, 0.8, "ab"),
                                      (True, True): (0.7, 0.7, ""), (False, True): (1.5, 1.5, "")}[(rounded, restored)]
        return replace(_judged(loss, output_loss, changed), path=path.with_name("+".join(sorted(keep)) or "naive"))


def test_a_remedy_that_changes_more_steering_predictions_is_not_adopted_on_its_lower_error(tmp_path):
    """AdaRound would flip 2 steering crops while lowering the error on all of them (and pass with the depthwise pair
    restored on top): the verdict counts changed predictions, so it is not adopted, and the rescue goes on without it.
    """
    found = _run(Flipping({}), tmp_path, remedies=_named("AdaRound"), min_speedup=0.0, time_budget_s=1000.0)
    assert [(s.what, s.decision) for s in found.steps if s.kind == "remedy"] == [
        ("AdaRound", "not better: changed predictions 0 -> 2 (sign test p = 0.5)")]
    assert found.remedies == {} and found.status == "budget exhausted"


class Clock:
    """The search's clock, advanced by the builds: AdaRound's take `adaround_s`, every other build none."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class TimedBuilds(Model):
    """Every build takes `build_s` on the search's clock, one that learns AdaRound `adaround_s` (if given)."""

    def __init__(self, clock: Clock, build_s: float, adaround_s: float | None = None, **gains):
        super().__init__(**gains)
        self.clock, self.build_s, self.adaround_s = clock, build_s, adaround_s

    def build_and_judge(self, keep, path, overrides):
        rounding = self.adaround_s is not None and ADAROUND in (overrides or {}).items()
        self.clock.now += self.adaround_s if rounding else self.build_s
        return super().build_and_judge(keep, path, overrides)


def test_a_drop_that_would_relearn_adaround_past_the_budget_is_not_started(tmp_path):
    clock = Clock()
    # AdaRound and percentile adopted (3 -> 2), the depthwise pair restored passes (0.5): five AdaRound builds by then
    # (the remedy, three measures, the addition), 550 s of a 650 s budget.
    model = TimedBuilds(clock, 0.0, 110.0, gains={"Conv 16x1x3x3": 1.5}, remedy_gains={PERCENTILE: 0.5, ADAROUND: 0.5})
    found = _run(model, tmp_path, remedies=REMEDIES, time_budget_s=650.0, clock=clock.monotonic)
    assert found.status == "rescued" and set(found.remedies) == {"percentile calibration", "AdaRound"}
    drops = [(s.what, s.decision) for s in found.steps if s.kind == "drop"]
    assert drops[0][0] == "without AdaRound" and drops[0][1].startswith("kept")  # percentile is cached: built
    assert drops[1] == ("without percentile calibration",
                        "skipped: its build may take ~110 s, 100 s of the budget left")
    assert clock.now <= 650.0


def test_measuring_stops_where_the_budget_left_is_needed_to_add_what_gains(tmp_path):
    """10 s a build, 25 s of budget: the first unit measured passes alone (3 -> 0.5). Measuring the other two would
    leave no time to add it (EfficientNet-Lite0's case, measured: all 31 units measured, 24 passing alone, none
    added); with the 20 s kept for adding, it is added and the build passes."""
    clock = Clock()
    found = _run(TimedBuilds(clock, 10.0, gains={"Conv 16x16x1x1": 2.5}), tmp_path, time_budget_s=25.0,
                 clock=clock.monotonic)
    assert found.status == "rescued" and sorted(found.kept) == ["p1", "p2", "p3"]
    assert [(s.kind, s.what, s.decision) for s in found.steps][1:3] == [
        ("measure", "restore Conv 16x16x1x1 (3 layers) alone", "gains"),
        ("measure", "the other 2 unit(s)",
         "skipped: 15 s of the budget left, kept to add what was measured (~10 s a unit)")]
    # Nothing gained yet: measuring goes on whatever is left (nothing could be added).
    clock.now = 0.0
    found = _run(TimedBuilds(clock, 10.0, gains={"Gemm 10x16": 2.5}), tmp_path, time_budget_s=25.0,
                 clock=clock.monotonic)
    assert [s.kind for s in found.steps] == ["speed", *["measure"] * 3, "stop"] and found.status == "time budget"


LAYERS_IN_ORDER = ["p1", "d1", "p2", "x1", "x2", "p3", "d2", "fc"]  # UNITS' layers and two others, as the graph runs


def test_the_network_tail_is_a_unit_of_its_own_up_to_a_quarter_of_the_layers():
    tails = tail_units(LAYERS_IN_ORDER, [4, 2, 2], {"d2": 10, "fc": 10})
    assert [(u.label, u.nodes, u.flops) for u in tails] == [("the last 2 of 8 layers", ["d2", "fc"], 20)]
    assert tail_units(LAYERS_IN_ORDER, []) == [] and tail_units(["fc"], [1]) == []


class TailAndPair(Model):
    """The tail (d2, fc) takes 1.5 off the loss, the depthwise pair (d1, d2) 1.0: neither passes alone, both pass."""

    def build_and_judge(self, keep, path, overrides):
        self.builds.append(list(keep))
        loss = 3.0 - 1.5 * ({"d2", "fc"} <= set(keep)) - 1.0 * ({"d1", "d2"} <= set(keep))
        return Build(path=path.with_name("+".join(sorted(keep)) or "naive"), loss=loss, passed=loss <= 1.0,
                     failures=[], worst_cosine=1.0)


def test_a_tail_is_measured_first_and_kept_beside_a_group_sharing_a_layer_with_it(tmp_path):
    model = TailAndPair({})
    units = [*tail_units(LAYERS_IN_ORDER, [2]), *UNITS]
    naive = model.build_and_judge([], tmp_path / "naive", None)
    found = search(naive, units, SearchActions(model.build_and_judge, model.speedup), tmp_path, time_budget_s=60.0,
                   min_speedup=0.0, max_additions=8)
    assert [s.what for s in found.steps if s.kind == "measure"][0] == "restore the last 2 of 8 layers alone"
    assert found.status == "rescued" and [u.label for u in found.kept_units] == [
        "the last 2 of 8 layers", "Conv 16x1x3x3 (2 layers)"]
    assert found.kept == ["d2", "fc", "d1"]  # d2, in both, once
    assert all(len(keep) == len(set(keep)) for keep in model.builds)


NNCF = ("precision_options.calibration.quantizer", "nncf")
OPENVINO_REMEDIES = plan(CalibrationConfig(), "openvino")


def test_nncf_is_tried_on_openvino_before_the_long_remedies_and_instead_of_those_adopted(tmp_path):
    """NNCF is another quantizer (about 10 s on EfficientNet-Lite0, AdaRound minutes): its build resets what the
    remedies before it set, and it is named as replacing them."""
    nncf = ["NNCF on OpenVINO", "NNCF on OpenVINO + SmoothQuant", "NNCF on OpenVINO + ChannelAlignment"]
    names = [r.name for r in REMEDIES]
    at = names.index("percentile calibration")
    assert [r.name for r in OPENVINO_REMEDIES] == names[:at] + nncf + names[at:]
    assert not any(r.name.startswith("NNCF") for r in REMEDIES)  # ONNX Runtime's builds: ONNX Q/DQ only
    model = Model({"Conv 16x1x3x3": 1.5}, remedy_gains={BIAS: 0.5, NNCF: 2.2})
    found = _run(model, tmp_path, remedies=OPENVINO_REMEDIES)
    assert found.status == "rescued" and list(found.remedies) == ["NNCF on OpenVINO"] and found.kept == []
    assert [s.what for s in found.steps if s.kind == "remedy"][-1] == "NNCF on OpenVINO (instead of bias correction)"
    built = model.overrides[-1]
    assert built[NNCF[0]] == "nncf" and built[BIAS[0]] is False  # the bias correction it replaced is not carried
    CalibrationConfig(**{key.rpartition(".")[2]: value for key, value in built.items()})  # a recipe NNCF accepts


def test_nncf_is_offered_only_where_the_recipe_keeps_what_it_replaces():
    assert plan(CalibrationConfig(quantizer="nncf"), "openvino") == ()  # NNCF already: nothing to add
    assert not any(r.name.startswith("NNCF") for r in plan(CalibrationConfig(reduce_range=True), "openvino"))
    fused = [r for r in plan(CalibrationConfig(), "openvino",
                                      fused_preprocessing=True) if r.name.startswith("NNCF")]
    assert fused and all("preprocessing.fused" in r.unavailable for r in fused)


SIZE = ModelSize(gflops=0.78, calibration_samples=64)  # EfficientNet-Lite0's, where the estimates were measured


def test_remedies_are_planned_cheapest_first_from_the_registry_by_the_models_size():
    planned = plan(CalibrationConfig(), "openvino", size=SIZE)
    assert [p.estimate_s for p in planned] == sorted(p.estimate_s for p in planned)
    by_name = {p.name: p for p in planned}
    assert 300 < by_name["AdaRound"].estimate_s < 450 and by_name["NNCF on OpenVINO"].estimate_s < 20
    assert by_name["AdaRound"].budget_key.endswith("adaround_time_budget_s") and by_name["AdaRound"].budget_s == 600
    bigger = {p.name: p.estimate_s for p in plan(CalibrationConfig(), size=ModelSize(7.8, 64))}
    assert bigger["AdaRound"] == pytest.approx(10 * by_name["AdaRound"].estimate_s, rel=0.01)
    # The weight fit (distillation) overfits few samples: offered from 256 calibration samples. Its cost grows with its
    # steps, AdaRound's with the samples: on 512 it is planned first of the two.
    assert "weight fit (distillation)" not in by_name
    many = [p.name for p in plan(CalibrationConfig(samples=512), size=ModelSize(0.78, 512))]
    assert many[-2:] == ["weight fit (distillation)", "AdaRound"]
    # Everything the plan and NNCF's resets know comes from the registry: a remedy is one class there.
    assert set(REMEDY_KEYS) == {k for r in REGISTRY if not r.replaces_quantizer for k in r.keys}
    assert {p.name for p in planned} <= {r.offered(CalibrationConfig(), "openvino")[0] for r in REGISTRY}


class CostedBuilds(Model):
    """Each remedy's build takes `seconds[name]` on the search's clock (its own loop stopping at the budget key the
    search gives it); every other build `build_s`."""

    def __init__(self, clock: Clock, seconds: dict[str, float], build_s: float = 1.0, **gains):
        super().__init__(**gains)
        self.clock, self.seconds, self.build_s = clock, seconds, build_s

    def build_and_judge(self, keep, path, overrides):
        taken = self.build_s
        for remedy in REMEDIES:
            if remedy.overrides.items() <= (overrides or {}).items():
                loop_s = (overrides or {}).get(remedy.budget_key, math.inf) if remedy.budget_key else math.inf
                taken = max(taken, min(self.seconds.get(remedy.name, self.build_s), loop_s + self.build_s))
        self.clock.now += taken
        return super().build_and_judge(keep, path, overrides)


def test_a_remedy_starts_only_where_its_estimate_fits_the_budget_left(tmp_path):
    clock = Clock()
    remedies = [replace(r, estimate_s=e) for r, e in zip(_named("bias correction", "AdaRound"), (10.0, 500.0))]
    model = CostedBuilds(clock, {"bias correction": 10.0, "AdaRound": 500.0}, gains={"Conv 16x1x3x3": 2.5})
    found = _run(model, tmp_path, remedies=remedies, time_budget_s=300.0, clock=clock.monotonic)
    assert [(s.what, s.decision.split(":")[0]) for s in found.steps if s.kind == "remedy"] == [
        ("bias correction", "not better"), ("AdaRound", "skipped")]
    assert "~500 s estimated, 290 s of the budget left" in found.steps[2].decision
    assert ADAROUND not in [item for o in model.overrides for item in (o or {}).items()]  # never built


def test_estimates_are_scaled_by_how_long_the_builds_before_took_against_theirs(tmp_path):
    """This host runs the remedies 3x slower than their estimates: the 40 s one, 120 s here, does not fit in 100."""
    clock = Clock()
    remedies = [replace(r, estimate_s=e) for r, e in zip(_named("per-tensor weights", "percentile calibration"),
                                                         (20.0, 40.0))]
    model = CostedBuilds(clock, {"per-tensor weights": 60.0, "percentile calibration": 120.0}, gains={})
    found = _run(model, tmp_path, remedies=remedies, time_budget_s=160.0, clock=clock.monotonic)
    assert found.steps[2].what == "percentile calibration"
    assert found.steps[2].decision == "skipped: ~120 s estimated, 100 s of the budget left"


def test_a_long_remedys_own_loop_gets_what_is_left_and_the_search_ends_within_a_step_of_its_budget(tmp_path):
    """AdaRound's estimate fits, but its recipe's 600 s loop would not: the search gives it 90% of what is left, and
    with it, however long AdaRound would have run, the search ends at most one build past its budget."""
    clock = Clock()
    remedies = [replace(r, estimate_s=100.0) for r in _named("AdaRound")]
    model = CostedBuilds(clock, {"AdaRound": 5000.0}, build_s=5.0, gains={"Gemm 10x16": 2.5})
    found = _run(model, tmp_path, remedies=remedies, time_budget_s=300.0, clock=clock.monotonic)
    built = next(o for o in model.overrides if o and ADAROUND in o.items())
    assert built[remedies[0].budget_key] == round(LOOP_SHARE * 300.0)  # all 300 s were left
    assert clock.now - 5.0 <= 300.0 + 5.0  # the naive build's 5 s came before the search; one 5 s build past it
    assert found.status == "rescued"  # the 25 s AdaRound left were enough to measure and add the Gemm
