"""No native code runs from a folder that is not trusted; what loads is what was verified; a folder holds regular
files only. Folders are forged as an attacker would (a file changed or added, the manifest re-hashed), on the
`classifier` fixture's ONNX folder: its config rewritten to name a torch package, or provider options, is what a
forger writes."""

from __future__ import annotations

import gc
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from accel_opt import runtime
from accel_opt.artifact.folder import MANIFEST, SIGNATURE, file_hashes
from accel_opt.artifact.signing import TrustPolicy
from accel_opt.artifact.verified import COPY_PREFIX
from accel_opt.cli import main
from accel_opt.errors import InputRejected, UsageError

pytest.importorskip("model_signing", reason="the sign extra is not installed (pip install '.[sign]')")

from tests.artifact.test_signing import _write_key_pair  # noqa: E402 - after the skip: it needs cryptography


@pytest.fixture(scope="module")
def key(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("key")
    _write_key_pair(folder, "builder")
    return folder / "builder"  # builder.pem / builder.pub


def _cli(*args, env=None):
    return CliRunner(env=env).invoke(main, [*map(str, args)])


def _rehash(folder: Path) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["artifacts"] = file_hashes(folder)
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))


def _forge_config(folder: Path, **changes) -> None:
    path = folder / "resource_config.json"
    config = json.loads(path.read_text())
    for name, value in changes.items():
        config[name] = value
    path.write_text(json.dumps(config))


@pytest.fixture()
def native(classifier, tmp_path) -> Path:
    """A forged folder that says it is a torch build: model.pt2 (bytes a loader would hand to AOTInductor), listed."""
    folder = Path(shutil.copytree(classifier, tmp_path / "forged"))
    (folder / "model.pt2").write_bytes(b"PK\x03\x04 not a package, but nothing may read it unless trusted")
    import torch

    config = json.loads((folder / "resource_config.json").read_text())
    settings = {"torch_version": torch.__version__, "device": "cpu", "inputs": [{"name": "image", "dtype": "float32",
                "shape": [1, 3, 32, 32]}], "output_names": [o["name"] for o in config["outputs"]]}
    _forge_config(folder, backend="torch", model_file="model.pt2", settings=settings)
    _rehash(folder)
    return folder


def test_a_folder_of_native_code_is_refused_unsigned_by_everything_that_loads_it(native, classifier, photos, tmp_path):
    out = tmp_path / "p.jsonl"
    refusals = {
        "run": _cli("run", native, photos, "--out", out),
        "run --json": _cli("run", native, photos, "--out", out, "--json"),
        "bench": _cli("bench", native),
        "verify": _cli("verify", native),
        "verify --accuracy": _cli("verify", native, "--accuracy"),
        "compare": _cli("compare", classifier, native),
    }
    for what, done in refusals.items():
        assert done.exit_code == 3, (what, done.stderr)
        assert "holds an AOTInductor package" in done.stderr and "not signed by a trusted key" in done.stderr, what
        assert "--trust-unsigned" in done.stderr and done.stderr.count("\n") == 1, what
    assert not out.exists() and not Path(f"{out}.errors.jsonl").exists()
    with pytest.raises(InputRejected, match="not signed by a trusted key"):
        runtime.load(native)
    from accel_opt.runtime.ray.predictor import Predictor

    with pytest.raises(InputRejected, match="not signed by a trusted key"):
        Predictor(native)


def test_trust_unsigned_passes_the_trust_check_and_every_summary_says_so(native, classifier, photos, tmp_path):
    # --trust-unsigned moves past the trust refusal (this forged package then fails torch's own environment check).
    done = _cli("run", native, photos, "--out", tmp_path / "p.jsonl", "--trust-unsigned")
    assert done.exit_code != 3 and "trusted key" not in done.stderr, done.stderr
    # ONNX folders run unsigned and say so; the JSON summary carries it.
    ran = _cli("run", classifier, photos, "--out", tmp_path / "q.jsonl", "--json")
    assert ran.exit_code == 0, ran.stderr
    assert json.loads(ran.stdout)["signature"] == "unsigned"
    assert _cli("verify", classifier).stdout.startswith(f"ok: {classifier}: signature: unsigned; ")
    bench = json.loads(_cli("bench", classifier, "--json", "--batch-sizes", "1").stdout)
    assert bench["signature"] == "unsigned" and bench["checks"][0]["line"].startswith("unsigned; ")
    assert runtime.load(classifier).signature == "unsigned"


