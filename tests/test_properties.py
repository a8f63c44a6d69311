"""Property-based tests (hypothesis) of the three surfaces a user feeds `accel-opt build`: recipe documents, data
folders and their samples, and command-line flag combinations. The property is the contract of every refusal: an exit
code in the documented set, one line on stderr, no traceback, and no artifact published after a refusal.

Seeded (derandomize) and small in the fast tier; `make test-all` runs more examples of each (the slow variants)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accel_opt.cli import main
from accel_opt.errors import AccelOptError
from accel_opt.graph.inspect import TensorSpec

from .conftest import FAST_BENCH, matmul_model, save

DOCUMENTED_EXIT_CODES = {0, 1, 2, 3, 4, 5, 6, 7}
# Per property, whether each example passed the first refusal (a recipe that loads, a folder that reads, a build that
# reached its verdict): the last test of the module says how many did, and that it was at least half.
REACHED: dict[str, list[bool]] = {}
BUILT = (0, 1, 6, 7)  # the build reached its verdict (signed off, gate failed, too few samples, no measured benefit)
# A fixed seed (derandomize) and no example database: the same examples on every machine, nothing written beside.
FAST = settings(max_examples=12, derandomize=True, database=None, deadline=None,
                suppress_health_check=list(HealthCheck))
MORE = settings(max_examples=60, derandomize=True, database=None, deadline=None,
                suppress_health_check=list(HealthCheck))


def _refusal_contract(done, out: Path) -> None:
    assert done.exit_code in DOCUMENTED_EXIT_CODES, done.output
    assert "Traceback" not in done.output and "internal error" not in done.output, done.output
    if done.exit_code not in BUILT:  # refused: one error line (click's own usage errors add their usage lines)
        errors = [line for line in done.stderr.splitlines() if line.startswith(("accel-opt: error:", "Error:"))]
        assert len(errors) == 1 and (done.stderr.count("\n") == 1 or done.stderr.startswith("Usage:")), done.stderr
        assert not [p for p in out.glob("*") if (p / "manifest.json").exists()], sorted(out.iterdir())


# ---- recipe documents -------------------------------------------------------------------------------------------

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=8)


def _paths(document, prefix=()):
    """Every key path of a nested recipe document."""
    if isinstance(document, dict):
        for key, value in document.items():
            yield (*prefix, key)
            yield from _paths(value, (*prefix, key))


def _share(share: float):
    """True in about `share` of the draws (shrinking to False: the plausible side)."""
    tenths = round(share * 10)
    return st.sampled_from([False] * (10 - tenths) + [True] * tenths)


def _enum_values() -> list[str]:
    from accel_opt.recipe.types import BackendName, CalibrationMethod, Precision, QuantTarget

    return [m.value for enum in (Precision, BackendName, CalibrationMethod, QuantTarget) for m in enum]


def _plausible(draw, value):
    """A value of the same kind as the recipe's `value`, mostly one a recipe takes: what a user edits a recipe to."""
    if isinstance(value, bool):
        return draw(st.booleans())
    if isinstance(value, int):
        return draw(st.integers(1, max(2 * value, 8)))
    if isinstance(value, float):  # a share stays a share; other numbers halve or double
        high = value if 0 < value <= 1 else max(2 * value, 1.0)
        return draw(st.floats(value / 2, high).map(lambda v: round(v, 4)))
    if isinstance(value, str):
        return draw(st.sampled_from([value, *_enum_values()]))
    if isinstance(value, list) and value:
        return draw(st.lists(st.sampled_from(value), min_size=1, max_size=len(value), unique=True))
    return value


