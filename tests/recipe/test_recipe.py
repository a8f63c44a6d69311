import pytest

from accel_opt.errors import UsageError
from accel_opt.recipe.load import load_recipe, parse_shapes
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.types import Precision


def test_default_recipe_loads_by_name():
    recipe = load_recipe()
    assert recipe.name == "default"
    assert recipe.precision is Precision.fp32
    assert recipe.tolerance.min_cosine == pytest.approx(0.99999)


def test_every_bundled_recipe_validates():
    from accel_opt.recipe.load import RECIPES_DIR

    names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    assert "default" in names
    for name in names:
        load_recipe(name)


@pytest.mark.parametrize(
    "text, message",
    [
        ("precision: fp32\nbogus: 1\n", "bogus"),
        ("benchmark:\n  min_iterations: many\n", "benchmark.min_iterations"),
        ("precision: fp8\n", "precision"),
        ("accuracy:\n  tolerances:\n    fp16: {atol: 1, rtol: 1, min_cosine: 0.9, extra: 2}\n", "extra"),
        ("- just\n- a list\n", "mapping"),
        ("key: [unclosed\n", "not valid YAML"),
        ("!!python/object/apply:os.system ['true']\n", "not valid YAML"),
        ("accuracy:\n  split: {calibration_fraction: 0.9, steering_fraction: 0.5}\n",
         "at least a tenth of --data is held out"),
        # Fuzzed recipes that used to crash far from the recipe (exit 70): refused where they are read.
        ("description: " + "[" * 600 + "]" * 600 + "\n", "nested too deeply|description"),  # exit 2 either way
        ("accuracy:\n  task_metrics: [{kind: cosine, min_mean_cosine: .nan}]\n", "min_mean_cosine"),
        ("accuracy:\n  tolerances:\n    int8: {max_sample_error: .inf}\n", "max_sample_error"),
        ("accuracy:\n  task_metrics: [{kind: topk, min_agreement: {1: .nan}}]\n", "min_agreement"),
        ("benchmark:\n  window_seconds: .inf\n", "window_seconds"),
        ("preprocessing: {resize: 10, crop: 0}\n", "crop"),
        ("preprocessing: {resize: 0, crop: 8}\n", "resize"),
        ("accuracy: {seed: -1}\n", "seed"),
    ],
)
def test_bad_recipe_is_a_usage_error(tmp_path, text, message):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(UsageError, match=message) as info:
        load_recipe(path)
    assert info.value.exit_code == 2
    assert "\n" not in str(info.value)


def test_missing_recipe_lists_bundled_ones():
    with pytest.raises(UsageError, match="bundled: .*default"):
        load_recipe("no-such-recipe")


def test_partial_tolerances_keep_other_defaults(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("accuracy:\n  tolerances:\n    fp16: {atol: 0.5, rtol: 0.5, min_cosine: 0.9}\n")
    recipe = load_recipe(path)
    assert recipe.accuracy.tolerances[Precision.fp16].atol == 0.5
    assert recipe.accuracy.tolerances[Precision.int8].min_cosine == 0.99


def test_overrides_only_apply_given_values():
    recipe = load_recipe().with_overrides(precision="fp16", backend=None, **{"benchmark.threads": 3})
    assert recipe.precision is Precision.fp16
    assert recipe.backend.value == "onnxruntime"
    assert recipe.benchmark.threads == 3
    assert recipe.fingerprint() != load_recipe().fingerprint()


def test_parse_shapes():
    assert parse_shapes("x:1x3x224x224,ids:2x128") == {"x": [1, 3, 224, 224], "ids": [2, 128]}
    assert parse_shapes("ns:x:4") == {"ns:x": [4]}
    for bad in ("x", "x:1xa", "x:0x3", ","):
        with pytest.raises(UsageError):
            parse_shapes(bad)


def test_a_folder_named_like_a_bundled_recipe_does_not_hide_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").mkdir()
    assert load_recipe("default").name == "default"


def test_zero_tolerances_are_judged_not_divided_by(tmp_path):
    """All-zero fp32 limits (the schema allows 0: no error at all): the report's loss is 0 where nothing differs and
    infinite where anything does, never a ZeroDivisionError."""
    import numpy as np

    from accel_opt.accuracy import judge
    from accel_opt.recipe.gate import Tolerance

    zero = Tolerance(max_error=0, max_sample_error=0, min_cosine=0.99, min_sample_cosine=0.99, max_gain_error=0)
    same = [{"y": np.array([1.0, 2.0])}]
    assert judge(same, same, ["a"], zero).loss < 1e-9 and judge(same, same, ["a"], zero).passed
    assert judge(same, [{"y": np.array([1.0, 2.5])}], ["a"], zero).loss == float("inf")


@pytest.mark.parametrize("where", ["folder", "below a file"])
def test_a_junit_path_that_cannot_be_written_is_refused_before_the_build(tmp_path, where):
    from click.testing import CliRunner

    from accel_opt.cli import main
    from tests.conftest import matmul_model, save

    (tmp_path / "taken").mkdir()
    (tmp_path / "file.txt").write_text("x")
    junit = tmp_path / "taken" if where == "folder" else tmp_path / "file.txt" / "j.xml"
    done = CliRunner().invoke(main, ["build", str(save(matmul_model(), tmp_path / "m.onnx")), "--junit", str(junit),
                                     "--out", str(tmp_path / "out")])
    assert done.exit_code == 2 and "--junit" in done.stderr and done.stderr.count("\n") == 1, done.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("overrides, key", [
    ({"accuracy.task_metrics": [{"kind": "topk", "output": "no_such_output"}]}, "accuracy.task_metrics[0].output"),
    ({"postprocess": {"embedding": {"output": "nope"}}}, "postprocess.embedding.output"),
    ({"postprocess": {"topk": 3, "output": "nope"}}, "postprocess.output"),
])
def test_an_output_the_model_lacks_is_refused_when_the_recipe_meets_the_model(tmp_path, overrides, key):
    """Output names are checked against the loaded model: exit 2 naming the key and the model's outputs, before
    anything is built (was a KeyError, exit 70)."""
    import yaml
    from click.testing import CliRunner

    from accel_opt.cli import main
    from tests.conftest import matmul_model, save

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(load_recipe().with_overrides(**overrides).model_dump(mode="json")))
    done = CliRunner().invoke(main, ["build", str(save(matmul_model(), tmp_path / "m.onnx")), "--recipe", str(recipe),
                                     "--out", str(tmp_path / "out")])
    assert done.exit_code == 2 and done.stderr.count("\n") == 1, done.output
    assert f"the recipe's {key} names" in done.stderr and "(its outputs: y)" in done.stderr
    assert not any((tmp_path / "out").glob("m-*"))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"precision_options.calibration.weight_rounding": "adaround"},
     "quantizer nncf calibrates with NNCF's own presets: weight_rounding must keep the default"),
    ({"precision_options.calibration.per_channel": False}, "per_channel must keep the default"),
    ({"preprocessing": {"fused": True}}, "preprocessing.fused rewrites the ONNX graph"),
])
def test_nncf_refuses_the_keys_it_would_silently_replace(overrides, message):
    recipe = load_recipe("image-classifier").with_overrides(**{"precision_options.calibration.quantizer": "nncf"})
    assert recipe.precision_options.calibration.quantizer == "nncf"
    with pytest.raises(UsageError, match=message):
        recipe.with_overrides(**overrides)
    with pytest.raises(UsageError, match="smooth_quant run in NNCF only"):
        load_recipe().with_overrides(**{"precision_options.calibration.smooth_quant": True})


