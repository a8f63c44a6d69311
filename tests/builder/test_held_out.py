"""A sign-off holds on samples none of the build's stages saw: the split into roles is recorded and disjoint, every
rate is judged by its confidence bound, and too few held-out samples is its own answer (exit 6).

The constructed case: a classifier whose int8 error is concentrated on a known subset of inputs. Its input carries a
constant channel of 100 that sets the input's int8 range (a step of ~0.4), while for the "hard" inputs a feature of
-0.1 alone decides between two otherwise tied classes; int8 rounds it to 0, so every hard input's top-1 changes, and no
other input's does (their classes are decided by margins of 5-6). Hard inputs are put where the split deals held-out
samples only: the steering samples (what a small judged set would see) show no change, the held-out ones do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from xml.etree import ElementTree

import numpy as np
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from accel_opt.builder.pipeline import build
from accel_opt.cli import main
from accel_opt.data import split_roles
from accel_opt.recipe.gate import SplitConfig
from tests.conftest import FAST_BENCH, make_model, save

TOP1_95 = {"accuracy.task_metrics": [{"kind": "topk", "min_agreement": {1: 0.95}}],
           "precision_options.fallback.enabled": False}


def tie_classifier() -> object:
    """x [batch, 4] -> logits [batch, 2]: logit0 = x2 + x1, logit1 = x3 - x1 (x0 only sets the range; weights of +-1
    are exact in int8)."""
    w = np.array([[0, 0], [1, -1], [1, 0], [0, 1]], np.float32)
    return make_model([helper.make_node("MatMul", ["x", "W"], ["logits"], name="head")],
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                      [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 2])],
                      [numpy_helper.from_array(w, "W")])


def write_data(folder: Path, count: int, hard_share: float = 0.0, calibrates: bool = True,
               seed: int = 0) -> tuple[Path, set[int]]:
    """`count` distinct samples; `hard_share` of them hard (int8 changes their top-1), all among the held-out samples.
    """
    split = split_roles([str(i) for i in range(count)], SplitConfig(), calibrates, 64, 300, seed=0)
    rng = np.random.default_rng(seed)
    hard = set(split.verdict[: round(hard_share * count)])
    folder.mkdir(parents=True)
    for i in range(count):
        x = np.array([100.0, 0.0, 20.0, 20.0], np.float32) + np.array([0, 0, 1, 1], np.float32) * rng.random()
        if i in hard:
            x[1] = -0.1  # class 1 by 0.2 in fp32; int8 rounds the feature to 0: a tie, and argmax says class 0
        else:
            x[2 + int(rng.integers(2))] += 5.0 + rng.random()  # a clear class either way
        np.savez(folder / f"s{i:03d}.npz", x=x[None])
    return folder, hard


@pytest.fixture()
def recipe(fast_recipe):
    return fast_recipe.with_overrides(precision="int8", **TOP1_95)


def test_a_build_that_passes_on_the_steering_samples_is_not_signed_off_when_held_out_ones_fail(recipe, tmp_path):
    model = save(tie_classifier(), tmp_path / "tie.onnx")
    data, hard = write_data(tmp_path / "data", 120, hard_share=0.1)
    result = build(model, recipe, data_dir=data, out_dir=tmp_path / "out")
    assert not result.signed_off and result.exit_code == 1 and result.verdict.outcome == "gate failed"
    accuracy = json.loads((Path(result.artifact_dir) / "accuracy.json").read_text())
    assert accuracy["steering"]["passed"]  # what a small judged set saw: no change at all
    (top1,) = [c for c in accuracy["checks"] if c["name"].endswith("top1")]
    assert top1["evidence"]["failures"] == len(hard) and top1["evidence"]["trials"] == accuracy["sample_count"]
    assert not top1["passed"]
    assert f"({len(hard)} changed of {accuracy['sample_count']} held-out samples) < 95.0%" in top1["line"]


def test_the_manifest_records_a_split_with_no_sample_in_two_roles(recipe, tmp_path):
    model = save(tie_classifier(), tmp_path / "tie.onnx")
    data, _ = write_data(tmp_path / "data", 110)
    result = build(model, recipe, data_dir=data, out_dir=tmp_path / "out")
    assert result.signed_off, result.failures
    split = json.loads((Path(result.artifact_dir) / "manifest.json").read_text())["data"]["split"]
    roles = {role: set(split[role]) for role in ("calibration", "steering", "verdict")}
    assert all(not (roles[a] & roles[b]) for a in roles for b in roles if a < b)  # disjoint
    assert set().union(*roles.values()) == {p.name for p in data.iterdir()}  # every sample has exactly one role
    assert {role: len(names) for role, names in roles.items()} == {"calibration": 28, "steering": 17, "verdict": 65}
    assert split["seed"] == 0 and result.data.evaluation_samples == 65 and result.data.steering_samples == 17
    accuracy = json.loads((Path(result.artifact_dir) / "accuracy.json").read_text())
    assert {w["sample"] for w in accuracy["worst_samples"]} <= roles["verdict"]  # judged: held-out samples only
    signoff = (Path(result.artifact_dir) / "signoff.md").read_text()
    assert "Samples: 65 held out" in signoff and "28 calibrated the build and 17 steered its choices" in signoff
    assert "| topk:top1 | logits | 1.0000 | 0.9550 | 0.95 | 0 changed of 65 samples | pass |" in signoff


def test_sixteen_held_out_rows_against_95_percent_are_not_enough_evidence(recipe, tmp_path):
    """28 samples: 7 calibrate, 5 steer, 16 are held out; with none changed they show top-1 agreement >= 82.9% only:
    not signed off, exit 6, and the number that would do (59) in one line, in the JSON and in the reports."""
    import yaml

    model = save(tie_classifier(), tmp_path / "tie.onnx")
    data, _ = write_data(tmp_path / "data", 28)
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe.model_dump(mode="json")))
    junit = tmp_path / "junit.xml"
    done = CliRunner().invoke(main, ["build", str(model), "--recipe", str(recipe_file), "--data", str(data), "--out",
                                     str(tmp_path / "out"), "--json", "--junit", str(junit)])
    assert done.exit_code == 6, done.output
    (case,) = [c for c in ElementTree.parse(junit).getroot().iter("testcase") if c.get("name").endswith("top1")]
    assert case.find("failure").get("type") == "InsufficientEvidence"
    said = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert said["method"] == "Clopper-Pearson (exact binomial), one-sided" and said["status"] == "insufficient"
    assert (said["trials"], said["failures"], said["minimum"], said["confidence"]) == ("16", "0", "0.95", "0.95")
    payload = json.loads(done.stdout)
    assert payload["verdict"]["outcome"] == "too few samples"
    assert payload["samples_needed"] == 59 and not payload["signed_off"]
    assert payload["data"]["evaluation_samples"] == 16 and payload["data"]["held_out_max"] == 300
    assert payload["data_samples_needed"] == 99  # 99 distinct samples: 25 calibrate, 15 steer, 59 held out
    assert payload["failures"] == [
        "logits: samples within tolerance: 16 held-out samples cannot show >= 95.0% at 95% confidence even with none "
        "failed (82.9% is the most they can); 59 needed (within error 0.2 and cosine 0.98)",
        "task metric topk on logits: top-1 agreement: 16 held-out samples cannot show >= 95.0% at 95% confidence even "
        "with none changed (82.9% is the most they can); 59 needed"]
    folder = Path(payload["artifact_dir"])
    assert json.loads((folder / "manifest.json").read_text())["exit_code"] == 6
    assert "NOT SIGNED OFF: not enough held-out samples (59 needed)" in (folder / "signoff.md").read_text()
    assert "NOT SIGNED OFF: not enough held-out samples (59 needed)" in (folder / "signoff.html").read_text()
    human = CliRunner().invoke(main, ["build", str(model), "--recipe", str(recipe_file), "--data", str(data), "--out",
                                      str(tmp_path / "out")])
    said = " ".join(human.stdout.split())  # rich wraps long lines
    assert human.exit_code == 6 and ("not enough held-out samples to certify it (59 needed with none failing): give "
                                     "--data with at least 99 distinct samples (this recipe's split holds 59 out) or "
                                     "59 "
                                     "held-out ones with --eval-data") in said


def test_held_out_samples_can_come_from_eval_data(recipe, tmp_path):
    """--eval-data: --data only calibrates and steers; the verdict is judged on the other folder, and a file that is in
    both (the same bytes) is not counted as held out."""
    model = save(tie_classifier(), tmp_path / "tie.onnx")
    data, _ = write_data(tmp_path / "data", 20)
    held, _ = write_data(tmp_path / "held", 70, calibrates=False, seed=1)
    (held / "copy.npz").write_bytes((data / "s000.npz").read_bytes())
    result = build(model, recipe, data_dir=data, eval_data_dir=held, out_dir=tmp_path / "out")
    assert result.signed_off, result.failures
    split = json.loads((Path(result.artifact_dir) / "manifest.json").read_text())["data"]["split"]
    assert len(split["verdict"]) == 70 and all(name.startswith("held/") for name in split["verdict"])
    assert "held/copy.npz" in split["unused"] and result.data.eval_path == str(held)
    assert not set(split["calibration"] + split["steering"]) & set(split["verdict"])
    # all of --data calibrates and steers (in the ratio of their shares, 25:15), none of it left unused
    assert (len(split["calibration"]), len(split["steering"])) == (13, 7) and split["unused"] == ["held/copy.npz"]


def test_the_cleanup_check_never_uses_held_out_samples(tiny_cnn_path, fast_recipe, tmp_path):
    """An fp32 build of 1 sample holds it out and steers on none: the rewrite is not checked on the held-out sample,
    so cleanup is skipped, saying why."""
    from tests.conftest import image_npz_folder

    result = build(tiny_cnn_path, fast_recipe, data_dir=image_npz_folder(tmp_path / "d1", 1), out_dir=tmp_path / "out")
    (cleanup,) = [s for s in result.stages if s.name == "cleanup"]
    assert cleanup.status == "skipped" and "no steering sample to check the rewrite on" in cleanup.detail
    assert result.signed_off and result.data.evaluation_samples == 1


def test_no_held_out_sample_left_is_a_clear_input_error(recipe, tmp_path):
    """--eval-data that only repeats --data, or --data of one sample copied: nothing is left to judge (exit 3, one
    line naming the option), and a missing --eval-data folder is named as --eval-data."""
    model = save(tie_classifier(), tmp_path / "tie.onnx")
    data, _ = write_data(tmp_path / "data", 20)
    copies = tmp_path / "copies"
    copies.mkdir()
    for i in range(4):
        (copies / f"c{i}.npz").write_bytes((data / "s000.npz").read_bytes())
    cases = {("--data", str(data), "--eval-data", str(data)): "--eval-data holds no sample that --data does not",
             ("--data", str(copies)): "--data holds only 1 distinct sample(s), all taken to calibrate and steer",
             ("--data", str(data), "--eval-data", str(tmp_path / "nowhere")): "nowhere: not found"}
    import yaml

    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe.model_dump(mode="json")))
    for flags, said in cases.items():
        done = CliRunner().invoke(main, ["build", str(model), "--recipe", str(recipe_file), *flags, "--out",
                                         str(tmp_path / "out")])
        assert done.exit_code == 3 and said in done.stderr, (flags, done.output)
    assert not any((tmp_path / "out").glob("tie-*"))  # nothing half-written


def test_fp32_is_never_refused_for_few_samples(fast_recipe, tmp_path):
    model = save(tie_classifier(), tmp_path / "tie.onnx")
    data, _ = write_data(tmp_path / "data", 10, calibrates=False)
    result = build(model, fast_recipe.with_overrides(**TOP1_95), data_dir=data, out_dir=tmp_path / "out")
    assert result.signed_off and result.exit_code == 0  # 8 rows cannot certify 95%; fp32 is judged as observed
    accuracy = json.loads((Path(result.artifact_dir) / "accuracy.json").read_text())
    assert not accuracy["bounded"] and accuracy["task_metrics"][0]["evidence"]["top1"]["status"] == "pass"


def test_auto_does_not_ship_a_candidate_whose_held_out_verdict_fails(tmp_path, fast_recipe):
    """The issue's case: int8 passes on the steering samples (the shortlist) but changes 10% of held-out answers. Auto
    reads its held-out verdict before shipping it, and ships fp32."""
    from accel_opt.builder.auto import build_auto

    model = save(tie_classifier(), tmp_path / "tie.onnx")
    data, _ = write_data(tmp_path / "data", 120, hard_share=0.1)
    recipe = fast_recipe.with_overrides(benchmark=FAST_BENCH, **TOP1_95, **{"selection.target_batch_size": 2})
    result, selection = build_auto(model, recipe, "onnxruntime", "auto", data, tmp_path / "out")
    fp32, int8 = selection.candidates
    assert int8.steering_passed and int8.held_out == "fail" and not int8.signed_off
    assert result is not None and result.precision == "fp32" and selection.winner is fp32
    assert int8.verdict.startswith(("fastest left, but its held-out verdict", "not faster than fp32")), int8.verdict
    # Auto's table puts each held-out rate beside its minimum: the bound for int8, the observed rate for fp32.
    table = (tmp_path / "out" / "tie-auto-selection.md").read_text()
    top1 = next(r for r in int8.rates if r.what == "top-1 agreement")
    assert f"top-1 agreement >= {top1.lower:.1%} vs 95.0% ({top1.failures} changed of {top1.trials} samples)" in table
    assert "top-1 agreement 100.0% observed vs 95.0% (0 changed of" in table


def test_verify_and_compare_say_what_their_samples_can_confirm(recipe, fast_recipe, tmp_path):
    """`verify --accuracy` re-checks on the folder's 16 probe samples: the observed rates hold, and the line says the
    sign-off's 95% rests on the build's held-out samples, which 16 cannot show. `compare` judges a reduced candidate
    by its bound: on 20 samples it cannot be certified, and says how many would do."""
    model = save(tie_classifier(), tmp_path / "tie.onnx")
    data, _ = write_data(tmp_path / "data", 110)
    int8 = build(model, recipe, data_dir=data, out_dir=tmp_path / "out")
    fp32 = build(model, fast_recipe.with_overrides(**TOP1_95), data_dir=data, out_dir=tmp_path / "out")
    assert int8.signed_off and fp32.signed_off, int8.failures + fp32.failures
    done = CliRunner().invoke(main, ["verify", int8.artifact_dir, "--accuracy", "--json"])
    assert done.exit_code == 0, done.output
    within, confirms = json.loads(done.stdout)["recheck"]["confirms"]  # each rate with its counts and bound
    assert within.startswith("the probe set confirms samples within tolerance >= 82.9% at 95% confidence (0 failed of "
                             "16 samples)")
    assert confirms.startswith("the probe set confirms top-1 agreement >= 82.9% at 95% confidence (0 changed of 16 "
                               "samples)")
    assert confirms.endswith("cannot confirm the minimum 95.0% alone (59 needed): that rests on the 65 held-out "
                             "samples the build judged")
    # compare on the build's own --data: the samples that calibrated or steered a build are not judged, and said so
    own = CliRunner().invoke(main, ["compare", fp32.artifact_dir, int8.artifact_dir, "--data", str(data), "--json"])
    report = json.loads(own.stdout)
    assert report["left_out"] == {"calibration": 28, "steering": 17}, own.output
    assert report["candidate"]["accuracy"]["sample_count"] == 65  # the held-out 65, as the build judged them
    few, _ = write_data(tmp_path / "few", 20, seed=3)
    compared = CliRunner().invoke(main, ["compare", fp32.artifact_dir, int8.artifact_dir, "--data", str(few), "--json"])
    assert compared.exit_code == 6, compared.output  # too few samples is its own answer, as in the build
    (signs_off,) = [c for c in json.loads(compared.stdout)["checks"] if c["name"] == "candidate signs off"]
    assert signs_off["line"].startswith("too few samples to certify the candidate (59 needed): logits: samples within")

    # The drop is gated by its paired bound, as the build bounds one: 65 samples with nothing lost bound it at 6.5%.
    bounded = CliRunner().invoke(main, ["compare", fp32.artifact_dir, int8.artifact_dir, "--data", str(data), "--json",
                                        "--max-accuracy-drop", "0.01"])
    report = json.loads(bounded.stdout)
    assert bounded.exit_code == 6 and 0.01 < report["accuracy_drop_bound"] < 0.1, bounded.output
    (drop,) = [c for c in report["checks"] if c["name"] == "accuracy drop"]
    assert "paired on 65 samples" in drop["line"]
    assert "too few samples to certify it (437 samples needed" in drop["line"]
    loose = CliRunner().invoke(main, ["compare", fp32.artifact_dir, int8.artifact_dir, "--data", str(data),
                                      "--max-accuracy-drop", "0.2"])
    assert loose.exit_code == 0, loose.output

    # Copies of the samples that calibrated or steered a build, under new names, are told by their content.
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    split = json.loads((Path(int8.artifact_dir) / "manifest.json").read_text())["data"]["split"]
    for i, name in enumerate(split["calibration"] + split["steering"]):
        shutil.copy(data / name, renamed / f"new_{i:03d}.npz")
    copied = CliRunner().invoke(main, ["compare", fp32.artifact_dir, int8.artifact_dir, "--data", str(renamed)])
    assert copied.exit_code == 3 and "calibrated or steered one of the builds" in copied.stderr, copied.output


@pytest.mark.parametrize("calibrates", [True, False])
@pytest.mark.parametrize("held_out", [5, 59, 99, 149, 299])
def test_the_data_a_user_is_told_to_give_is_the_fewest_that_hold_enough_out(held_out, calibrates):
    from accel_opt.data import data_samples_for

    count = data_samples_for(held_out, SplitConfig(), calibrates, 64)
    def verdict_of(n):
        return len(split_roles([str(i) for i in range(n)], SplitConfig(), calibrates, 64, 10**6, seed=0).verdict)
    assert verdict_of(count) >= held_out > verdict_of(count - 1)


def test_too_few_says_when_the_judged_cap_must_be_raised_too():
    from accel_opt.report.results import BuildResult, DataRecord
    from accel_opt.report.verdict import Verdict

    data = DataRecord(source="npz", path="d", synthetic=False, samples=800, evaluation_samples=300,
                      calibration_samples=64, steering_samples=32, held_out_max=300)
    result = BuildResult(model="m", precision="int8", backend="onnxruntime", verdict=Verdict(outcome="too few samples"),
                         samples_needed=598, data_samples_needed=694, data=data)
    assert result.too_few_line().endswith("; this build judges at most 300 held-out samples: raise "
                                          "accuracy.max_samples to 598 (its notes say where the memory its outputs "
                                          "take to judge lowers it)")
    assert BuildResult(model="m", precision="fp32", backend="onnxruntime",
                       verdict=Verdict(outcome="signed off")).too_few_line() is None


def _default_recipe_file(tmp_path: Path) -> Path:
    """The default recipe's gate (its benchmark shortened: what is timed is not what this judges)."""
    import yaml

    from accel_opt.recipe.load import load_recipe

    path = tmp_path / "default.yaml"
    path.write_text(yaml.safe_dump(load_recipe().with_overrides(benchmark=FAST_BENCH).model_dump(mode="json")))
    return path


