"""Hostile inputs end in one line, bounded memory and nothing written outside --out: .npz files that declare more
than they hold or decompress to more than the limit, symlinks planted where `run` writes."""

from __future__ import annotations

import io
import json
import os
import resource
import zipfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from accel_opt.cli import main
from accel_opt.data import read_npz
from accel_opt.errors import InputRejected, UsageError
from accel_opt.graph.inspect import TensorSpec

IMAGE = [TensorSpec(name="image", dtype="float32", shape=["batch", 3, 32, 32])]


def _header_only_npz(path: Path, name: str, shape: tuple[int, ...], dtype=np.float32) -> Path:
    """A .npz whose member's .npy header declares `shape` and holds no data: a few hundred bytes that a naive reader
    answers by allocating the whole declared array."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                  "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}.npy", header.getvalue())
    return path


def _zero_bomb(path: Path, name: str, mib: int) -> Path:
    """A .npz of `mib` MiB of zeros, deflated to a few KiB per MiB (written in chunks: never held whole)."""
    rows = mib * (1 << 20) // (4 * 3 * 32 * 32)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive, \
            archive.open(f"{name}.npy", "w", force_zip64=True) as member:
        np.lib.format.write_array_header_1_0(member, {"descr": "<f4", "fortran_order": False,
                                                      "shape": (rows, 3, 32, 32)})
        chunk = bytes(1 << 20)
        for _ in range(mib):
            member.write(chunk)
    return path


def test_an_npz_declaring_a_gibibyte_is_refused_from_its_header(tmp_path):
    path = _header_only_npz(tmp_path / "liar.npz", "image", (16384, 16384))
    assert path.stat().st_size < 1000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(InputRejected,
                       match=r"image declares \[16384, 16384\] float32 \(1,024.0 MiB\), over the 256.0 MiB "
                                            r"limit per input \(ACCEL_OPT_MAX_INPUT_MIB\)"):
        read_npz(path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: nothing like 1 GiB was held


def test_an_npz_that_decompresses_past_the_limit_is_refused_before_reading(tmp_path, monkeypatch):
    path = _zero_bomb(tmp_path / "bomb.npz", "image", 8)
    assert path.stat().st_size < 100_000
    monkeypatch.setenv("ACCEL_OPT_MAX_INPUT_MIB", "4")
    with pytest.raises(InputRejected, match=r"image is 8.0 MiB uncompressed, over the 4.0 MiB limit per input"):
        read_npz(path)
    monkeypatch.setenv("ACCEL_OPT_MAX_INPUT_MIB", "16")
    assert read_npz(path)["image"].shape == (682, 3, 32, 32)  # within the limit it reads
    monkeypatch.setenv("ACCEL_OPT_MAX_INPUT_MIB", "lots")
    with pytest.raises(UsageError, match="ACCEL_OPT_MAX_INPUT_MIB='lots'"):
        read_npz(path)


def test_the_model_inputs_are_checked_from_the_headers_before_reading(tmp_path):
    # Declared within the limit, but not what the model takes: refused without reading its 64 MiB.
    path = _header_only_npz(tmp_path / "wrong.npz", "image", (4096, 4096))
    with pytest.raises(InputRejected, match="image has rank 2, the model expects 4"):
        read_npz(path, IMAGE)
    with pytest.raises(InputRejected, match=r"do not match model inputs \['image'\]"):
        read_npz(_header_only_npz(tmp_path / "other.npz", "pixels", (1, 3, 32, 32)), IMAGE)


def test_run_and_build_refuse_an_npz_bomb_in_one_line(classifier, tiny_cnn_path, tmp_path):
    (tmp_path / "inputs").mkdir()
    bomb = _header_only_npz(tmp_path / "inputs" / "bomb.npz", "image", (1 << 16, 3, 32, 32))
    out = tmp_path / "p.jsonl"
    done = CliRunner().invoke(main, ["run", str(classifier), str(bomb), "--out", str(out)])
    assert done.exit_code == 3, done.output
    rejected = [json.loads(line) for line in out.with_suffix(".errors.jsonl").read_text().splitlines()]
    assert "image declares [65536, 3, 32, 32] float32 (768.0 MiB)" in json.dumps(rejected)
    built = CliRunner().invoke(main, ["build", str(tiny_cnn_path), "--data", str(tmp_path / "inputs"),
                                      "--out", str(tmp_path / "out")])
    assert built.exit_code == 3 and "bomb.npz: image declares" in built.stderr and built.stderr.count("\n") == 1


@pytest.fixture(scope="module")
def raw_outputs(tiny_cnn_path, tmp_path_factory) -> Path:
    """The tiny CNN built without a postprocess: `run` writes each input's outputs into PREDICTIONS.outputs/."""
    from accel_opt.builder.pipeline import build
    from accel_opt.recipe.load import load_recipe

    from ..conftest import FAST_BENCH

    recipe = load_recipe().with_overrides(benchmark=FAST_BENCH, **{"accuracy.synthetic_samples": 4})
    return Path(build(tiny_cnn_path, recipe, out_dir=tmp_path_factory.mktemp("raw")).artifact_dir)


