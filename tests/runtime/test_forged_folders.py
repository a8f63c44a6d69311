"""`verify` refuses every folder `run` refuses, with the same reason and exit code: one check serves both."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

from accel_opt.artifact.folder import MANIFEST, file_hashes
from accel_opt.cli import main


def _rehash(folder: Path) -> None:
    """What a forger does: rewrite manifest.json's hashes to the changed files (no signature to stop it)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["artifacts"] = file_hashes(folder)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def _external_data(folder: Path, location: str) -> None:
    """model.onnx's first initializer moved to external data at `location` (relative to the folder)."""
    model = onnx.load(str(folder / "model.onnx"))
    tensor = model.graph.initializer[0]
    raw = numpy_helper.to_array(tensor).tobytes()
    target = folder / location
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(raw)
    tensor.ClearField("raw_data")
    del tensor.float_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=location)
    tensor.external_data.add(key="length", value=str(len(raw)))
    onnx.save(model, str(folder / "model.onnx"))


FORGERIES = {
    "external data outside the folder": lambda f: _external_data(f, "../stolen.bin"),
    "external data by absolute path": lambda f: (_external_data(f, "inside.bin"),
                                                 _relocate(f, str(f.parent / "abs.bin"))),
    "external data through a symlink": lambda f: (_external_data(f, "../outside.bin"), _relocate(f, "link.bin"),
                                                  os.symlink(f.parent / "outside.bin", f / "link.bin")),
    "model.onnx is text": lambda f: (f / "model.onnx").write_text("version https://git-lfs.github.com/spec/v1\n"),
    "model.onnx is not a protobuf": lambda f: (f / "model.onnx").write_bytes(b"\x08\x07" + bytes(range(256)) * 4),
    "an engine node inside the model": lambda f: _engine_node(f),
    # ONNX Runtime parses whatever the folder names: the check goes by the backend, not by the ".onnx" suffix.
    "an engine node inside model.ONNX": lambda f: (_engine_node(f), (f / "model.onnx").rename(f / "model.ONNX"),
                                                   _config(f, model_file="model.ONNX")),
    "resource_config.json unreadable": lambda f: (f / "resource_config.json").write_text("{"),
    # Every number a folder supplies is bounded before anything loads (issue 74: 20,000 threads started 14,000).
    "20000 threads": lambda f: _config(f, threads=20000),
    "a batch of a billion rows": lambda f: _config(f, batch_size=10**9),
    # The TensorRT EP (read against ORT's option names; no GPU needed: refused before any session): an engine listed as
    # a timing file is still native code, and a cache prefix is a name, never a path.
    "a TensorRT EP engine listed as a timing file": lambda f: _trt_ep(f, {"trt_engine_cache_prefix": "ort-trt"},
                                                                     timing_files=["ort-trt_0.engine"]),
    "a TensorRT EP cache prefix that climbs out": lambda f: _trt_ep(f,
                                                                    {"trt_engine_cache_prefix": "../timing/ort-trt"}),
    "a TensorRT EP cache switched on without its files": lambda f: _trt_ep(f, {"trt_engine_cache_enable": "True"}),
}


def _trt_ep(folder: Path, options: dict, timing_files: tuple = ()) -> None:
    config = json.loads((folder / "resource_config.json").read_text())
    for name in timing_files:
        (folder / name).write_bytes(b"engine bytes")
    settings = {**config["settings"], "execution_provider": "TensorrtExecutionProvider",
                "provider_options": {"TensorrtExecutionProvider": options},
                "trt_engine_cache": {"engine_files": [], "timing_files": list(timing_files)}}
    _config(folder, settings=settings, extra_files=[*config["extra_files"], *timing_files])


def _config(folder: Path, **fields) -> None:
    path = folder / "resource_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _relocate(folder: Path, location: str) -> None:
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = location
    onnx.save(model, str(folder / "model.onnx"))
    Path(location if os.path.isabs(location) else folder / location).parent.mkdir(parents=True, exist_ok=True)
    if os.path.isabs(location):
        shutil.copy(folder / "inside.bin", location)


