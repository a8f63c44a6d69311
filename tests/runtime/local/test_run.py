"""`accel-opt run`: a built artifact over real image files and .npz feeds, as a batch service runs it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from accel_opt import runtime
from accel_opt.builder.pipeline import build
from accel_opt.cli import main
from accel_opt.data import load_samples
from accel_opt.errors import InputRejected, UsageError
from accel_opt.preprocess.images import preprocess_image
from accel_opt.recipe.deployed import Postprocess, Preprocessing
from accel_opt.runtime.local.job import errors_path, run_job
from accel_opt.runtime.output import Outputs
from tests.conftest import CLASSIFIER_PRE, image_npz_folder

PRE = CLASSIFIER_PRE


WIDE_TOLERANCE = {"max_error": 10.0, "max_sample_error": 10.0, "min_cosine": 0.0, "min_sample_cosine": 0.0,
                  "max_gain_error": 10.0, "strict_min_bound": 0.5}  # for tests of what a build does, not of how
                                                                    # accurate it is (5 held-out samples do)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_predictions_in_input_order_match_the_model(classifier, photos, tmp_path, tiny_cnn_path):
    out = tmp_path / "preds.jsonl"
    deployment = runtime.load(classifier)
    assert deployment.config.output_batch_axes == {"logits": 0} and deployment.batch_size == 4  # found by the gate
    summary = run_job(deployment, [photos], out, workers=2)
    assert summary.exit_code == 0 and summary.predicted == 12 and summary.rejected == 0
    lines = _lines(out)
    files = sorted(photos.iterdir())
    assert [line["input"] for line in lines] == [str(photos / f.name) for f in files]
    # The same answer as running the fp32 model on the build's own preprocessing, one image at a time.
    import onnxruntime as ort

    session = ort.InferenceSession(str(tiny_cnn_path), providers=["CPUExecutionProvider"])
    for line, file in zip(lines, files):
        with Image.open(file) as img:
            logits = session.run(None, {"image": preprocess_image(img.convert("RGB"), Preprocessing(**PRE))})[0][0]
        assert line["top1"] == int(np.argmax(logits))
        assert len(line["topk"]) == 3 and line["topk"][0][0] == line["top1"]
        assert sum(score for _, score in line["topk"]) <= 1.0 + 1e-6


def test_folders_are_read_recursively_and_globs_and_file_uris_listed(classifier, photos, tmp_path):
    """The listing rule both engines share: sub-folders are inputs too (they were not, for this engine only)."""
    files = sorted(photos.iterdir())
    deep = tmp_path / "in" / "a" / "b"
    deep.mkdir(parents=True)
    shutil.copy(files[0], tmp_path / "in" / "top.jpg")
    shutil.copy(files[1], deep / "deep.jpg")
    (deep / "notes.txt").write_text("not an input")
    out = tmp_path / "preds.jsonl"
    summary = run_job(runtime.load(classifier), [tmp_path / "in", f"{photos}/0[45]_0.jpg", f"file://{files[2]}"], out)
    assert summary.exit_code == 0
    assert [line["input"] for line in _lines(out)] == [str(deep / "deep.jpg"), str(tmp_path / "in" / "top.jpg"),
                                                       str(photos / "04_0.jpg"), str(photos / "05_0.jpg"),
                                                       f"file://{files[2]}"]
    remote = CliRunner().invoke(main, ["run", str(classifier), "s3://bucket/photos", "--out",
                                       str(tmp_path / "s3.jsonl")])
    assert remote.exit_code == 2 and "--engine ray reads other file systems" in remote.stderr
    nested_out = CliRunner().invoke(main, ["run", str(classifier), str(tmp_path / "in"), "--out",
                                           str(deep / "p.jsonl")])
    assert nested_out.exit_code == 2 and "inside the input folder" in nested_out.stderr  # it would read its own output


def test_bad_inputs_are_listed_and_the_others_predicted(classifier, photos, tmp_path):
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 not really a jpeg")
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, image=np.zeros((1, 3, 16, 16), np.float32))
    good_npz = tmp_path / "good.npz"
    np.savez(good_npz, image=np.zeros((1, 3, 32, 32), np.float32))
    text = tmp_path / "text.npz"
    text.write_text("not an archive")
    out = tmp_path / "preds.jsonl"
    inputs = [photos / "00_0.jpg", broken, wrong, tmp_path / "missing.png", good_npz, text, photos / "01_1.jpg"]
    result = CliRunner().invoke(main, ["run", str(classifier), *map(str, inputs), "--out", str(out), "--json"])
    assert result.exit_code == 3, result.stderr
    summary = json.loads(result.stdout)
    assert summary["predicted"] == 3 and summary["rejected"] == 4
    assert [line["input"] for line in _lines(out)] == [str(inputs[0]), str(good_npz), str(inputs[6])]
    errors = {e["input"]: e["error"] for e in _lines(errors_path(out))}
    assert "not a readable image" in errors[str(broken)]
    assert "dim 2 is 16" in errors[str(wrong)] or "shape" in errors[str(wrong)]
    assert errors[str(tmp_path / "missing.png")] == "not found"
    assert errors[str(text)] == "not a .npz (zip) file"  # not numpy's "contains pickled data"
    assert not any(e.startswith("--data") for e in errors.values())  # a run's inputs are not the build's --data


def test_a_decompression_bomb_is_refused_not_a_crash(classifier, photos, tmp_path, monkeypatch):
    """An image over Pillow's decompression-bomb limit (a small file that would decode to gigabytes) is
    listed in the errors file before any pixel is decoded and the job goes on (exit 3); in `--data` it is
    a refusal naming the file (exit 3), not an internal error."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 200_000)  # refused beyond 2x this: a 700x700 image, not the photos
    bomb = tmp_path / "bomb.png"
    Image.new("L", (700, 700)).save(bomb)
    out = tmp_path / "p.jsonl"
    result = CliRunner().invoke(main, ["run", str(classifier), str(photos / "00_0.jpg"), str(bomb), "--out", str(out)])
    assert result.exit_code == 3, result.output
    assert [line["input"] for line in _lines(out)] == [str(photos / "00_0.jpg")]
    assert "decompression bomb" in _lines(errors_path(out))[0]["error"]

    data = tmp_path / "data"
    data.mkdir()
    bomb.rename(data / "bomb.png")
    deployed = runtime.load(classifier).config
    with pytest.raises(InputRejected, match="bomb.png: refused"):
        load_samples(data, deployed.inputs, Preprocessing(**PRE))