@pytest.mark.parametrize("planted", [".p.run.lock", "p.errors.jsonl", "p.jsonl", "p.outputs"])
def test_a_link_planted_where_run_writes_is_refused_and_its_target_untouched(planted, raw_outputs, tmp_path):
    shared, victim = tmp_path / "shared", tmp_path / "victim"
    shared.mkdir()
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me\n")
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    np.savez(inputs / "a.npz", image=np.zeros((1, 3, 32, 32), np.float32))
    target = victim if planted == "p.outputs" else victim / "precious.txt"
    (shared / planted).symlink_to(target)
    flags = ["--overwrite"] if planted == "p.jsonl" else []
    done = CliRunner().invoke(main, ["run", str(raw_outputs), str(inputs), "--out", str(shared / "p.jsonl"), *flags])
    assert done.exit_code == 2, done.output
    assert f"{shared / planted} is a symbolic link" in done.stderr and done.stderr.count("\n") == 1
    assert (victim / "precious.txt").read_text() == "keep me\n" and sorted(os.listdir(victim)) == ["precious.txt"]
    (shared / planted).unlink()  # without the link, the same job runs and writes its outputs
    ran = CliRunner().invoke(main, ["run", str(raw_outputs), str(inputs), "--out", str(shared / "p.jsonl"), *flags])
    assert ran.exit_code == 0, ran.output
    assert len(list((shared / "p.outputs").iterdir())) == 1


def _constant_of_shape(shape: list[int]):
    """A model of a few hundred bytes whose one node asks for a float32 tensor of `shape`, added to its input."""
    from onnx import TensorProto, helper, numpy_helper

    from ..conftest import make_model

    return make_model(
        [helper.make_node("ConstantOfShape", ["shape"], ["big"], name="big",
                          value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0])),
         helper.make_node("Add", ["x", "big"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])],
        [numpy_helper.from_array(np.array(shape, np.int64), "shape")],
    )


def test_the_largest_declared_tensor_is_estimated_before_anything_runs():
    from accel_opt.graph.sizes import largest_tensor

    declared = largest_tensor(_constant_of_shape([80000, 80000]), {"x": [1, 1]})
    assert declared.bytes == 80000 * 80000 * 4
    assert "ConstantOfShape" in declared.what and "[80000, 80000] float32" in declared.what


def test_a_model_declaring_more_than_the_machine_has_is_exit_5_before_the_reference_runs(tmp_path):
    from ..conftest import save

    # 4e6 x 1e6 float32: 14.6 TiB, beyond any machine this runs on.
    model = save(_constant_of_shape([4_000_000, 1_000_000]), tmp_path / "greedy.onnx")
    assert model.stat().st_size < 400
    done = CliRunner().invoke(main, ["build", str(model), "--out", str(tmp_path / "out")])
    assert done.exit_code == 5, done.output
    assert "'big' of node 'big' (ConstantOfShape): [4000000, 1000000] float32 takes 14,901.2 GiB, more than the" \
        in done.stderr and "refused before anything runs it" in done.stderr and done.stderr.count("\n") == 1
    assert not any((tmp_path / "out").glob("greedy*"))


def test_a_shape_cast_from_float_before_constant_of_shape_is_estimated_too(tmp_path):
    """Issue 74: one Cast(float -> int64) in front of ConstantOfShape hid a 25.6 GB allocation from the estimate (it
    read int64 constants only), and the build ended in five lines of a failed reference instead of exit 5."""
    from onnx import TensorProto, helper, numpy_helper

    from ..conftest import make_model, save

    model = save(make_model(
        [helper.make_node("Cast", ["shape_f"], ["shape"], to=TensorProto.INT64),
         helper.make_node("ConstantOfShape", ["shape"], ["big"], name="big"),
         helper.make_node("Add", ["x", "big"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])],
        [numpy_helper.from_array(np.array([4_000_000, 1_000_000], np.float32), "shape_f")]), tmp_path / "cast.onnx")
    done = CliRunner().invoke(main, ["build", str(model), "--out", str(tmp_path / "out")])
    assert done.exit_code == 5 and "[4000000, 1000000] float32 takes 14,901.2 GiB" in done.stderr, done.output
    assert done.stderr.count("\n") == 1 and not any((tmp_path / "out").glob("cast*"))