def _engine_node(folder: Path) -> None:
    model = onnx.load(str(folder / "model.onnx"))
    node = onnx.helper.make_node("EPContext", [model.graph.input[0].name], ["ctx_out"], domain="com.microsoft",
                                 name="embedded_engine")
    model.graph.node.append(node)
    model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, str(folder / "model.onnx"))


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_verify_refuses_what_run_refuses_with_the_same_reason(classifier, photos, tmp_path, forgery):
    folder = Path(shutil.copytree(classifier, tmp_path / "forged" / classifier.name))
    FORGERIES[forgery](folder)
    _rehash(folder)
    cli = CliRunner()
    verified = cli.invoke(main, ["verify", str(folder)])
    ran = cli.invoke(main, ["run", str(folder), str(photos), "--out", str(tmp_path / "preds.jsonl")])
    assert verified.exit_code == ran.exit_code and ran.exit_code in (3, 4), (verified.output, ran.output)
    reason = ran.output.strip().splitlines()[-1].removeprefix("accel-opt: error: ")
    assert reason in verified.output.replace("accel-opt: ", "", 1), (reason, verified.output)
    assert not (tmp_path / "preds.jsonl").exists()  # nothing was run


def test_an_untouched_copy_verifies_and_runs(classifier, photos, tmp_path):
    folder = Path(shutil.copytree(classifier, tmp_path / classifier.name))
    cli = CliRunner()
    assert cli.invoke(main, ["verify", str(folder)]).exit_code == 0
    done = cli.invoke(main, ["run", str(folder), str(photos), "--out", str(tmp_path / "preds.jsonl")])
    assert done.exit_code == 0, done.output
    assert len((tmp_path / "preds.jsonl").read_text().splitlines()) == len(list(photos.iterdir()))
    assert np.isfinite([json.loads(line)["topk"][0][1] for line in (tmp_path
                                                                    / "preds.jsonl").read_text().splitlines()]).all()


def _forged_fields():
    """(file, field, how) for every field of manifest.json and resource_config.json, and the settings each backend's
    loader reads: removed, null, or another type."""
    from accel_opt.artifact.config import SETTINGS_OF, ResourceConfig
    from accel_opt.artifact.folder import Manifest

    cases = []
    for file, model in (("manifest.json", Manifest), ("resource_config.json", ResourceConfig)):
        for name, field in model.model_fields.items():
            hows = ["removed", "null", "another type"] if field.is_required() else ["null", "another type"]
            cases += [(file, name, how) for how in hows]
    for backend, model in SETTINGS_OF.items():
        cases += [("resource_config.json", f"{backend}:settings.{name}", how) for name,
                  field in model.model_fields.items()
                  for how in (["removed", "another type"] if field.is_required() else ["another type"])]
    return cases


def _forge_field(folder: Path, file: str, field: str, how: str) -> None:
    data = json.loads((folder / file).read_text())
    target = data
    if ":" in field:  # backend:settings.key: the folder says it is that backend, and its key is forged
        backend, _, field = field.partition(":")
        data["backend"] = backend
        target, field = data["settings"], field.removeprefix("settings.")
    if how == "removed":
        target.pop(field, None)
    elif how == "null":
        target[field] = None
    else:  # a value of another type than any field holds
        target[field] = [{"forged": True}] if not isinstance(target.get(field), list) else {"forged": True}
    (folder / file).write_text(json.dumps(data))


@pytest.mark.parametrize("file,field,how", _forged_fields(), ids=lambda v: str(v))
def test_every_forged_field_is_an_input_error_never_a_crash(classifier, photos, tmp_path, file, field, how):
    folder = Path(shutil.copytree(classifier, tmp_path / "forged" / classifier.name))
    _forge_field(folder, file, field, how)
    if file != MANIFEST:
        _rehash(folder)
    cli = CliRunner()
    if how == "removed" or ":" in field:  # a required field gone, or a loader's setting forged: refused where read
        assert cli.invoke(main, ["verify", str(folder)]).exit_code == 3
    for args in (["verify", folder], ["run", folder, photos, "--out", tmp_path / "p.jsonl", "--trust-unsigned"],
                 ["bench", folder, "--trust-unsigned", "--batch-sizes", "1"]):
        done = cli.invoke(main, [*map(str, args)])
        # 0: a field only people read; 2: the forged config asks for other inputs (no preprocessing: .npz only).
        assert done.exit_code in (0, 2, 3), (args[0], done.output)
        assert done.exit_code == 0 or done.stderr.count("\n") == 1, done.output


