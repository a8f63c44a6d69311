"""`--backend auto` / `--precision auto`: the plan under every CPU class (the profile is injected), and real candidate
builds on the tiny zoo ResNet, which assert only what holds on any host: never a fixed candidate count, backend or
winner, only the rules that pick one from this run's own measurements."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from accel_opt.artifact.folder import MANIFEST
from accel_opt.backends.select import auto_backend, candidate_precisions
from accel_opt.builder import auto, choice
from accel_opt.builder.auto import build_auto, plan
from accel_opt.errors import InputRejected, Unsupported
from accel_opt.machine.cpu import CpuProfile
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.types import BackendName
from accel_opt.report import selection
from accel_opt.report.selection import AutoSelection
from tests.conftest import CPU_CLASSES as CLASSES
from tests.conftest import image_npz_folder

TARGET = 2  # a batch size FAST_BENCH measures


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    # 140: an int8 candidate holds 87 out, enough for none failing to show >= 95% within tolerance at the family-wise
    # level of up to 3 planned reduced candidates (98.3%: 80 samples)
    return image_npz_folder(tmp_path_factory.mktemp("auto") / "data", 140)


@pytest.fixture()
def recipe(fast_recipe) -> Recipe:
    return fast_recipe.with_overrides(**{"selection.target_batch_size": TARGET})


# --- plan -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CLASSES)
def test_plan_auto_tries_every_sensible_pair_with_a_reason(name):
    cpu = CpuProfile.of_class(name)
    pairs, reason = plan(Recipe(), "auto", "auto", has_data=True, cpu=cpu)
    chosen, expected_reason = auto_backend(cpu)
    assert reason == expected_reason
    backends = [chosen] + ([BackendName.onnxruntime] if chosen is not BackendName.onnxruntime else [])
    expected = [(b.value, p.value, why) for b in backends for p, why in candidate_precisions(b, cpu)]
    assert pairs == expected
    assert pairs[0][0] == chosen.value and ("onnxruntime", "fp32", "reference precision") in pairs
    assert any(p == "int8" for _, p, _ in pairs) and all(why for _, _, why in pairs)
    # fp32 floors first; ONNX Runtime's int8 is the last build on every class (what the progress labels rely on).
    order = auto.build_order(pairs)
    assert [p for _, p,
            _ in order[:len(backends)]] == ["fp32"] * len(backends) and order[-1][:2] == ("onnxruntime", "int8")


@pytest.mark.parametrize("name", CLASSES)
def test_plan_without_data_skips_int8(caplog, name):
    cpu = CpuProfile.of_class(name)
    with caplog.at_level(logging.WARNING, logger="accel_opt.builder.auto"):
        pairs, _ = plan(Recipe(), "auto", "auto", has_data=False, cpu=cpu)
    with_data, _ = plan(Recipe(), "auto", "auto", has_data=True, cpu=cpu)
    assert pairs == [pair for pair in with_data if pair[1] != "int8"]
    assert "calibration needs --data" in caplog.text


@pytest.mark.parametrize("name", CLASSES)
def test_plan_with_given_backend_or_precision(name):
    cpu = CpuProfile.of_class(name)
    assert plan(Recipe(), "onnxruntime", "fp32", has_data=False, cpu=cpu) == (
        [("onnxruntime", "fp32", "given")], "given on the command line or in the recipe",
    )
    pairs, _ = plan(Recipe(), "onnxruntime", "auto", has_data=True, cpu=cpu)
    assert [(b, p) for b, p, _ in pairs] == [("onnxruntime", "fp32"), ("onnxruntime", "int8")]
    pairs, _ = plan(Recipe(), "auto", "fp32", has_data=False, cpu=cpu)
    assert [p for _, p, _ in pairs] == ["fp32"] * len(pairs) and pairs[-1][0] == "onnxruntime"


def test_plan_does_not_list_onnxruntime_twice(monkeypatch):
    # A machine where auto picks ONNX Runtime itself (no AVX-512/AMX, or no openvino installed).
    from accel_opt.backends.select import BackendChoice

    monkeypatch.setattr(auto, "auto_backend_choice",
                        lambda cpu: BackendChoice(BackendName.onnxruntime, None, "portable default"))
    pairs, reason = plan(Recipe(), "auto", "auto", has_data=True, cpu=CpuProfile.of_class("amx"))
    assert reason == "portable default" and {b for b, _, _ in pairs} == {"onnxruntime"}
    assert [p for _, p, _ in pairs] == ["fp32", "int8"]


# --- real builds ----------------------------------------------------------------------------------


def _p50_at(artifact_dir: str, batch: int) -> float:
    bench = json.loads((Path(artifact_dir) / "benchmark.json").read_text())
    return next(b["latency"]["p50_ms"] for b in bench["models"][0]["batches"] if b["batch_size"] == batch)


def test_build_auto_picks_the_fastest_candidate_whose_held_out_verdict_holds(tiny_cnn_path, recipe, data_dir, tmp_path):
    seen, progress = [], []
    result, selection = build_auto(tiny_cnn_path, recipe, "auto", "auto", data_dir, tmp_path, on_candidate=seen.append,
                                   on_progress=progress.append)
    # Which candidates this host plans is its class's (tested under every class above); what holds on each: the fp32
    # floors are built first, ONNX Runtime's fp32 and int8 are among them, each with why it was tried.
    count = len(selection.candidates)
    precisions = [c.precision for c in selection.candidates]
    floors = precisions.count("fp32")
    assert precisions[:floors] == ["fp32"] * floors and floors in (1, 2)
    assert {"onnxruntime fp32", "onnxruntime int8"} <= {c.label for c in selection.candidates}
    assert all(c.why_tried for c in selection.candidates)
    assert seen == selection.candidates and selection.backend_reason
    assert selection.target_batch_size == TARGET and selection.latency_budget_ms is None
    assert all(c.verdict for c in selection.candidates)

    for c in selection.candidates:
        assert c.artifact_dir and (Path(c.artifact_dir) / MANIFEST).is_file(), c.verdict
        assert c.batch_size == TARGET and c.build_latency_p50_ms == _p50_at(c.artifact_dir, TARGET)
        assert c.steering_passed is not None and c.held_out in ("pass", "fail", "insufficient") and c.rates
        assert c.samples["steering"] == 21 and c.samples["calibration"] == (35 if c.precision == "int8" else 0)
        assert c.seconds > 0 and set(c.stage_seconds) >= {"load", "accuracy", "benchmark"}
        assert (c.search_budget_s is not None) == (c.precision != "fp32")
    # Every build that passed on the steering samples was timed again, against the others: these numbers are compared.
    timed = [c for c in selection.candidates if c.points]
    assert timed == [c for c in selection.candidates if c.steering_passed and (c.signed_off or c.precision != "fp32")]
    assert selection.timing.startswith(f"one interleaved runoff of the {len(timed)} builds that passed on the steering")
    assert all(c.latency_p50_ms > 0 and c.latency_p50_ms != c.build_latency_p50_ms for c in timed)
    assert selection.objective == "throughput" and all(c.objective_batch == TARGET for c in timed)
    fp32 = max((c for c in timed if c.precision == "fp32"), key=lambda c: c.objective_value)
    winner = selection.winner
    assert winner.objective_value >= fp32.objective_value and winner.verdict.startswith("won: best on the objective")
    assert winner.held_out_at(winner.family_confidence or 0.95) == "pass"
    # The family-wise level is fixed by the plan before any verdict is read (k: every reduced candidate planned), and
    # each reduced build judged at it, so its own reports state the level auto read it at.
    planned = sum(c.reduced for c in selection.candidates)
    level = 1 - 0.05 / planned if planned > 1 else 0.95
    for c in selection.candidates:
        if c.reduced and c.artifact_dir:
            assert json.loads((Path(c.artifact_dir)
                               / "accuracy.json").read_text())["confidence"] == pytest.approx(level)
            if planned > 1:
                signoff = (Path(c.artifact_dir) / "signoff.md").read_text()
                assert f"family-wise over the {planned} reduced candidates" in signoff
        if c.family_confidence is not None:
            assert c.family_confidence == pytest.approx(level)
    for c in timed:
        if c is not winner:
            assert c.verdict.startswith(("lost: ", "not faster than fp32", "fastest left, but")), c.verdict
    assert result is not None and result.signed_off
    assert (result.backend, result.precision, result.artifact_dir) == (winner.backend, winner.precision,
                                                                       winner.artifact_dir)

    # Progress: every stage of every build, with the candidate, the time spent and the time left of the budget.
    assert progress == selection.progress and all(e.remaining_s is not None for e in progress)
    assert {e.candidate for e in progress} == {f"{c.label} ({i}/{count})" for i,
                                               c in enumerate(selection.candidates, 1)}
    assert any(e.line().startswith(f"[onnxruntime int8 ({count}/{count}) | ") and " min left] accuracy: ok in "
               in e.line() for e in progress)
    assert selection.time_budget_s == 900 and 0 < selection.seconds < 900 and not selection.untried

    saved = AutoSelection.model_validate_json((tmp_path / "tiny_cnn-auto-selection.json").read_text())
    assert saved == selection
    markdown = (tmp_path / "tiny_cnn-auto-selection.md").read_text()
    assert f"target batch {TARGET}; latency budget none" in markdown and "interleaved runoff" in markdown
    assert "family-wise level (Bonferroni)" in markdown and "Where the minutes went" in markdown
    assert sum(line.startswith(("| onnxruntime | ", "| openvino | ")) for line in markdown.splitlines()) == count
    assert f"Winner: {winner.backend} {winner.precision} -> {winner.artifact_dir}" in markdown
    # the strict per-sample check: none may fail, and none failing of 60 shows >= 95% (59 would)
    from accel_opt.accuracy.evidence import lower_bound

    int8 = next(c for c in selection.candidates if c.label == "onnxruntime int8")
    held = int8.samples["verdict"]  # none failing of them, at the family-wise level, shows at least:
    shown = lower_bound(held, held, level)
    assert f"| pass: samples within tolerance: 0 failed of {held} samples, none may fail, >= {shown:.1%} vs 95.0% |" \
        in markdown


def test_a_time_budget_builds_the_floor_and_says_what_it_left_untried(tiny_cnn_path, recipe, data_dir, tmp_path):
    """A budget the first build already spends: the first fp32 build is the answer, every other candidate is named as
    untried, with the time a build takes here."""
    tight = recipe.with_overrides(**{"selection.time_budget_s": 0.01})
    result, selection = build_auto(tiny_cnn_path, tight, "onnxruntime", "auto", data_dir, tmp_path)
    (fp32, int8) = selection.candidates
    assert fp32.artifact_dir and fp32.verdict.startswith("won") and result.artifact_dir == fp32.artifact_dir
    assert int8.artifact_dir is None and int8.verdict.startswith("not tried: the time budget ran out")
    assert selection.untried == [f"onnxruntime int8: {int8.verdict}"]
    assert "Left untried for lack of time" in (tmp_path / "tiny_cnn-auto-selection.md").read_text()


def test_candidates_the_held_out_samples_cannot_certify_are_not_built(tiny_cnn_path, recipe, data_dir, tmp_path):
    """top-1 agreement >= 99% needs 299 held-out samples at 95% confidence: on 100 samples no int8 build could sign off,
    so it is dropped after loading its data, saying so; fp32 (judged against its noise floor) still ships."""
    strict = recipe.with_overrides(**{"accuracy.task_metrics": [{"kind": "topk", "min_agreement": {1: 0.99}}]})
    result, selection = build_auto(tiny_cnn_path, strict, "onnxruntime", "auto", data_dir, tmp_path)
    (fp32, int8) = selection.candidates
    assert result is not None and result.precision == "fp32" and fp32.signed_off
    assert int8.artifact_dir is None and int8.verdict.startswith("dropped: not built: top-1 agreement >= 99.0% needs "
                                                                 "299")
    assert set(int8.stage_seconds) <= {"export", "load"}  # stopped after loading, before any calibration or benchmark


def test_latency_budget_makes_every_candidate_lose(tiny_cnn_path, recipe, data_dir, tmp_path):
    """Through the CLI: exit 1, one line on stderr saying why there is no winner, every verdict in the report."""
    import yaml
    from click.testing import CliRunner

    from accel_opt.cli import main

    tight = tmp_path / "tight.yaml"
    tight_recipe = recipe.with_overrides(**{"selection.latency_budget_ms": 1e-6})
    tight.write_text(yaml.safe_dump(tight_recipe.model_dump(mode="json")))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", str(tiny_cnn_path), "--backend", "onnxruntime", "--precision", "auto",
                                       "--recipe", str(tight), "--data", str(data_dir), "--out", str(out), "--json"])
    assert result.exit_code == 1, result.output
    assert "no winner: the signed-off candidates lose on the objective" in result.stderr
    payload = json.loads(result.stdout)
    assert payload["artifact_dir"] is None and "tiny_cnn-auto-selection.md" in payload["failures"][0]
    selection = AutoSelection.model_validate(payload["selection"])
    assert selection.winner is None
    assert [c.precision for c in selection.candidates] == ["fp32", "int8"]
    for c in selection.candidates:
        assert c.latency_p50_ms is not None and c.artifact_dir
        assert c.verdict.startswith("failed the gate") or "over the 1e-06 ms budget" in c.verdict, c.verdict
    assert any("over the 1e-06 ms budget" in c.verdict for c in selection.candidates)
    assert json.loads((out / "tiny_cnn-auto-selection.json").read_text())["winner"] is None
    markdown = (out / "tiny_cnn-auto-selection.md").read_text()
    assert "latency budget p99 <= 1e-06 ms" in markdown
    assert "No winner: the signed-off candidates lose on the objective" in markdown


def test_unbuildable_candidate_is_listed_with_its_reason(tiny_cnn_path, recipe, tmp_path):
    with pytest.raises(Unsupported, match="bfloat16"):  # nothing could be built: its exit code (4) is the answer
        build_auto(tiny_cnn_path, recipe, "onnxruntime", "bf16", None, tmp_path)
    selection = AutoSelection.model_validate_json((tmp_path / "tiny_cnn-auto-selection.json").read_text())
    (only,) = selection.candidates
    assert selection.winner is None
    assert only.verdict.startswith("could not build: (exit 4)") and "bfloat16" in only.verdict
    assert (tmp_path / "tiny_cnn-auto-selection.md").is_file()


def test_bad_data_stops_the_search(tiny_cnn_path, recipe, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputRejected, match="no .npz files"):  # exit 3: no other candidate would do better
        build_auto(tiny_cnn_path, recipe, "onnxruntime", "fp32", empty, tmp_path / "out")


# --- choose: the objective -------------------------------------------------------------------------


def _candidate(precision: str, points: list[tuple[int, float, float, float]], backend: str = "onnxruntime"):
    return selection.Candidate(backend=backend, precision=precision, why_tried="", signed_off=True,
                          points=[selection.RunoffPoint(batch_size=b, p50_ms=p50, p99_ms=p99, throughput_per_s=t)
                                  for b, p50, p99, t in points])


def test_a_candidate_slower_than_fp32_on_the_objective_never_wins():
    """int8 has the best throughput at batch 8 but is slower than fp32 at batch 1: on the latency
    objective fp32 wins and int8 is told why; on the throughput objective int8 wins."""
    def pair():
        return [_candidate("fp32", [(1, 2.0, 2.5, 500.0), (8, 12.0, 13.0, 667.0)]),
                _candidate("int8", [(1, 2.4, 2.9, 417.0), (8, 5.0, 6.0, 1600.0)])]

    latency = pair()
    winner = choice.choose(latency, "latency", None, 8)
    assert winner.precision == "fp32" and winner.objective_value == 2.0
    assert latency[1].verdict.startswith("not faster than fp32 on the objective: 2.40 vs onnxruntime fp32 2.00 ms p50")
    throughput = pair()
    assert choice.choose(throughput, "throughput", None, 8).precision == "int8"
    assert throughput[0].verdict.startswith("lost: ")


def test_without_a_signed_off_fp32_build_the_failed_fp32_builds_are_the_speed_floor():
    """Draft decoding fails every fp32 build by fp32's tight tolerance; an int8 build slower than those fp32
    builds still does not pay, so it does not win either; one faster than them does."""
    fp32 = _candidate("fp32", [(8, 5.0, 6.0, 1566.0)], backend="openvino")
    fp32.signed_off, fp32.verdict, fp32.artifact_dir = False, "failed the gate: logits: max error 0.414", "x"
    slow = _candidate("int8", [(8, 11.0, 12.0, 712.0)])
    assert choice.speed_floors([fp32, slow]) == [fp32]
    assert choice.choose([fp32, slow], "throughput", None, 8) is None
    assert slow.verdict.endswith("1566.00 samples/s (that fp32 build failed the gate)")
    assert fp32.verdict.startswith("failed the gate") and "speed floor" in fp32.verdict
    fast = _candidate("bf16", [(8, 3.0, 3.5, 2561.0)], backend="openvino")
    assert choice.choose([fp32, slow, fast], "throughput", None, 8) is fast
    signed_fp32 = _candidate("fp32", [(8, 10.0, 11.0, 800.0)])  # a signed-off fp32 build is the floor again
    assert choice.speed_floors([fp32, signed_fp32, slow]) == []
    assert choice.choose([fp32, signed_fp32, slow], "throughput", None, 8) is signed_fp32


def test_throughput_within_p99_takes_the_best_point_under_the_budget():
    candidates = [_candidate("fp32", [(1, 2.0, 2.5, 500.0), (8, 12.0, 13.0, 667.0)]),
                  _candidate("int8", [(1, 1.0, 1.2, 1000.0), (8, 5.0, 11.0, 1600.0)])]
    winner = choice.choose(candidates, "throughput_within_p99", 10.0, 8)
    assert winner.precision == "int8" and winner.objective_batch == 1  # batch 8's p99 of 11 ms is over budget
    assert candidates[0].objective_batch == 1  # fp32 at batch 8: p99 13 ms
    assert choice.choose([_candidate("fp32", [(1, 20.0, 25.0, 50.0)])], "throughput_within_p99", 10.0, 8) is None


def test_p99_objective_needs_a_budget():
    from accel_opt.errors import UsageError

    with pytest.raises(UsageError, match="latency_budget_ms"):
        Recipe().with_overrides(**{"selection.objective": "throughput_within_p99"})


def _rated(precision: str, throughput: float, changed: int, rows: int = 120) -> selection.Candidate:
    """A candidate timed in the runoff whose held-out top-1 agreement changed `changed` of `rows` rows (min 0.95)."""
    from accel_opt.accuracy.evidence import RateEvidence

    c = _candidate(precision, [(8, 1000 / throughput, 1100 / throughput, throughput)])
    c.rates = [RateEvidence(what="top-1 agreement", successes=rows - changed, trials=rows, unit="rows", minimum=0.95)]
    c.signed_off = c.held_out_at(0.95) == "pass"
    return c


def test_reading_several_held_out_verdicts_costs_confidence():
    """Two reduced candidates beat fp32. The faster one's verdict holds at 95% alone (4 changed of 200: >= 95.5%), but
    reading two verdicts is two chances to pass by luck: at 97.5% each (Bonferroni) its bound is 94.96%, so the next
    one, none changed of 120 (>= 96.97% at 97.5%), wins."""
    fp32 = _candidate("fp32", [(8, 10.0, 11.0, 800.0)])
    lucky, steady = _rated("int8", 3000.0, changed=4, rows=200), _rated("bf16", 2000.0, changed=0, rows=120)
    lucky.backend = "openvino"
    assert lucky.held_out_at(0.95) == "pass" and lucky.held_out_at(0.975) == "fail"
    winner = choice.choose([fp32, lucky, steady], "throughput", None, 8, confidence=0.95)
    assert winner is steady and steady.family_confidence == lucky.family_confidence == 0.975
    assert lucky.verdict.startswith("fastest left, but its held-out verdict at 97.50% (95% family-wise over 2 planned) "
                                    "is a failure: top-1 agreement >= 9")
    assert steady.verdict.startswith("won: ") and "held-out verdict passes at 97.50%" in steady.verdict
    alone = _rated("int8", 3000.0, changed=4, rows=200)
    # 95% alone
    assert choice.choose([_candidate("fp32", [(8, 10.0, 11.0, 800.0)]), alone], "throughput", None, 8) is alone
    too_few = _rated("int8", 3000.0, changed=0, rows=40)  # 40 rows cannot show 95%: fp32 ships
    assert choice.choose([fp32, too_few], "throughput", None, 8) is fp32 and "not enough evidence" in too_few.verdict


def test_a_candidate_far_outside_the_gate_is_dropped_before_its_search(tmp_path):
    """A small detector whose class scores pass 0.25 only in the tail of their logits: int8 moves that tail enough to
    change many boxes, and the error comes from everywhere (the 8 layer groups the diagnosis blames most add about a
    quarter of it). Its first measurement is far outside what restoring layers can recover: auto drops it before any
    search (the speed budget is lifted, so the search would otherwise run on any CPU), saying why, in seconds.
    The recipe targets AVX2 (7-bit weights): VNNI and AMX compute those exactly as AVX2 does, so the error, and the
    drop, are the same on every class (with the 8-bit weights a VNNI host picks for itself, int8 comes closer)."""
    from PIL import Image

    from accel_opt import zoo
    from accel_opt.recipe.load import load_recipe
    from tests.conftest import FAST_BENCH

    model = zoo.save(zoo.detector(96, width=8, score_bias=-5.0), tmp_path / "det.onnx")
    data = tmp_path / "data"
    data.mkdir()
    rng, photos = np.random.default_rng(0), zoo._skimage_photos()
    for i in range(100):  # int8 holds 60 out: enough for its rates' bounds to clear 95% (59)
        side = int(96 * (1 + rng.random()))
        x, y = (int(v) for v in rng.integers(0, side - 95, 2))
        crop = Image.fromarray(photos[i % len(photos)]).convert("RGB").resize((side, side)).crop((x, y, x + 96, y + 96))
        np.savez(data / f"p{i:03d}.npz", image=(np.asarray(crop, np.float32) / 255).transpose(2, 0, 1)[None].copy())
    recipe = load_recipe("detector").with_overrides(benchmark=FAST_BENCH, **{
        "selection.target_batch_size": 2, "precision_options.fallback.min_speedup": 0.01,
        "precision_options.calibration.target_cpu": "avx2"})
    result, selection = build_auto(model, recipe, "onnxruntime", "auto", data, tmp_path / "out")
    fp32, int8 = selection.candidates
    assert result.precision == "fp32" and selection.winner is fp32
    assert int8.artifact_dir is None and int8.verdict.startswith("dropped: its steering samples' loss is"), int8.verdict
    assert "far outside what a rescue has recovered" in int8.verdict
    assert "benchmark" not in int8.stage_seconds  # stopped in its precision stage, before any search or timing
    assert any(e.step == "precision" and "FAILED" in e.detail for e in selection.progress
               if e.candidate.startswith("onnxruntime int8"))
    assert "dropped: its steering samples' loss is" in (tmp_path / "out" / "det-auto-selection.md").read_text()