def test_the_default_recipe_does_not_sign_off_a_reduced_build_on_three_files(tiny_cnn_path, tmp_path):
    """The default recipe, int8, 3 .npz files: 1 calibrates, 1 steers, 1 is held out. None failing of 1 shows nothing
    about the share of inputs within tolerance: exit 6 with the numbers that would do. fp32 of the same files keeps its
    rule (judged against the float32 noise floor, never refused for few samples)."""
    from tests.conftest import image_npz_folder

    data, recipe = image_npz_folder(tmp_path / "d3", 3), _default_recipe_file(tmp_path)
    flags = ["--data", str(data), "--recipe", str(recipe), "--out", str(tmp_path / "out")]
    int8 = CliRunner().invoke(main, ["build", str(tiny_cnn_path), "--precision", "int8", *flags])
    said = " ".join(int8.stdout.split())
    assert int8.exit_code == 6, int8.output
    assert ("NOT SIGNED OFF: not enough held-out samples to certify it (59 needed with none failing): give --data "
            "with at least 99 distinct samples") in said
    assert "samples within tolerance: 1 held-out sample cannot show >= 95.0% at 95% confidence" in said
    fp32 = CliRunner().invoke(main, ["build", str(tiny_cnn_path), *flags])
    assert fp32.exit_code == 0 and "verdict: SIGNED OFF" in " ".join(fp32.stdout.split()), fp32.output