@st.composite
def recipe_documents(draw, hostile_share: float = 0.3):
    """The default recipe (with the suite's short benchmark) and 1-3 of its keys edited: mostly to plausible values of
    their own kind (what a user does), and with `hostile_share` of the edits a value of any type or a new key."""
    from accel_opt.recipe.load import load_recipe

    document = json.loads(load_recipe().with_overrides(benchmark=FAST_BENCH).model_dump_json(exclude={"name"}))
    document["name"] = "fuzzed"
    paths = [path for path in _paths(document) if not isinstance(_at(document, path), dict)]
    edits = draw(st.integers(1, 3))
    hostile_edit = edits - 1 if draw(_share(hostile_share)) else None  # at most one hostile edit per document
    for edit in range(edits):
        hostile = edit == hostile_edit
        path = (draw(st.sampled_from(paths)) if not hostile or draw(st.booleans())
                else (draw(st.text(min_size=1, max_size=8)),))
        node = document
        for key in path[:-1]:
            node = node.setdefault(key, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node[path[-1]] = draw(VALUES) if hostile else _plausible(draw, node.get(path[-1]))
    return document


def _at(document, path):
    for key in path:
        document = document[key]
    return document


def _write_recipe(folder: Path, document) -> Path:
    path = folder / "fuzzed.yaml"
    path.write_text(yaml.safe_dump(document, allow_unicode=True) if not _has_nonfinite(document) else
                    yaml.dump(document, allow_unicode=True))
    return path


def _has_nonfinite(value) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_nonfinite(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_nonfinite(v) for v in value)
    return False


@FAST
@given(document=recipe_documents())
def test_a_recipe_document_loads_or_is_a_usage_error(document, tmp_path_factory):
    from accel_opt.recipe.load import load_recipe

    path = _write_recipe(tmp_path_factory.mktemp("recipe"), document)
    try:
        load_recipe(str(path))
    except AccelOptError as exc:
        assert exc.exit_code == 2 and "\n" not in str(exc), str(exc)
        REACHED.setdefault("recipe documents", []).append(False)
        return
    REACHED.setdefault("recipe documents", []).append(True)


@pytest.mark.slow
@MORE
@given(document=recipe_documents())
def test_a_build_under_any_recipe_keeps_the_contract(document, tmp_path_factory):
    folder = tmp_path_factory.mktemp("build")
    model = save(matmul_model(), folder / "m.onnx")
    done = CliRunner().invoke(main, ["build", str(model), "--recipe", str(_write_recipe(folder, document)),
                                     "--out", str(folder / "out")])
    _refusal_contract(done, folder / "out")
    REACHED.setdefault("recipes", []).append(done.exit_code in BUILT)


# ---- data folders and samples ----------------------------------------------------------------------------------

INPUTS = [TensorSpec(name="x", dtype="float32", shape=["batch", 4])]
DTYPES = st.sampled_from(["<f4", ">f4", "<f8", "<i8", ">i4", "|b1", "<f2", "<u1"])


@st.composite
def samples(draw, hostile_share: float = 0.3):
    """One .npz file's bytes: mostly a feed the model takes (`x`, float32 [1, 4], in any byte order); with
    `hostile_share`, arrays of any dtype, byte order, rank and size (empty dims too), NaN/Inf, other names, or bytes
    that are not a .npz at all."""
    from io import BytesIO

    if not draw(_share(hostile_share)):
        values = np.random.default_rng(draw(st.integers(0, 2**16))).standard_normal((1, 4)) * 10
        buffer = BytesIO()
        np.savez(buffer, x=values.astype(draw(st.sampled_from(["<f4", ">f4"]))))
        return buffer.getvalue()
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=64))
    arrays = {}
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from(["x", "x", "y", "image"]))
        shape = tuple(draw(st.lists(st.integers(0, 6), max_size=4)))
        dtype = np.dtype(draw(DTYPES))
        values = np.random.default_rng(draw(st.integers(0, 2**16))).standard_normal(shape) * 10
        if dtype.kind == "f" and values.size and draw(st.booleans()):
            values.flat[0] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        with np.errstate(invalid="ignore"):
            arrays[name] = values.astype(dtype)
    buffer = BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


@st.composite
def data_folders(draw):
    """Mostly enough feeds for a verdict on the default gate (an fp32 build judges every held-out sample), a hostile
    file among them now and then."""
    files = draw(st.lists(samples(hostile_share=0.0), min_size=0, max_size=24))
    if files and draw(_share(0.2)):  # one hostile file among the feeds
        files[draw(st.integers(0, len(files) - 1))] = draw(samples(hostile_share=1.0))
    return files