def test_resume_skips_what_was_answered_and_drops_a_partial_line(classifier, photos, tmp_path):
    out = tmp_path / "preds.jsonl"
    deployment = runtime.load(classifier)
    run_job(deployment, [photos / "00_0.jpg", photos / "00_1.jpg"], out)
    complete = out.read_text()
    with open(out, "a") as f:
        f.write('{"input": "' + str(photos / "01_0.jpg") + '", "top1"')  # a run killed mid-line
    with pytest.raises(UsageError, match="--resume"):
        run_job(deployment, [photos], out)
    summary = run_job(deployment, [photos], out, resume=True)
    assert summary.skipped == 2 and summary.predicted == 10
    lines = _lines(out)
    assert out.read_text().startswith(complete) and len(lines) == 12
    assert len({line["input"] for line in lines}) == 12


def test_bad_out_paths_are_usage_errors_and_resume_leaves_a_foreign_file_alone(classifier, photos, tmp_path):
    image = str(photos / "00_0.jpg")
    result = CliRunner().invoke(main, ["run", str(classifier), image, "--out", str(tmp_path)])
    assert result.exit_code == 2 and "is a folder" in result.stderr
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = CliRunner().invoke(main, ["run", str(classifier), image, "--out", str(blocker / "p.jsonl")])
    assert result.exit_code == 2 and "cannot write there" in result.stderr
    foreign = tmp_path / "notes.jsonl"
    foreign.write_bytes(b'{"a": 1}\n\xff\xfe partial')
    result = CliRunner().invoke(main, ["run", str(classifier), image, "--out", str(foreign), "--resume"])
    assert result.exit_code == 3 and "not a predictions file" in result.stderr
    assert foreign.read_bytes() == b'{"a": 1}\n\xff\xfe partial'  # not truncated: it is not ours