def test_a_build_on_synthetic_inputs_says_it_certified_no_task_rate(tiny_cnn_path, tmp_path):
    done = CliRunner().invoke(main, ["build", str(tiny_cnn_path), "--precision", "fp16", "--recipe",
                                     str(_default_recipe_file(tmp_path)), "--out", str(tmp_path / "out")])
    said = " ".join(done.stdout.split())
    assert done.exit_code == 0, done.output
    assert "verdict: SIGNED OFF: numeric check only, on 8 synthetic (random) inputs: no task rate was certified" in said
    (folder,) = (tmp_path / "out").glob("tiny_cnn-fp16-*")
    assert "no task rate was certified on real inputs" in (folder / "signoff.md").read_text()


def test_auto_with_too_few_samples_is_exit_6_for_a_reduced_precision_and_ships_the_floor_for_auto(tiny_cnn_path,
                                                                                                   tmp_path):
    """Auto on 3 files: `--precision int8` cannot certify any candidate, so exit 6 with the count, never SIGNED OFF and
    never "no candidate passed"; `--precision auto` ships the fp32 floor and says which reduced candidates could not
    be certified and how many samples would do."""
    from tests.conftest import image_npz_folder

    data, recipe = image_npz_folder(tmp_path / "d3", 3), _default_recipe_file(tmp_path)
    flags = ["--data", str(data), "--recipe", str(recipe), "--out", str(tmp_path / "out")]
    int8 = CliRunner().invoke(main, ["build", str(tiny_cnn_path), "--backend", "auto", "--precision", "int8", *flags,
                                     "--json"])
    assert int8.exit_code == 6, int8.output
    assert "no winner: too few held-out samples to certify" in int8.stderr and "onnxruntime int8" in int8.stderr
    # k reduced candidates planned (which, depends on the CPU class): each is judged at 1 - 0.05 / k, where none
    # failing needs this many held-out samples to show 95% within tolerance
    from accel_opt.accuracy.evidence import trials_needed

    planned = sum(c["precision"] != "fp32" for c in json.loads(int8.stdout)["selection"]["candidates"])
    needed = trials_needed(0.95, 1 - 0.05 / planned)
    assert f": {needed} needed with none failing; give --data with at least " in int8.stderr
    payload = json.loads(CliRunner().invoke(main, ["build", str(tiny_cnn_path), "--backend", "onnxruntime",
                                                   "--precision", "auto", *flags, "--json"]).stdout)
    assert payload["exit_code"] == 0 and payload["precision"] == "fp32" and payload["signed_off"]
    (int8_candidate,) = [c for c in payload["selection"]["candidates"] if c["precision"] == "int8"]
    assert int8_candidate["samples_needed"] == 59 and int8_candidate["data_samples_needed"] == 99
    human = CliRunner().invoke(main, ["build", str(tiny_cnn_path), "--backend", "onnxruntime", "--precision", "auto",
                                      *flags])
    said = " ".join(human.stdout.split())
    assert human.exit_code == 0 and "not certified: too few held-out samples to certify onnxruntime int8: 59 needed" \
        in said, human.output