def test_moving_average_is_refused_where_no_min_max_ranges_are_averaged():
    with pytest.raises(UsageError, match="method percentile takes none"):
        load_recipe().with_overrides(**{"precision_options.calibration.moving_average": True,
                                        "precision_options.calibration.method": "percentile"})


def test_more_threads_than_cpus_is_refused_before_anything_is_built(tmp_path):
    """A fuzzed recipe's 7919 threads once kept a two-node build running for minutes on 2 vCPUs."""
    from accel_opt.builder.auto import build_auto
    from accel_opt.builder.pipeline import build
    from accel_opt.machine.cpu import available_cpus
    from tests.conftest import matmul_model, save

    recipe = load_recipe().with_overrides(**{"benchmark.threads": available_cpus() + 1})
    model = save(matmul_model(), tmp_path / "m.onnx")
    for run in (lambda: build(model, recipe, out_dir=tmp_path / "out"),
                lambda: build_auto(model, recipe, "auto", "auto", None, out_dir=tmp_path / "out")):
        with pytest.raises(UsageError, match=f"more than the {available_cpus()} CPUs this process may use"):
            run()
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_recipe_extends_another_key_by_key(tmp_path):
    (tmp_path / "mine.yaml").write_text("extends: text-encoder\nname: mine\nprecision: fp32\n"
                                        "text:\n  max_length: 64\naccuracy:\n  seed: 7\n")
    mine, base = load_recipe(tmp_path / "mine.yaml"), load_recipe("text-encoder")
    assert (mine.name, mine.precision.value, mine.text.max_length, mine.accuracy.seed) == ("mine", "fp32", 64, 7)
    assert mine.text.inputs == base.text.inputs and mine.accuracy.tolerances == base.accuracy.tolerances  # merged, kept
    assert load_recipe("text-classifier").text.inputs == base.text.inputs  # a bundled recipe extends another too
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(UsageError, match="loops or nests too deep"):
        load_recipe(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("extends: nowhere\n")
    with pytest.raises(UsageError, match="recipe not found: nowhere"):
        load_recipe(tmp_path / "c.yaml")


def test_the_search_samples_key_is_read_by_its_earlier_name_too(tmp_path):
    """`precision_options.fallback.steering_samples` was `probe_samples` (a word the folder's re-check set keeps)."""
    (tmp_path / "old.yaml").write_text("extends: default\nprecision_options:\n  fallback:\n    probe_samples: 12\n")
    assert load_recipe(tmp_path / "old.yaml").precision_options.fallback.steering_samples == 12  # over the base's 32
    assert Recipe().with_overrides(**{"precision_options.fallback.probe_samples": 8}).precision_options.fallback \
        .steering_samples == 8
    assert "probe_samples" not in Recipe().model_dump(mode="json")["precision_options"]["fallback"]


def test_every_recipe_problem_is_named_at_once_with_its_line_and_the_key_it_was_meant_to_be(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: x\nprecision: int9\nbenchmark:\n  batch_sise: [1]\n  warmup_iterations: -1\n"
                    "accuracy:\n  tolerances:\n    int8:\n      max_eror: 0.1\nbackendd: onnxruntime\n")
    with pytest.raises(UsageError) as caught:
        load_recipe(path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"recipe {path}: 5 problems: line 2: precision: ")
    for expected in ("line 4: benchmark.batch_sise: unknown key (did you mean batch_sizes?)",
                     "line 5: benchmark.warmup_iterations: Input should be greater than or equal to 0",
                     "line 9: accuracy.tolerances.int8.max_eror: unknown key (did you mean max_error?)",
                     "line 10: backendd: unknown key (did you mean backend?)"):
        assert expected in message