def test_feeds_without_postprocess_get_an_npz_each(tiny_cnn_path, tmp_path):
    from accel_opt.recipe.load import load_recipe
    from tests.conftest import FAST_BENCH

    result = build(tiny_cnn_path, load_recipe().with_overrides(benchmark=FAST_BENCH), out_dir=tmp_path / "out",
                   data_dir=image_npz_folder(tmp_path / "data", 5))
    feeds = tmp_path / "data"
    out = tmp_path / "preds.jsonl"
    summary = run_job(runtime.load(result.artifact_dir), [feeds], out)
    assert summary.predicted == 5
    for line, feed in zip(_lines(out), sorted(feeds.iterdir())):
        with np.load(line["outputs"]) as saved, np.load(feed) as given:
            assert saved["logits"].shape == (1, 10)
            assert line["input"] == str(feed) and given["image"].shape == (1, 3, 32, 32)
    # --overwrite starts over: the earlier job's .npz files go with its lines, none is left unnamed.
    first_two = sorted(feeds.iterdir())[:2]
    assert run_job(runtime.load(result.artifact_dir), first_two, out, overwrite=True).predicted == 2
    assert sorted(Path(line["outputs"]) for line in _lines(out)) == sorted(Outputs(out).outputs_dir.iterdir())


def test_images_need_recorded_preprocessing(tiny_cnn_path, photos, tmp_path):
    from accel_opt.recipe.load import load_recipe
    from tests.conftest import FAST_BENCH

    result = build(tiny_cnn_path, load_recipe().with_overrides(benchmark=FAST_BENCH), out_dir=tmp_path / "out")
    with pytest.raises(UsageError, match="without image `preprocessing`"):
        run_job(runtime.load(result.artifact_dir), [photos], tmp_path / "p.jsonl")
    assert Postprocess(topk=1).softmax  # the default: probabilities, not logits


def test_bench_times_the_artifact_again_as_deployed(classifier, photos, tmp_path):
    import shutil

    junit = tmp_path / "bench.xml"
    result = CliRunner().invoke(main, ["bench", str(classifier), "--batch-sizes", "1,4", "--json", "--out",
                                       str(tmp_path / "b.json"),
                                       "--junit", str(junit)])
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    # The JUnit file carries the real checks: the folder verified, its sign-off holding on this machine class.
    assert [c["name"] for c in payload["checks"]] == ["verified",
                                                      "signed off here"] and all(c["passed"] for c in payload["checks"])
    assert junit.read_text().count("<testcase") == 2 and "<failure" not in junit.read_text()
    # A limit it misses fails the bench (exit 1) and its JUnit case, with the numbers.
    limited = CliRunner().invoke(main, ["bench", str(classifier), "--batch-sizes", "1", "--max-p99-ms", "0.0001",
                                        "--min-throughput", "1", "--junit", str(junit)])
    assert limited.exit_code == 1 and "p99 at batch 1 FAILED: p99" in limited.stderr
    assert junit.read_text().count("<testcase") == 4 and junit.read_text().count("<failure") == 1
    (model,) = payload["benchmark"]["models"]
    assert model["label"] == "onnxruntime-fp32" and [b["batch_size"] for b in model["batches"]] == [1, 4]
    assert payload["data"]["source"] == "synthetic" and (tmp_path / "b.json").is_file()
    with_images = CliRunner().invoke(main, ["bench", str(classifier), "--data", str(photos)])
    assert with_images.exit_code == 0 and "| onnxruntime-fp32 | 1 |" in with_images.stdout
    copy = Path(shutil.copytree(classifier, tmp_path / classifier.name))
    (copy / "model.onnx").write_bytes(b"changed")
    refused = CliRunner().invoke(main, ["bench", str(copy)])
    assert refused.exit_code == 3 and "sha256 does not match" in refused.stderr