def test_a_signed_native_folder_passes_the_trust_check(native, key):
    signed = _cli("sign", native, "--key", f"{key}.pem")
    assert signed.exit_code == 0 and "certified as they are now" in signed.stdout, signed.stderr
    done = _cli("verify", native, "--public-key", f"{key}.pub")
    assert "trusted key" not in done.stderr  # past the trust check: torch's environment check speaks next


def test_the_key_comes_from_one_policy_for_the_cli_and_the_apis(classifier, tmp_path, key, monkeypatch):
    # Set but empty is a usage error everywhere, not "no key".
    empty = {"ACCEL_OPT_PUBLIC_KEY": ""}
    for args in (["verify", classifier], ["run", classifier, classifier, "--out", tmp_path / "p.jsonl"]):
        done = _cli(*args, env=empty)
        assert done.exit_code == 2 and "ACCEL_OPT_PUBLIC_KEY is set but empty" in done.stderr, done.stderr
    monkeypatch.setenv("ACCEL_OPT_PUBLIC_KEY", "")
    with pytest.raises(UsageError, match="set but empty"):
        runtime.load(classifier)
    # The Python API reads the variable like the CLI: an unsigned folder is refused under a pinned key.
    monkeypatch.setenv("ACCEL_OPT_PUBLIC_KEY", f"{key}.pub")
    with pytest.raises(InputRejected, match="signature check failed: model.sig: missing"):
        runtime.load(classifier)
    from accel_opt.runtime.ray.predictor import Predictor

    with pytest.raises(InputRejected, match="model.sig: missing"):
        Predictor(classifier)
    policy = TrustPolicy.of()
    assert policy.as_arguments()["public_key"] == str(Path(f"{key}.pub").resolve())  # what Ray actors are given


def test_what_loads_is_the_copy_that_was_verified(classifier, tmp_path):
    folder = Path(shutil.copytree(classifier, tmp_path / "store"))
    deployment = runtime.load(folder)
    assert deployment.files != folder and deployment.files.name.startswith(COPY_PREFIX)
    assert oct(deployment.files.stat().st_mode & 0o777) == "0o700"
    feed = {"image": np.random.default_rng(0).standard_normal((4, 3, 32, 32)).astype(np.float32)}
    with deployment.runner() as runner:
        before = next(iter(runner.infer(feed).values())).copy()
    # Swapped after the check: another model's bytes where the verified ones were.
    (folder / "model.onnx").write_bytes(b"not the model that was verified")
    with deployment.runner() as runner:
        after = next(iter(runner.infer(feed).values()))
    np.testing.assert_array_equal(before, after)
    copy = deployment.files
    del deployment, runner
    gc.collect()
    assert not copy.exists()  # the private copy goes with its deployment


@pytest.mark.parametrize("entry", ["sub-folder", "symlink", "fifo", "unlisted"])
def test_a_folder_holds_regular_listed_files_only(entry, classifier, photos, tmp_path, key):
    folder = Path(shutil.copytree(classifier, tmp_path / "folder"))
    if entry == "sub-folder":
        (folder / "nested").mkdir()
        (folder / "nested" / "x.so").write_bytes(b"\x7fELF")
    elif entry == "symlink":
        (folder / "tokenizer.json").symlink_to("/etc/passwd")
    elif entry == "fifo":
        os.mkfifo(folder / "pipe")
    else:
        (folder / "extra.bin").write_bytes(b"unlisted")
    expected = {"sub-folder": "nested/: a sub-folder", "symlink": "tokenizer.json: a symbolic link",
                "fifo": "pipe: not a regular file", "unlisted": "extra.bin: not part of the artifact"}[entry]
    for args in (["verify", folder], ["run", folder, photos, "--out", tmp_path / "p.jsonl"]):
        done = _cli(*args)
        assert done.exit_code == 3 and expected in done.stderr, done.stderr
    with pytest.raises(InputRejected):
        runtime.load(folder)
    assert _cli("sign", folder, "--key", f"{key}.pem").exit_code == 3  # never signed as it is
    assert not (folder / SIGNATURE).exists()


