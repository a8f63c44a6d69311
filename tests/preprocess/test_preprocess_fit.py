"""What an artifact records about taking images is what the build checked: the recipe's preprocessing is
fitted to (or refused by) the model's image input, and `accel-opt run`'s image path runs on the staged
artifact even when the build's data were .npz feed dicts or synthetic."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from accel_opt import runtime
from accel_opt.builder.pipeline import build
from accel_opt.cli import main
from accel_opt.errors import UsageError
from accel_opt.graph.inspect import TensorSpec
from accel_opt.preprocess.fit import fit_preprocessing
from accel_opt.recipe.load import load_recipe

from ..conftest import FAST_BENCH, image_npz_folder, make_model, save

CLASSIFIER = load_recipe("image-classifier").with_overrides(precision="fp32", benchmark=FAST_BENCH)


def _images(folder: Path) -> list[Path]:
    """A landscape JPEG and a portrait PNG, as a user would hand to `accel-opt run`."""
    folder.mkdir()
    rng = np.random.default_rng(3)
    paths = [folder / "wide.jpg", folder / "tall.png"]
    for path, (width, height) in zip(paths, [(300, 200), (120, 260)]):
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return paths


def _notes(artifact: Path) -> list[str]:
    return json.loads((artifact / "build.json").read_text())["notes"]


def _run(artifact: Path, inputs: list[Path], out: Path):
    return CliRunner().invoke(main, ["run", str(artifact), *map(str, inputs), "--out", str(out), "--json"])


def test_a_bundled_crop_is_fitted_to_the_model_and_run_takes_images(tiny_cnn_path, tmp_path):
    """The demo's situation: the image-classifier recipe (resize 256, crop 224) on a model fixed at 32x32,
    data as .npz feed dicts. The folder records the fitted preprocessing and `run` takes images (exit 0)."""
    result = build(tiny_cnn_path, CLASSIFIER, data_dir=image_npz_folder(tmp_path / "data", 4), out_dir=tmp_path / "out")
    assert result.signed_off, result.failures
    artifact = Path(result.artifact_dir)
    pre = runtime.load(artifact).config.preprocessing
    assert (pre.crop, pre.resize) == (32, 37)  # 256/224 * 32 = 36.6
    notes = _notes(artifact)
    assert any("crop 224 -> 32, resize 256 -> 37" in n for n in notes)
    assert any("image path was exercised" in n and "3 generated images" in n for n in notes)
    ran = _run(artifact, _images(tmp_path / "photos"), tmp_path / "preds.jsonl")
    assert ran.exit_code == 0, ran.output
    assert json.loads(ran.stdout)["predicted"] == 2


def test_without_data_the_image_path_is_exercised_too(tiny_cnn_path, tmp_path):
    result = build(tiny_cnn_path, CLASSIFIER, out_dir=tmp_path / "out")
    assert result.signed_off and result.data.synthetic
    assert any("were synthetic" in n for n in _notes(Path(result.artifact_dir)))
    ran = _run(Path(result.artifact_dir), _images(tmp_path / "photos"), tmp_path / "preds.jsonl")
    assert ran.exit_code == 0, ran.output


def _pooling_cnn(path: Path) -> Path:
    """image [batch, 3, h, w] (any size) -> Conv -> GlobalAveragePool -> [batch, 4]."""
    w = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    return save(make_model(
        [helper.make_node("Conv", ["image", "w"], ["c"], pads=[1] * 4),
         helper.make_node("GlobalAveragePool", ["c"], ["g"]),
         helper.make_node("Flatten", ["g"], ["y"])],
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], [numpy_helper.from_array(w, "w")]), path)


def test_a_folder_that_cannot_take_its_own_images_is_not_built(tmp_path):
    """A model of any size, built on 40x40 feed dicts with a 32 px crop: nothing in the model fixes the
    size, so nothing is fitted, but images would reach the 40x40 deployment as 32x32: no folder, exit 2."""
    recipe = CLASSIFIER.with_overrides(preprocessing={"resize": 36, "crop": 32})
    data = image_npz_folder(tmp_path / "data", 3, size=40)
    with pytest.raises(UsageError, match=r"does not take images .*crop 32.*shape \[1, 3, 32, 32\], the artifact takes "
                                         r"\[1, 3, 40, 40\]"):
        build(_pooling_cnn(tmp_path / "pool.onnx"), recipe, data_dir=data, out_dir=tmp_path / "out")
    assert not [p for p in (tmp_path / "out").iterdir() if not p.name.startswith(".")]
    # The same model built at the crop's size takes images.
    ok = build(_pooling_cnn(tmp_path / "pool.onnx"), recipe, data_dir=image_npz_folder(tmp_path / "d32", 3),
               out_dir=tmp_path / "out")
    assert ok.signed_off and not any("fitted" in n for n in _notes(Path(ok.artifact_dir)))


PRE = load_recipe("image-classifier")


@pytest.mark.parametrize("shape, dtype, layout, match", [
    (["batch", 16], "float32", "NCHW", "images are rank 4"),
    (["batch", 1, 28, 28], "float32", "NCHW", r"dim 1 \(NCHW channels\) is 1; images have 3 channels"),
    (["batch", 64, 64, 3], "float32", "NCHW", "set preprocessing.layout: NHWC"),
    (["batch", 3, 64, 48], "float32", "NCHW", "64x48 and the center crop is square"),
    (["batch", 3, 64, 64], "float16", "NCHW", "set preprocessing.dtype: float16"),
    (["batch", 3, 64, 64], "int64", "NCHW", "not int64"),
    ([4, 3, 64, 64], "float32", "NCHW", "batch is fixed at 4"),
])
def test_what_no_crop_can_feed_is_refused_in_one_line(shape, dtype, layout, match):
    recipe = PRE.with_overrides(**{"preprocessing.layout": layout})
    with pytest.raises(UsageError, match=match) as info:
        fit_preprocessing(recipe, [TensorSpec(name="x", dtype=dtype, shape=shape)], [])
    assert info.value.exit_code == 2 and "\n" not in str(info.value)


def test_fitting_follows_the_layout_and_leaves_fitting_crops_alone():
    notes: list[str] = []
    nhwc = PRE.with_overrides(**{"preprocessing.layout": "NHWC"})
    fitted = fit_preprocessing(nhwc, [TensorSpec(name="x", dtype="float32", shape=[1, 160, 160, 3])], notes)
    assert (fitted.preprocessing.crop, fitted.preprocessing.resize) == (160, 183) and len(notes) == 1
    one_fixed = fit_preprocessing(PRE, [TensorSpec(name="x", dtype="float32", shape=["n", 3, 128, "w"])], notes)
    assert (one_fixed.preprocessing.crop, one_fixed.preprocessing.resize) == (128, 146)  # the demo model's size
    for shape in (["n", 3, 224, 224], ["n", 3, "h", "w"]):
        assert fit_preprocessing(PRE, [TensorSpec(name="x", dtype="float32", shape=shape)], notes) is PRE
    assert len(notes) == 2


def test_preprocessing_input_must_name_the_image_input():
    specs = [TensorSpec(name="a", dtype="float32", shape=[1, 3, 8, 8]),
             TensorSpec(name="b", dtype="float32", shape=[1, 4])]
    with pytest.raises(UsageError, match="must name the image input .*a, b"):
        fit_preprocessing(PRE, specs, [])
    with pytest.raises(UsageError, match="'c' is not a model input"):
        fit_preprocessing(PRE.with_overrides(**{"preprocessing.input": "c"}), specs, [])
    named = fit_preprocessing(PRE.with_overrides(**{"preprocessing.input": "a"}), specs, [])
    assert named.preprocessing.crop == 8


def test_the_demo_builds_folders_that_run_takes_images(tmp_path):
    """`make demo`'s own model and data (examples/demo.py): the fp32 folder takes JPEGs and PNGs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo", Path(__file__).parents[2] / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    model_path, data_dir = demo.prepare(tmp_path / "demo")
    result = build(model_path, load_recipe("image-classifier").with_overrides(precision="fp32", benchmark=FAST_BENCH),
                   data_dir=data_dir, out_dir=tmp_path / "out")
    assert result.signed_off, result.failures
    assert runtime.load(result.artifact_dir).config.preprocessing.crop == demo.IMAGE_SIZE
    ran = _run(Path(result.artifact_dir), _images(tmp_path / "photos"), tmp_path / "preds.jsonl")
    assert ran.exit_code == 0, ran.output