def test_groups_are_dealt_whole_and_copies_and_their_eval_samples_stay_out():
    from accel_opt.data.groups import split_groups

    keys = [f"k{i}" for i in range(30)] + ["k0"]  # the last is a copy of the first
    groups = [f"photo{i // 3}" for i in range(30)] + ["photo0"]
    split = split_groups(keys, groups, SplitConfig(), True, 64, 300, seed=0)
    roles = {role: {groups[i] for i in getattr(split, role)} for role in ("calibration", "steering", "verdict")}
    assert all(not (roles[a] & roles[b]) for a in roles for b in roles if a < b)  # no group in two roles
    assert split.groups == {role: sorted(names) for role, names in roles.items()} and 30 in split.unused
    assert len(split.calibration) == 8 and len(split.steering) == 5  # a quarter and 15% of 30, to within a group
    held = ["e0", "e1"]  # --eval-data: one sample of a group that calibrated, one of a new group
    calibrating = groups[split.calibration[0]]
    with_eval = split_groups(keys[:30], groups[:30] + [calibrating, "new"], SplitConfig(), True, 64, 300, 0, held)
    assert with_eval.verdict == [31] and 30 in with_eval.unused


def test_a_grouped_build_counts_held_out_groups_and_records_them(recipe, tmp_path):
    """120 samples from 40 sources (3 each, named in a CSV): whole sources are dealt, the verdict's rates count
    held-out sources as their trials, the manifest lists each role's groups and signoff.md says what a trial is."""
    model = save(tie_classifier(), tmp_path / "tie.onnx")
    data, _ = write_data(tmp_path / "data", 120)
    table = tmp_path / "groups.csv"
    table.write_text("file,group\n" + "".join(f"s{i:03d}.npz,source{i // 3}\n" for i in range(120)))
    result = build(model, recipe.with_overrides(**{"accuracy.split.groups_file": str(table)}), data_dir=data,
                   out_dir=tmp_path / "out")
    folder = Path(result.artifact_dir)
    accuracy = json.loads((folder / "accuracy.json").read_text())
    split = json.loads((folder / "manifest.json").read_text())["data"]["split"]
    assert accuracy["trial_unit"] == "groups" and accuracy["trial_count"] == len(split["groups"]["verdict"])
    assert sum(len(v)
               for v in split["groups"].values()) == 40 and accuracy["sample_count"] == 3 * accuracy["trial_count"]
    (top1,) = [c for c in accuracy["checks"] if c["name"].endswith("top1")]
    assert top1["evidence"]["trials"] == accuracy["trial_count"] and top1["evidence"]["unit"] == "groups"
    # fewer held-out sources than the 59 trials 95% needs with none failing: too few is the verdict
    assert result.exit_code == 6 and result.samples_needed == 59
    signoff = (folder / "signoff.md").read_text()
    assert f"over {accuracy['trial_count']} held-out groups, each one trial" in signoff
    assert "Samples grouped by their source (40 groups, dealt whole" in signoff