def test_a_plausible_thread_count_above_this_machines_cpus_is_capped_to_them(classifier, tmp_path):
    from accel_opt import runtime
    from accel_opt.machine.cpu import available_cpus

    folder = Path(shutil.copytree(classifier, tmp_path / classifier.name))
    _config(folder, threads=64)  # a folder built on a 64-core machine
    _rehash(folder)
    assert runtime.load(folder).compiled.threads == min(64, available_cpus())


def test_openvino_compile_options_are_what_a_build_writes_and_nothing_else():
    """CACHE_DIR in an unsigned folder made `run` write a compiled blob outside the folder and read it back unhashed:
    a folder's OpenVINO options are an allowlist, checked before anything loads (runtime.check, exit 3)."""
    from pydantic import ValidationError

    from accel_opt.artifact.config import SETTINGS_OF

    built = {"shape_mode": "static", "static_shapes": {"x": [1, 3]}, "input_names": ["x"], "output_names": ["y"],
             "compile_config": {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1",
                                "INFERENCE_NUM_THREADS": "2"}}
    SETTINGS_OF["openvino"].model_validate(built)
    for forged in ({"CACHE_DIR": "/tmp/elsewhere"}, {"NUM_STREAMS": "100000"}, {"INFERENCE_NUM_THREADS": "-1"},
                   {"PERFORMANCE_HINT": "../x"}):
        with pytest.raises(ValidationError):
            SETTINGS_OF["openvino"].model_validate({**built, "compile_config": {**built["compile_config"], **forged}})


def test_an_unlisted_file_is_refused_before_anything_is_copied(classifier, photos, tmp_path, monkeypatch):
    """A sparse 3 GB file the manifest does not list (a few KB on disk) made `run` write 3 GB into the temporary
    folder before refusing it: the listing is now checked against the manifest first."""
    import tempfile

    folder = Path(shutil.copytree(classifier, tmp_path / classifier.name))
    with open(folder / "padding.bin", "wb") as f:
        f.truncate(3 << 30)
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    ran = CliRunner().invoke(main, ["run", str(folder), str(photos), "--out", str(tmp_path / "p.jsonl")])
    assert ran.exit_code == 3, ran.output
    assert "padding.bin: not part of the artifact (not in the manifest)" in ran.stderr, ran.output
    written = sum(p.stat().st_size for p in temp.rglob("*") if p.is_file())
    assert written == 0, written  # nothing was copied


def test_check_without_a_policy_is_as_strict_as_load(classifier, tmp_path):
    """Issue 74: `runtime.check(folder)` with no trust argument passed a forged torch folder that `load` refuses. No
    policy now means the strict one; trusting unsigned native code is said explicitly."""
    from accel_opt import runtime
    from accel_opt.artifact.signing import TrustPolicy

    folder = Path(shutil.copytree(classifier, tmp_path / classifier.name))
    config = json.loads((folder / "resource_config.json").read_text())
    _config(folder, backend="torch", settings={"torch_version": "2.13.0", "device": "cpu", "inputs": [],
                                               "output_names": [o["name"] for o in config["outputs"]]})
    _rehash(folder)
    (refused,) = runtime.check(folder)
    assert refused.exit_code == 3 and "AOTInductor package" in refused.line and "not signed" in refused.line
    assert all("not signed" not in p.line for p in runtime.check(folder, trust=TrustPolicy(trust_unsigned=True)))


@pytest.mark.parametrize("forgery", [name for name in FORGERIES if "TensorRT EP" in name])
def test_a_tensorrt_ep_cache_in_an_unsigned_folder_is_refused_as_native_code_not_as_a_missing_gpu(classifier, tmp_path,
                                                                                                   forgery):
    """Issue 74: these ended exit 4 ("needs a GPU") where a GPU is missing, and would have loaded the engine where one
    is present. Refused before anything loads, exit 3, on any machine."""
    from accel_opt import runtime

    folder = Path(shutil.copytree(classifier, tmp_path / classifier.name))
    FORGERIES[forgery](folder)
    _rehash(folder)
    (problem,) = runtime.check(folder)
    assert problem.exit_code == 3 and ("TensorRT EP engines" in problem.line
                                       or "trt_engine_cache_prefix" in problem.line)