@pytest.mark.parametrize("forged", ["model_file outside", "listed outside"])
def test_no_name_leads_out_of_the_folder(forged, classifier, tmp_path):
    folder = Path(shutil.copytree(classifier, tmp_path / "folder"))
    shutil.copy(classifier / "model.onnx", tmp_path / "elsewhere.onnx")
    if forged == "model_file outside":
        _forge_config(folder, model_file="../elsewhere.onnx")
        _rehash(folder)
        expected = "names '../elsewhere.onnx', which is not a file of the artifact"
    else:
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest["artifacts"]["../elsewhere.onnx"] = manifest["artifacts"]["model.onnx"]
        (folder / MANIFEST).write_text(json.dumps(manifest))
        expected = "'../elsewhere.onnx': listed in the manifest, not a plain file name"
    done = _cli("verify", folder)
    assert done.exit_code == 3 and expected in done.stderr, done.stderr
    with pytest.raises(InputRejected, match="elsewhere"):
        runtime.load(folder)


@pytest.mark.parametrize("option", ["trt_extra_plugin_lib_paths", "trt_engine_decryption_lib_path"])
def test_provider_options_from_a_folder_pass_an_allowlist(option, classifier, tmp_path):
    folder = Path(shutil.copytree(classifier, tmp_path / "folder"))
    config = json.loads((folder / "resource_config.json").read_text())
    settings = {**config["settings"], "execution_provider": "TensorrtExecutionProvider",
                "provider_options": {"TensorrtExecutionProvider": {"device_id": "0", option: "/tmp/evil.so"}}}
    _forge_config(folder, settings=settings)
    _rehash(folder)
    done = _cli("verify", folder)
    assert done.exit_code == 3
    assert f"TensorrtExecutionProvider option {option} is not one a build records" in done.stderr
    with pytest.raises(InputRejected, match=option):
        runtime.load(folder)
    # The runner checks the options it is handed too (the boundary where they would reach a session).
    from accel_opt.backends.onnxruntime.backend import OnnxRuntimeBackend

    compiled = runtime.load(classifier).compiled
    compiled.settings = settings
    with pytest.raises(InputRejected, match=option):
        OnnxRuntimeBackend().runner(compiled)


def test_engine_host_code_is_allowed_only_for_a_signed_folder_that_opted_in(classifier, tmp_path, key):
    folder = Path(shutil.copytree(classifier, tmp_path / "folder"))
    config = json.loads((folder / "resource_config.json").read_text())
    _forge_config(folder, settings={**config["settings"], "engine_host_code_allowed": True})
    _rehash(folder)
    assert runtime.load(folder).compiled.settings["engine_host_code_allowed"] is False  # unsigned: refused
    assert _cli("sign", folder, "--key", f"{key}.pem").exit_code == 0
    signed = runtime.load(folder, public_key=f"{key}.pub")
    assert signed.compiled.settings["engine_host_code_allowed"] is True
    assert signed.signature == "signed by the key in builder.pub"


class _RecordingTrt:
    """The tensorrt module at the boundary: records what the loader set on its runtime."""

    class Logger:
        pass

    def __init__(self):
        self.runtimes = []

    def Runtime(self, logger):  # noqa: N802 - tensorrt's name
        outer = self

        class Runtime:
            engine_host_code_allowed = True  # what a careless caller would leave (Polygraphy sets it so)

            def deserialize_cuda_engine(self, data):
                outer.runtimes.append(self)
                return ("engine", data, self.engine_host_code_allowed)

        return Runtime()