def test_groups_that_do_not_fit_the_samples_are_a_one_line_input_error(tmp_path):
    model = save(tie_classifier(), tmp_path / "tie.onnx")
    data, _ = write_data(tmp_path / "data", 12)
    partial = tmp_path / "partial.csv"
    partial.write_text("file,group\ns000.npz,a\n")
    stranger = tmp_path / "stranger.csv"
    stranger.write_text("file,group\n" + "".join(f"s{i:03d}.npz,g{i}\n" for i in range(12)) + "nowhere.npz,g\n")
    cases = {("--groups", str(partial)): (3, "11 sample(s) have no group, first s001.npz"),
             ("--groups", str(stranger)): (3, "names 1 file(s) that are not samples, first nowhere.npz"),
             ("--group-pattern", "^t"): (3, "--group-pattern '^t' does not match the sample s000.npz"),
             ("--group-pattern", "(unclosed"): (2, "is not a regular expression")}
    for flags, (code, said) in cases.items():
        done = CliRunner().invoke(main, ["build", str(model), "--precision", "int8", "--data", str(data), *flags,
                                         "--out", str(tmp_path / "out")])
        assert done.exit_code == code and said in done.stderr and done.stderr.count("\n") == 1, (flags, done.output)
    assert not any((tmp_path / "out").glob("tie-*"))


