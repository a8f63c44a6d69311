"""A build reuses only what it can prove it made (issue 74, items 1-2): cache entries under --out carry this user's
HMAC of their bytes, and `build --sign-key` reuses a folder it finds only when that very key signed it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from accel_opt.artifact.folder import MANIFEST, file_hashes
from accel_opt.builder.pipeline import build
from accel_opt.files import MADE_SUFFIX, made_bytes, made_copy, mark_made, sha256_file, user_cache_dir

from ..conftest import image_npz_folder


@pytest.fixture()
def own_cache(tmp_path, monkeypatch):
    """This test's own user cache (and so its own cache secret)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    return tmp_path / "user-cache"


def test_an_entry_is_reused_only_with_this_users_mark_of_its_bytes(tmp_path, own_cache):
    entry, dest = tmp_path / "cache" / "model.pt2", tmp_path / "work" / "model.pt2"
    entry.parent.mkdir()
    entry.write_bytes(b"planted")  # no mark: planted by whoever can write --out
    assert not made_copy(entry, dest) and not dest.exists() and made_bytes(entry) is None
    mark_made(entry)
    assert made_copy(entry, dest) and dest.read_bytes() == b"planted" and made_bytes(entry) == b"planted"
    entry.write_bytes(b"swapped after it was marked")
    assert not made_copy(entry, dest) and not dest.exists() and made_bytes(entry) is None
    # A mark copied from elsewhere, or made under another user's secret, proves nothing.
    mark_made(entry)
    secret = user_cache_dir("cache-secret")
    assert secret.stat().st_mode & 0o777 == 0o600
    secret.chmod(0o644)  # readable by others: not trusted, replaced; nothing marked under it is reused
    assert made_bytes(entry) is None and secret.stat().st_mode & 0o777 == 0o600


def test_a_cached_int8_model_altered_under_out_is_calibrated_again(tiny_cnn_path, fast_recipe, tmp_path, own_cache):
    data = image_npz_folder(tmp_path / "data", 40)
    recipe = fast_recipe.with_overrides(precision="int8", **{"precision_options.fallback.enabled": False})
    first = build(tiny_cnn_path, recipe, data_dir=data, out_dir=tmp_path / "out")
    (cached,) = (tmp_path / "out" / ".cache" / "calibration").glob("*.onnx")
    assert (cached.parent / (cached.name + MADE_SUFFIX)).is_file()

    def notes(result) -> str:
        return " ".join(json.loads((Path(result.artifact_dir) / "build.json").read_text())["precision"]["notes"])

    again = build(tiny_cnn_path, recipe, data_dir=data, out_dir=tmp_path / "out", force=True)
    assert "calibration cache hit" in notes(again)
    model = onnx.load(str(cached))  # what a planter writes: a valid model of its own
    weight = next(i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT)
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * np.float32(-1), weight.name))
    onnx.save(model, str(cached))
    planted = build(tiny_cnn_path, recipe, data_dir=data, out_dir=tmp_path / "out", force=True)
    assert "calibration cache hit" not in notes(planted)
    config = json.loads((Path(first.artifact_dir) / "resource_config.json").read_text())
    assert sha256_file(Path(planted.artifact_dir)
                       / config["model_file"]) == sha256_file(Path(first.artifact_dir) / config["model_file"])


def test_sign_key_never_signs_a_folder_it_did_not_build(tiny_cnn_path, fast_recipe, tmp_path):
    pytest.importorskip("model_signing")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from accel_opt.artifact.signing import signer_of

    keys = {}
    for name in ("ours", "theirs"):
        key = ec.generate_private_key(ec.SECP256R1())
        keys[name] = tmp_path / f"{name}.pem"
        keys[name].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))
    out = tmp_path / "out"
    built = Path(build(tiny_cnn_path, fast_recipe, out_dir=out).artifact_dir)
    honest = sha256_file(built / "model.onnx")
    forged = onnx.load(str(built / "model.onnx"))  # edited in --out and re-hashed: the hashes alone cannot tell
    weight = forged.graph.initializer[0]
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * np.float32(3), weight.name))
    os.chmod(built / "model.onnx", 0o644)
    onnx.save(forged, str(built / "model.onnx"))
    manifest = json.loads((built / MANIFEST).read_text())
    manifest["artifacts"] = file_hashes(built)
    (built / MANIFEST).write_text(json.dumps(manifest))

    # Without a key, the folder's proof is this user's mark of the manifest it was published with: edited and
    # re-hashed, it has none, and is built again rather than reused.
    unsigned = build(tiny_cnn_path, fast_recipe, out_dir=out)
    assert not unsigned.reused and sha256_file(Path(unsigned.artifact_dir) / "model.onnx") == honest
    assert build(tiny_cnn_path, fast_recipe, out_dir=out).reused  # and now it is this build's own again
    os.chmod(built / "model.onnx", 0o644)
    onnx.save(forged, str(built / "model.onnx"))
    manifest = json.loads((built / MANIFEST).read_text())
    manifest["artifacts"] = file_hashes(built)
    (built / MANIFEST).write_text(json.dumps(manifest))

    signed = build(tiny_cnn_path, fast_recipe, out_dir=out, signer=signer_of(keys["ours"]))
    assert not signed.reused and sha256_file(Path(signed.artifact_dir) / "model.onnx") == honest  # rebuilt, then signed
    again = build(tiny_cnn_path, fast_recipe, out_dir=out, signer=signer_of(keys["ours"]))
    assert again.reused  # signed by this very key: proof a build holding it made the folder
    other = build(tiny_cnn_path, fast_recipe, out_dir=out, signer=signer_of(keys["theirs"]))
    assert not other.reused
    shutil.rmtree(out)
