import numpy as np
import pytest
from onnx import TensorProto, helper

from accel_opt.data import batch_of, load_samples, sample_key, split_roles, synthetic_samples
from accel_opt.errors import InputRejected, UsageError
from accel_opt.graph.inspect import TensorSpec, io_specs, resolve_shapes
from accel_opt.recipe.load import parse_shapes
from tests.conftest import make_model

IMAGE = TensorSpec(name="image", dtype="float32", shape=["batch", 3, "h", "w"])
IDS = TensorSpec(name="ids", dtype="int64", shape=["batch", 16])


def test_io_specs_skip_initializers_and_keep_symbols():
    model = make_model(
        [helper.make_node("Identity", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
    )
    inputs, outputs = io_specs(model)
    assert inputs[0].shape == ["n", 3] and inputs[0].dtype == "float32"
    assert outputs[0].dynamic_axes == [0]


def test_dynamic_non_batch_dim_needs_a_shape():
    with pytest.raises(UsageError, match=r"image \[batch, 3, h, w\]: dim 2 \(h\), dim 3 \(w\)") as info:
        resolve_shapes([IMAGE], {})
    assert info.value.exit_code == 2


def test_every_input_a_shape_is_missing_for_is_named_at_once_with_a_value_that_works():
    tokens = [TensorSpec(name=name, dtype="int64", shape=["batch",
                                                          "sequence"]) for name in ("input_ids", "attention_mask")]
    with pytest.raises(UsageError) as info:
        resolve_shapes(tokens, {})
    message = str(info.value)
    assert message.startswith("2 input(s) have dynamic dims") and "\n" not in message
    suggested = message.rsplit("--shapes ", 1)[1]
    assert suggested == "input_ids:1x128,attention_mask:1x128"
    assert resolve_shapes(tokens, parse_shapes(suggested)).shapes == {"input_ids": [1, 128], "attention_mask": [1, 128]}


def test_batch_defaults_to_one_and_says_so():
    resolved = resolve_shapes([IDS], {})
    assert resolved.shapes == {"ids": [1, 16]}
    assert resolved.batch_dynamic
    assert "batch defaulted to 1" in resolved.notes[0]


def test_given_shapes_win_over_data_shapes():
    resolved = resolve_shapes([IMAGE], {"image": [2, 3, 64, 64]}, {"image": [1, 3, 32, 32]})
    assert resolved.shapes["image"] == [2, 3, 64, 64]
    assert resolve_shapes([IMAGE], {}, {"image": [1, 3, 32, 32]}).shapes["image"] == [1, 3, 32, 32]


@pytest.mark.parametrize(
    "given, match",
    [
        ({"nope": [1]}, "unknown input 'nope'"),
        ({"image": [1, 3, 32]}, "rank 3 given"),
        ({"image": [1, 3, 8, 8], "ids": [1, 8]}, "fixed at 16"),
    ],
)
def test_bad_shapes(given, match):
    with pytest.raises(UsageError, match=match):
        resolve_shapes([IMAGE, IDS], given)


def _write(folder, name, **arrays):
    folder.mkdir(exist_ok=True)
    np.savez(folder / name, **arrays)


GOOD = {"image": np.zeros((1, 3, 8, 8), np.float32)}


def test_npz_folder_loads_sorted(tmp_path):
    _write(tmp_path / "d", "b.npz", **GOOD)
    _write(tmp_path / "d", "a.npz", image=np.ones((1, 3, 8, 8), np.float32))
    samples, summary = load_samples(tmp_path / "d", [IMAGE], None)
    assert summary.count == 2 and summary.source == "npz" and len(summary.sha256) == 64
    assert samples[0]["image"].max() == 1.0


@pytest.mark.parametrize(
    "arrays, match",
    [
        ({"pixels": GOOD["image"]}, "do not match model inputs"),
        ({"image": np.zeros((1, 3, 8, 8), np.float64)}, "dtype float64"),
        ({"image": np.zeros((3, 8, 8), np.float32)}, "rank 3"),
        ({"image": np.zeros((1, 4, 8, 8), np.float32)}, "dim 1 is 4"),
        ({"image": np.full((1, 3, 8, 8), np.nan, np.float32)}, "NaN or Inf"),
        ({"image": np.array([object()], dtype=object)}, "without pickles"),
    ],
)
def test_bad_data(tmp_path, arrays, match):
    _write(tmp_path / "d", "x.npz", **arrays)
    with pytest.raises(InputRejected, match=match) as info:
        load_samples(tmp_path / "d", [IMAGE], None)
    assert info.value.exit_code == 3


def test_empty_or_missing_data_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputRejected, match="no .npz files"):
        load_samples(tmp_path / "empty", [IMAGE], None)
    with pytest.raises(InputRejected, match="missing: not found; this recipe reads a folder"):
        load_samples(tmp_path / "missing", [IMAGE], None)
    (tmp_path / "texts.txt").write_text("a text\n")
    with pytest.raises(InputRejected, match="a text file: a recipe with a text stage reads it"):
        load_samples(tmp_path / "texts.txt", [IMAGE], None)


def test_images_need_preprocessing(tmp_path):
    from PIL import Image

    (tmp_path / "d").mkdir()
    Image.new("RGB", (40, 30), "red").save(tmp_path / "d" / "a.png")
    with pytest.raises(InputRejected, match="holds images, and the recipe has no image preprocessing") as info:
        load_samples(tmp_path / "d", [IMAGE], None)
    assert info.value.exit_code == 3


def test_split_is_disjoint_deterministic_and_gives_the_verdict_most_samples():
    from accel_opt.recipe.gate import SplitConfig

    keys = [sample_key({"x": np.full((1,), i, np.float32)}) for i in range(300)]
    split = split_roles(keys, SplitConfig(), calibrates=True, calibration_max=64, verdict_max=1000, seed=0)
    roles = [set(split.calibration), set(split.steering), set(split.verdict)]
    assert all(a.isdisjoint(b) for i, a in enumerate(roles) for b in roles[i + 1:])
    assert split.counts() == {"calibration": 64, "steering": 32, "verdict": 204} and not split.unused
    assert split == split_roles(keys, SplitConfig(), True, 64, 1000, seed=0)  # deterministic
    fp32 = split_roles(keys, SplitConfig(), calibrates=False, calibration_max=64, verdict_max=1000, seed=0)
    assert fp32.steering == split.steering and set(fp32.verdict) == set(split.verdict) | set(split.calibration)
    capped = split_roles(keys, SplitConfig(), True, 64, verdict_max=100, seed=0)
    assert len(capped.verdict) == 100 and len(capped.unused) == 104


def test_identical_inputs_count_once_and_never_in_two_roles():
    from accel_opt.recipe.gate import SplitConfig

    keys = [f"k{i % 10}" for i in range(40)]  # every input four times
    split = split_roles(keys, SplitConfig(), calibrates=True, calibration_max=64, verdict_max=1000, seed=0)
    used = split.calibration + split.steering + split.verdict
    assert sorted({keys[i] for i in used}) == sorted(set(keys)) and len(used) == 10
    held = split_roles(keys[:20], SplitConfig(), True, 64, 1000, seed=0, held_out=["k1", "new", "new"])
    assert [i - 20 for i in held.verdict] == [1] and 20 in held.unused  # a copy of --data, and a repeat, left out


def test_too_few_samples_to_calibrate_and_judge_is_rejected():
    from accel_opt.recipe.gate import SplitConfig

    with pytest.raises(InputRejected, match="at least 2 samples"):
        split_roles(["a"], SplitConfig(), calibrates=True, calibration_max=64, verdict_max=10, seed=0)
    assert split_roles(["a"], SplitConfig(), calibrates=False, calibration_max=64, verdict_max=10,
                       seed=0).verdict == [0]


def test_synthetic_samples_are_seeded_and_typed():
    spec = [TensorSpec(name="input_ids", dtype="int64", shape=["b", 4]),
            TensorSpec(name="attention_mask", dtype="int64", shape=["b", 4])]
    a, summary = synthetic_samples(spec, {"input_ids": [2, 4], "attention_mask": [2, 4]}, 3, seed=1)
    b, _ = synthetic_samples(spec, {"input_ids": [2, 4], "attention_mask": [2, 4]}, 3, seed=1)
    assert summary.source == "synthetic" and summary.sha256 is None
    assert np.array_equal(a[2]["input_ids"], b[2]["input_ids"])
    assert (a[0]["attention_mask"] == 1).all() and a[0]["input_ids"].dtype == np.int64


def test_batch_of_cycles_samples():
    samples = [{"x": np.full((1, 2), i, np.float32)} for i in range(3)]
    batch = batch_of(samples, 5)["x"]
    assert batch.shape == (5, 2) and batch[:, 0].tolist() == [0, 1, 2, 0, 1]


@pytest.mark.parametrize("layout,dtype", [("NCHW", "float32"), ("NHWC", "float32"), ("NCHW", "float16"),
                                          ("NHWC", "uint8")])
def test_model_input_matches_the_textbook_normalization(layout, dtype):
    """The fast in-place normalization computes (x / 255 - mean) / std, laid out and typed as asked."""
    from accel_opt.preprocess.images import to_model_input
    from accel_opt.recipe.deployed import Preprocessing

    pre = Preprocessing(layout=layout, dtype=dtype)
    crops = np.random.default_rng(0).integers(0, 256, (2, 6, 5, 3), dtype=np.uint8)
    expected = crops.astype(np.float64)
    if dtype != "uint8":
        expected = (expected / 255.0 - np.asarray(pre.mean)) / np.asarray(pre.std)
    if layout == "NCHW":
        expected = expected.transpose(0, 3, 1, 2)
    got = to_model_input(crops, pre)
    assert got.dtype == np.dtype(dtype) and got.shape == expected.shape and got.flags.c_contiguous
    np.testing.assert_allclose(got.astype(np.float64), expected, atol=2e-3 if dtype == "float16" else 1e-5)


def test_crop_region_resize_matches_resizing_the_whole_image():
    """Resampling only the crop's box gives the pixels of resize-then-crop (within rounding)."""
    from PIL import Image

    from accel_opt.preprocess.images import preprocess_image
    from accel_opt.recipe.deployed import Preprocessing

    pre = Preprocessing(resize=64, crop=56, dtype="uint8", layout="NHWC")
    rng = np.random.default_rng(1)
    for size in [(173, 97), (97, 173), (64, 64), (301, 220)]:
        smooth = Image.fromarray(rng.integers(0, 256, (size[1] // 8 + 1, size[0] // 8 + 1, 3), dtype=np.uint8))
        img = smooth.resize(size, Image.BICUBIC)
        scale = pre.resize / min(size)
        whole = img.resize((max(pre.crop, round(size[0] * scale)), max(pre.crop, round(size[1] * scale))),
                           Image.BILINEAR)
        left, top = (whole.width - pre.crop) // 2, (whole.height - pre.crop) // 2
        expected = np.asarray(whole.crop((left, top, left + pre.crop, top + pre.crop)), dtype=int)
        got = preprocess_image(img, pre)[0].astype(int)
        assert np.abs(got - expected).max() <= 1, size