@pytest.mark.parametrize("sizes", ["0", "1,x", ","])
def test_bench_batch_sizes_must_be_positive_integers(classifier, sizes):
    result = CliRunner().invoke(main, ["bench", str(classifier), "--batch-sizes", sizes])
    assert result.exit_code == 2 and "expected positive integers" in result.stderr


def test_build_from_images_measures_the_application_not_only_the_model(classifier):
    bench = json.loads((classifier / "benchmark.json").read_text())
    stages = {s["batch_size"]: s for s in bench["stages_ms"]}
    assert set(stages) == {1, 2}
    for s in stages.values():
        assert s["decode_ms"] > 0 and s["preprocess_ms"] > 0 and s["compute_ms"] > 0 and s["h2d_ms"] == 0
        assert s["bottleneck"] in ("read", "decode", "preprocess", "compute", "postprocess")
    assert stages[2]["decode_ms"] == pytest.approx(2 * stages[1]["decode_ms"])  # per input, times the batch
    assert "h2d and d2h are 0 on a CPU backend" in bench["stage_note"]
    naive, fast = bench["jobs"]
    assert naive["pipeline"] == "naive" and fast["pipeline"] == "accel-opt run"
    assert naive["inputs"] == fast["inputs"] == 12 and naive["seconds"] > 0 and fast["seconds"] > 0
    assert "batches of 4" in fast["description"]
    page = (classifier / "signoff.html").read_text()
    assert page.count("data:image/png;base64,") == 2 and "The whole job" in page


def test_fused_preprocessing_takes_uint8_crops_and_is_checked_against_the_host_pipeline(tiny_cnn_path, photos,
                                                                                       tmp_path):
    import onnx

    from accel_opt.recipe.load import load_recipe
    from tests.conftest import FAST_BENCH

    recipe = load_recipe().with_overrides(benchmark=FAST_BENCH, preprocessing={**PRE, "fused": True},
                                          postprocess={"topk": 3}, **{"selection.target_batch_size": 4})
    result = build(tiny_cnn_path, recipe, data_dir=photos, out_dir=tmp_path / "out")
    assert result.signed_off, result.failures  # the fused model on uint8 crops vs the reference on host floats
    folder = Path(result.artifact_dir)
    (image,) = onnx.load(str(folder / "model.onnx")).graph.input
    assert image.type.tensor_type.elem_type == onnx.TensorProto.UINT8
    assert [d.dim_value for d in image.type.tensor_type.shape.dim][1:] == [32, 32, 3]
    accuracy = json.loads((folder / "accuracy.json").read_text())
    assert accuracy["outputs"][0]["error"] < 1e-4 and accuracy["evaluation"]["mode"] == "batched"
    config = json.loads((folder / "resource_config.json").read_text())
    assert config["preprocessing"]["fused"] is True and config["inputs"][0]["shape_used"] == [4, 32, 32, 3]
    fused, host = tmp_path / "fused.jsonl", tmp_path / "host.jsonl"
    run_job(runtime.load(folder), [photos], fused)
    unfused = build(tiny_cnn_path, recipe.with_overrides(preprocessing=PRE), data_dir=photos, out_dir=tmp_path / "out")
    run_job(runtime.load(unfused.artifact_dir), [photos], host)
    assert [line["top1"] for line in _lines(fused)] == [line["top1"] for line in _lines(host)]
    rebench = CliRunner().invoke(main, ["bench", str(folder), "--data", str(photos), "--batch-sizes", "1"])
    assert rebench.exit_code == 0, rebench.stderr  # the artifact re-timed on the crops it takes
    assert CliRunner().invoke(main, ["bench", str(folder)]).exit_code == 2  # no synthetic crops
    versus = CliRunner().invoke(main, ["compare", unfused.artifact_dir, str(folder), "--data", str(photos),
                                       "--reference", str(tiny_cnn_path), "--json"])
    assert versus.exit_code == 0, versus.stdout + versus.stderr
    assert json.loads(versus.stdout)["candidate"]["accuracy"]["failures"] == []
    with pytest.raises(UsageError, match="fused needs --data with image files"):
        build(tiny_cnn_path, recipe, out_dir=tmp_path / "out")