def test_a_npy_with_a_zip_appended_is_not_read_past_the_limit(tmp_path, monkeypatch):
    """Issue 74: a file that starts as a .npy and ends as a zip passed the header check (a zip is found by its end)
    and numpy, reading by its start, loaded the .npy past the limit. Refused as not a .npz; its zip's members alone
    would be what is read."""
    import io
    import zipfile

    monkeypatch.setenv("ACCEL_OPT_MAX_INPUT_MIB", "1")
    big = io.BytesIO()
    np.save(big, np.zeros((4, 1 << 20), np.float32))  # 16 MiB, over the 1 MiB limit
    small = io.BytesIO()
    np.savez(small, image=np.zeros((1, 3, 32, 32), np.float32))
    path = tmp_path / "glued.npz"
    path.write_bytes(big.getvalue() + small.getvalue())
    assert zipfile.is_zipfile(path)  # what the old check asked
    with pytest.raises(InputRejected, match="not a .npz"):
        read_npz(path)


@pytest.mark.skipif(os.getuid() != 0, reason="planting a link owned by another user needs root (lchown)")
def test_run_never_writes_through_a_folder_link_another_user_planted(classifier, photos, tmp_path):
    """Issue 74: with `shared/sub -> victim/`, `run --out shared/sub/p.jsonl` wrote its lock, predictions and outputs
    into victim/. A link on the way owned by another user is refused (exit 2); this user's own links are followed."""
    shared, victim = tmp_path / "shared", tmp_path / "victim"
    shared.mkdir()
    victim.mkdir()
    (shared / "sub").symlink_to(victim)
    os.lchown(shared / "sub", 12345, 12345)
    done = CliRunner().invoke(main, ["run", str(classifier), str(photos), "--out", str(shared / "sub" / "p.jsonl")])
    assert done.exit_code == 2 and "owned by another user (uid 12345)" in done.stderr, done.output
    assert list(victim.iterdir()) == []
    os.lchown(shared / "sub", os.getuid(), os.getgid())  # the user's own link: followed
    done = CliRunner().invoke(main, ["run", str(classifier), str(photos), "--out", str(shared / "sub" / "p.jsonl")])
    assert done.exit_code == 0 and (victim / "p.jsonl").is_file(), done.output


def test_a_folder_swapped_for_a_link_mid_job_is_not_followed(tiny_cnn_path, tmp_path):
    """The check and the writes have no window between them: the job's folder is held open from the start, so a
    folder on the way renamed and replaced by a link to victim/ after the first batch (the race the checks alone
    would lose) takes nothing into victim/: every line, and every answer's .npz written after the swap, lands in
    the folder the job opened."""
    from accel_opt import runtime
    from accel_opt.builder.pipeline import build
    from accel_opt.recipe.load import load_recipe
    from accel_opt.runtime.local.job import run_job

    from ..conftest import FAST_BENCH, image_npz_folder

    feeds = image_npz_folder(tmp_path / "data", 24)
    result = build(tiny_cnn_path, load_recipe().with_overrides(benchmark=FAST_BENCH), out_dir=tmp_path / "out",
                   data_dir=feeds)
    shared, victim = tmp_path / "shared", tmp_path / "victim"
    (shared / "sub").mkdir(parents=True)
    victim.mkdir()
    swapped = []

    def swap(done: int, total: int) -> None:
        if not swapped:
            (shared / "sub").rename(shared / "moved")
            (shared / "sub").symlink_to(victim)
            swapped.append(done)

    summary = run_job(runtime.load(result.artifact_dir), [feeds], shared / "sub" / "p.jsonl", on_progress=swap)
    assert swapped and swapped[0] < 24 and summary.predicted == 24
    assert list(victim.iterdir()) == []
    assert len((shared / "moved" / "p.jsonl").read_text().splitlines()) == 24
    assert len(list((shared / "moved" / "p.outputs").iterdir())) == 24


def test_a_pinned_folder_refuses_a_link_where_a_folder_was_resolved(tmp_path, monkeypatch):
    from accel_opt.runtime.pinned import PinnedFolder

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setattr(os.path, "realpath", lambda path: str(path))  # the link appeared after it was resolved
    with pytest.raises(UsageError, match="'link' on the way changed into a symbolic link"):
        PinnedFolder.of(tmp_path / "link")
    pinned = PinnedFolder.of(tmp_path / "real")
    try:
        os.symlink(tmp_path / "victim", tmp_path / "real" / "p.jsonl")
        with pytest.raises(UsageError, match="is a symbolic link"):
            pinned.open("p.jsonl", os.O_WRONLY | os.O_CREAT)
        pinned.write_whole("p.jsonl", lambda f: f.write(b"whole\n"))  # the link replaced, never written through
        assert not (tmp_path / "victim").exists() and (tmp_path / "real" / "p.jsonl").read_bytes() == b"whole\n"
    finally:
        pinned.close()