@pytest.mark.parametrize("allowed", [False, True])
def test_the_tensorrt_loader_sets_host_code_as_told(allowed):
    from accel_opt.backends.tensorrt.backend import EngineLoader

    trt = _RecordingTrt()
    loader = EngineLoader(b"plan", host_code_allowed=allowed, trt=trt)
    assert loader() == ("engine", b"plan", allowed)
    assert loader.runtime is trt.runtimes[0]  # kept alive with the loader


def test_build_signs_the_folder_as_its_last_step(tiny_cnn_path, fast_recipe, tmp_path, key):
    from accel_opt.artifact.signing import signer_of
    from accel_opt.builder.pipeline import build

    (tmp_path / "bad.pem").write_text("not a key")
    for bad, why in ((tmp_path / "missing.pem", "not found"), (tmp_path / "bad.pem", "not a usable")):
        done = _cli("build", tiny_cnn_path, "--sign-key", bad, "--out", tmp_path / "out")
        assert done.exit_code == 2 and f"--sign-key {bad}: {why}" in done.stderr, done.stderr
        assert not (tmp_path / "out").exists()  # refused before anything was built
    result = build(tiny_cnn_path, fast_recipe, out_dir=tmp_path / "out", signer=signer_of(Path(f"{key}.pem")))
    folder = Path(result.artifact_dir)
    verified = _cli("verify", folder, "--public-key", f"{key}.pub")
    assert verified.exit_code == 0 and "signed by the key in builder.pub" in verified.stdout, verified.stderr
    # An identical build is reused only with proof this key's build made it: its own signature. Another key's
    # build rebuilds the folder (issue 74: a folder found under --out and re-hashed must never be signed as built).
    again = build(tiny_cnn_path, fast_recipe, out_dir=tmp_path / "out", signer=signer_of(Path(f"{key}.pem")))
    assert again.reused and again.artifact_dir == result.artifact_dir
    _write_key_pair(tmp_path, "next")
    other = build(tiny_cnn_path, fast_recipe, out_dir=tmp_path / "out", signer=signer_of(tmp_path / "next.pem"))
    assert not other.reused and other.artifact_dir == result.artifact_dir
    assert _cli("verify", folder, "--public-key", tmp_path / "next.pub").exit_code == 0


def test_a_killed_process_leaves_its_copy_to_the_next_load_not_forever(classifier, tmp_path, monkeypatch):
    """SIGKILL (how Ray stops its workers, at shutdown and when a node goes) runs no finalizer: the copy stays until
    the next load on the machine removes it. Copies of live processes, and of other users, are left alone."""
    import signal
    import subprocess
    import sys
    import tempfile

    from accel_opt.artifact.verified import sweep_orphaned_copies

    temp = tmp_path / "tmp"
    temp.mkdir()
    killed = subprocess.run([sys.executable, "-c", "import os, signal\nfrom accel_opt import runtime\n"
                             f"d = runtime.load({str(classifier)!r})\nos.kill(os.getpid(), signal.SIGKILL)"],
                            env={**os.environ, "TMPDIR": str(temp)}, capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    copies = temp / f"accel-opt-copies-{os.getuid()}"  # this user's own folder of copies: the sweep reads it alone
    assert copies.stat().st_mode & 0o777 == 0o700
    left = [p for p in copies.iterdir() if p.name.startswith(COPY_PREFIX)]
    assert len(left) == 1 and (left[0] / "manifest.json").is_file()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    mine = runtime.load(classifier)  # the next load removes the dead process's copy, and makes its own
    assert not left[0].exists() and mine.files.parent == copies and mine.files.exists()
    assert sweep_orphaned_copies(copies) == [] and mine.files.exists()  # a live process's copy is left alone
