import pytest

from accel_opt.errors import UsageError
from accel_opt.recipe.load import load_recipe, parse_shapes
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
        ("accuracy:\n  split: {calibration_fraction: 0.9, steering_fraction: 0.5}\n", "at least a tenth of --data is held out"),
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