def test_run_and_verify_honour_a_folder_that_is_not_signed_off(tiny_cnn_path, tmp_path):
    """A folder its build did not sign off (too few held-out samples: exit 6): `run` refuses it with the build's own
    code and reason, on both engines, writing nothing; --allow-not-signed-off runs it and says so; `verify` is not ok.
    """
    from tests.conftest import image_npz_folder

    data, recipe = image_npz_folder(tmp_path / "d3", 3), _default_recipe_file(tmp_path)
    built = CliRunner().invoke(main, ["build", str(tiny_cnn_path), "--precision", "int8", "--data", str(data),
                                      "--recipe", str(recipe), "--out", str(tmp_path / "out"), "--json"])
    folder = json.loads(built.stdout)["artifact_dir"]
    out = tmp_path / "p.jsonl"
    for engine in ("local", "ray"):
        refused = CliRunner().invoke(main, ["run", folder, str(data), "--out", str(out), "--engine", engine])
        assert refused.exit_code == 6 and refused.stderr.count("\n") == 1, (engine, refused.output)
        assert "is NOT signed off: too few held-out samples to certify it (" in refused.stderr
        assert "--allow-not-signed-off" in refused.stderr and not out.exists()
    allowed = CliRunner().invoke(main, ["run", folder, str(data), "--out", str(out),
                                        "--allow-not-signed-off", "--json"])
    assert allowed.exit_code == 0 and json.loads(allowed.stdout)["not_signed_off"] is True, allowed.output
    # The old spelling still works for one release, and says it is deprecated.
    said = CliRunner().invoke(main, ["run", folder, str(data), "--out", str(out), "--allow-unsigned", "--overwrite"])
    assert said.exit_code == 0 and "--allow-unsigned is deprecated" in said.stderr, said.output
    assert "ran a folder that is NOT signed off (--allow-not-signed-off): NOT signed off: too few" in said.stderr
    verified = CliRunner().invoke(main, ["verify", folder])
    assert verified.exit_code == 6 and verified.stdout.startswith("not ok: "), verified.output
    assert "NOT signed off: too few held-out samples to certify it" in verified.stdout
    assert "; signed off" not in verified.stdout  # never "NOT signed off ... signed off" in one line
    assert json.loads(CliRunner().invoke(main, ["verify", folder, "--json"]).stdout)["signed_off"] is False