def _write_folder(folder: Path, files: list[bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, content in enumerate(files):
        (folder / f"s{i}.npz").write_bytes(content)
    return folder


@FAST
@given(files=data_folders())
def test_a_data_folder_reads_or_is_refused_in_one_line(files, tmp_path_factory):
    from accel_opt.data import load_samples

    folder = _write_folder(tmp_path_factory.mktemp("data") / "d", files)
    try:
        read, _ = load_samples(folder, INPUTS, None)
    except AccelOptError as exc:
        assert exc.exit_code in (2, 3) and "\n" not in str(exc), str(exc)
        REACHED.setdefault("data folders", []).append(False)
        return
    REACHED.setdefault("data folders", []).append(True)
    for sample in read:  # what is accepted is what the model takes, in this machine's byte order
        assert set(sample) == {"x"} and sample["x"].dtype == np.float32 and sample["x"].dtype.isnative
        assert sample["x"].ndim == 2 and sample["x"].shape[1] == 4 and np.isfinite(sample["x"]).all()


@pytest.mark.slow
@MORE
@given(files=data_folders())
def test_a_build_on_any_data_folder_keeps_the_contract(files, tmp_path_factory):
    folder = tmp_path_factory.mktemp("build")
    model = save(matmul_model(), folder / "m.onnx")
    data = _write_folder(folder / "data", files)
    done = CliRunner().invoke(main, ["build", str(model), "--data", str(data), "--recipe", str(_fast_recipe(folder)),
                                     "--out", str(folder / "out")])
    _refusal_contract(done, folder / "out")
    REACHED.setdefault("data", []).append(done.exit_code in BUILT)


# ---- command-line flag combinations -----------------------------------------------------------------------------

TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=16)
FLAGS = {
    "--precision": st.sampled_from(["fp32", "fp16", "bf16", "int8", "auto", "fp8"]),
    "--backend": st.sampled_from(["onnxruntime", "openvino", "torch", "auto", "tvm"]),
    "--shapes": st.one_of(st.sampled_from(["x:1x4", "x:0x4", "x:2x5", "y:1x4", "x:-1x4", "x:1x4,x:2x4",
                                           "x:99999999999x4"]),
                          TEXT),
    "--batch-axes": st.one_of(st.sampled_from(["x:0", "x:none", "x:7", "q:0"]), TEXT),
    "--max-shapes": st.one_of(st.sampled_from(["x:4x4", "x:1x3", "x:100000000x4"]), TEXT),
    "--threads": st.integers(-3, 4).map(str),
    "--time-budget": st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(str), st.sampled_from(["30", "0"])),
    "--calibration": st.sampled_from(["minmax", "entropy", "percentile", "mse"]),
    "--target-cpu": st.sampled_from(["host", "avx2", "amx", "arm64", "sse"]),
    "--providers": st.one_of(st.sampled_from(["CPUExecutionProvider", "CUDAExecutionProvider"]), TEXT),
    "--group-pattern": st.one_of(st.sampled_from([r"^(s\d)", "(", r"(?P<x>"]), TEXT),
    "--device": st.sampled_from(["cpu", "cuda", "tpu"]),
}
SWITCHES = ["--require-data", "--no-fallback", "--keep-io-types", "--no-keep-io-types", "--force", "--json"]


@st.composite
def flag_sets(draw):
    args = []
    for flag in draw(st.lists(st.sampled_from(sorted(FLAGS)), max_size=4, unique=True)):
        args += [flag, draw(FLAGS[flag])]
    args += draw(st.lists(st.sampled_from(SWITCHES), max_size=2, unique=True))
    return args, draw(st.booleans())  # with --data or without


def _fast_recipe(folder: Path) -> Path:
    path = folder / "fast.yaml"
    path.write_text(json.dumps({"name": "fast", "benchmark": FAST_BENCH, "accuracy": {"synthetic_samples": 4},
                                "selection": {"time_budget_s": 30}}))
    return path


def _flag_build(args: list[str], with_data: bool, folder: Path):
    model = save(matmul_model(), folder / "m.onnx")
    data = []
    if with_data:
        rng = np.random.default_rng(0)
        for i in range(8):
            (folder / "data").mkdir(exist_ok=True)
            np.savez(folder / "data" / f"s{i}.npz", x=rng.standard_normal((1, 4)).astype(np.float32))
        data = ["--data", str(folder / "data")]
    return CliRunner().invoke(main, ["build", str(model), "--recipe", str(_fast_recipe(folder)), *data, *args,
                                     "--out", str(folder / "out")])


@settings(FAST, max_examples=8)
@given(flags=flag_sets())
def test_any_flag_combination_keeps_the_contract(flags, tmp_path_factory):
    args, with_data = flags
    folder = tmp_path_factory.mktemp("flags")
    _refusal_contract(_flag_build(args, with_data, folder), folder / "out")


@pytest.mark.slow
@MORE
@given(flags=flag_sets())
def test_any_flag_combination_keeps_the_contract_more_examples(flags, tmp_path_factory):
    args, with_data = flags
    folder = tmp_path_factory.mktemp("flags")
    _refusal_contract(_flag_build(args, with_data, folder), folder / "out")


@pytest.mark.parametrize("prop", ["recipe documents", "data folders", pytest.param("recipes", marks=pytest.mark.slow),
                                  pytest.param("data", marks=pytest.mark.slow)])
def test_most_examples_pass_the_first_refusal(prop):
    """Last in the module (file order): at least half of each property's examples were recipes that load, folders
    that read, and builds that ran to a verdict (the slow tier's), so the properties cover builds, not only the first
    refusal (it was 0 of 12 and 0 of 60 before the strategies made plausible documents and folders)."""
    reached = REACHED.get(prop)
    if not reached:
        pytest.skip(f"the {prop} property did not run in this session (run the module)")
    said = f"{sum(reached)} of {len(reached)} {prop} examples passed the first refusal"
    print(said)  # shown with -rP
    assert sum(reached) >= len(reached) // 2, said