@pytest.mark.slow
@pytest.mark.skipif(__import__("importlib").util.find_spec("openvino") is None, reason="openvino is not installed")
def test_fused_preprocessing_on_openvino_int8_keeps_its_fp32_baseline_unfused(tiny_cnn_path, photos, tmp_path):
    from accel_opt.recipe.load import load_recipe
    from tests.conftest import FAST_BENCH

    # What is checked here is the baseline's shape, not the quantizer: a wide int8 tolerance keeps the build signed off.
    recipe = load_recipe().with_overrides(benchmark=FAST_BENCH, preprocessing={**PRE, "fused": True},
                                          backend="openvino",
                                          precision="int8", **{"selection.target_batch_size": 4,
                                                               "accuracy.tolerances": {"int8": WIDE_TOLERANCE}})
    result = build(tiny_cnn_path, recipe, data_dir=photos, out_dir=tmp_path / "out")
    assert result.exit_code == 0 and result.headline[0].speedup_vs_fp32 is not None
    config = json.loads((Path(result.artifact_dir) / "resource_config.json").read_text())
    assert config["settings"]["static_shapes"] == {"image": [4, 32, 32, 3]}


def test_draft_decoding_is_checked_by_the_gate_against_full_decodes(tiny_cnn_path, photos, tmp_path):
    """draft_decode: JPEGs decode at a reduced DCT scale (less work), and the gate runs the candidate on
    those inputs against the reference on full decodes: the pixels differ, so the gate's error is not 0."""
    from accel_opt.preprocess.images import decode_image
    from accel_opt.recipe.deployed import Preprocessing
    from accel_opt.recipe.load import load_recipe
    from tests.conftest import FAST_BENCH

    big = next(p for p in sorted(photos.iterdir()) if Image.open(p).size[0] >= 4 * PRE["resize"])
    with Image.open(big) as img:
        full = decode_image(img, Preprocessing(**PRE))
    with Image.open(big) as img:
        small = decode_image(img, Preprocessing(**PRE, draft_decode=True))
    assert min(small.size) >= PRE["resize"] and small.size[0] * 2 <= full.size[0]  # at least 2x fewer pixels per side

    recipe = load_recipe().with_overrides(benchmark=FAST_BENCH, preprocessing={**PRE, "draft_decode": True},
                                          postprocess={"topk": 3}, **{"selection.target_batch_size": 4})
    result = build(tiny_cnn_path, recipe, data_dir=photos, out_dir=tmp_path / "out")
    folder = Path(result.artifact_dir)
    accuracy = json.loads((folder / "accuracy.json").read_text())
    assert accuracy["outputs"][0]["error"] > 1e-4  # draft-decoded candidate vs fully decoded reference
    assert json.loads((folder / "resource_config.json").read_text())["preprocessing"]["draft_decode"] is True
    out = tmp_path / "p.jsonl"
    assert not result.signed_off  # the fp32 tolerance is tighter than what draft decoding changes: allowed, it runs
    run_job(runtime.load(folder, allow_not_signed_off=True), [photos], out)
    assert len(_lines(out)) == len(list(photos.iterdir()))
