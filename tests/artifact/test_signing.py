"""Signed folders: the manifest's hashes prove a folder intact, a signature proves who built it. Anyone can
change a file and re-hash the manifest; only the private key's holder can sign the result."""

from __future__ import annotations

import datetime
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

from accel_opt import runtime
from accel_opt.artifact.folder import MANIFEST, SIGNATURE, file_hashes
from accel_opt.cli import main
from accel_opt.files import install_line

pytest.importorskip("model_signing", reason="the sign extra is not installed (pip install '.[sign]')")

from cryptography import x509  # noqa: E402 - a dependency of model-signing
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402


def _write_key_pair(folder: Path, name: str) -> ec.EllipticCurvePrivateKey:
    key = ec.generate_private_key(ec.SECP256R1())
    (folder / f"{name}.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    (folder / f"{name}.pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                       serialization.PublicFormat.SubjectPublicKeyInfo))
    return key


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    """ours.pem/.pub and theirs.pem/.pub: two elliptic-curve key pairs."""
    folder = tmp_path_factory.mktemp("keys")
    for name in ("ours", "theirs"):
        _write_key_pair(folder, name)
    return folder


def _cli(*args) -> object:
    return CliRunner().invoke(main, [*map(str, args)])


def _signed_copy(classifier: Path, tmp_path: Path, keys: Path, key: str = "ours") -> Path:
    folder = Path(shutil.copytree(classifier, tmp_path / classifier.name))
    signed = _cli("sign", folder, "--key", keys / f"{key}.pem")
    assert signed.exit_code == 0, signed.stderr
    assert signed.stdout.startswith(f"signed: {folder / SIGNATURE}: ") and "manifest.json included" in signed.stdout
    return folder


def _rehash(folder: Path) -> None:
    """What a forger does after changing a file: rewrite the manifest's hashes to match."""
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["artifacts"] = file_hashes(folder)
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))


def _change_weights(folder: Path) -> None:
    model = onnx.load(str(folder / "model.onnx"))
    weight = model.graph.initializer[0]
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * np.float32(1.01), weight.name))
    onnx.save(model, str(folder / "model.onnx"))


def test_a_signed_folder_verifies_and_runs_with_its_public_key(classifier, photos, tmp_path, keys):
    folder = _signed_copy(classifier, tmp_path, keys)
    assert runtime.check(folder) == []  # the signature is the one file no manifest lists
    assert runtime.artifact_identity(folder) == runtime.artifact_identity(classifier)  # signing changes no answer
    verified = _cli("verify", folder, "--public-key", keys / "ours.pub")
    assert verified.exit_code == 0, verified.stderr
    assert verified.stdout.startswith(f"ok: {folder}: signature: signed by the key in ours.pub; ")
    assert "model.sig not checked (give --public-key)" in _cli("verify", folder).stdout
    ran = _cli("run", folder, photos, "--out", tmp_path / "p.jsonl", "--public-key", keys / "ours.pub")
    assert ran.exit_code == 0, ran.stderr
    # The trusted key may come from the environment.
    env_ok = CliRunner(env={"ACCEL_OPT_PUBLIC_KEY": str(keys / "ours.pub")}).invoke(main, ["verify", str(folder)])
    assert env_ok.exit_code == 0 and "signed by the key in ours.pub" in env_ok.stdout
    env_other = CliRunner(env={"ACCEL_OPT_PUBLIC_KEY": str(keys / "theirs.pub")}).invoke(main, ["verify", str(folder)])
    assert env_other.exit_code == 3


def test_a_forged_folder_passes_the_hashes_but_not_the_signature(classifier, photos, tmp_path, keys):
    folder = _signed_copy(classifier, tmp_path, keys)
    _change_weights(folder)
    _rehash(folder)
    assert runtime.check(folder) == []  # the hashes alone accept the forgery
    assert _cli("verify", folder).exit_code == 0
    refused = _cli("verify", folder, "--public-key", keys / "ours.pub")
    assert refused.exit_code == 3
    assert refused.stderr.strip() == (f"accel-opt: {folder}: signature check failed: manifest.json, model.onnx: "
                                      "changed "
                                      "after the folder was signed")
    out = tmp_path / "p.jsonl"
    ran = _cli("run", folder, photos, "--out", out, "--public-key", keys / "ours.pub")
    assert ran.exit_code == 3 and "signature check failed" in ran.stderr and ran.stderr.count("\n") == 1
    assert not out.exists()
    assert _cli("bench", folder, "--public-key", keys / "ours.pub").exit_code == 3
    # compare verifies both folders: a signed baseline does not vouch for a forged candidate, nor the reverse.
    good = _signed_copy(classifier, tmp_path / "good", keys)
    for pair in ((good, folder), (folder, good)):
        compared = _cli("compare", *pair, "--public-key", keys / "ours.pub")
        assert compared.exit_code == 3 and f"{folder}: signature check failed" in compared.stderr


def test_the_signature_is_checked_before_anything_is_deserialized(classifier, tmp_path, keys):
    folder = _signed_copy(classifier, tmp_path, keys)
    (folder / "resource_config.json").write_text("{not json")
    _rehash(folder)
    unchecked = _cli("verify", folder)
    assert unchecked.exit_code == 3 and "resource_config.json is unreadable" in unchecked.stderr  # parsed: no key
    with_key = _cli("verify", folder, "--public-key", keys / "ours.pub")
    assert with_key.exit_code == 3 and "signature check failed" in with_key.stderr
    assert "is unreadable" not in with_key.stderr  # refused before it was parsed
    (folder / SIGNATURE).write_text("not a bundle")
    garbled = _cli("verify", folder, "--public-key", keys / "ours.pub")
    assert garbled.exit_code == 3 and f"{SIGNATURE}: does not verify against the key in ours.pub" in garbled.stderr


def test_another_key_or_no_signature_is_refused(classifier, tmp_path, keys):
    theirs = _signed_copy(classifier, tmp_path, keys, key="theirs")
    refused = _cli("verify", theirs, "--public-key", keys / "ours.pub")
    assert refused.exit_code == 3 and f"{SIGNATURE}: not signed by the key in ours.pub" in refused.stderr
    with pytest.raises(Exception, match="not signed by the key in ours.pub"):
        from accel_opt.artifact.signing import trust_of

        runtime.load(theirs, trust=trust_of(keys / "ours.pub"))
    unsigned = _cli("verify", classifier, "--public-key", keys / "ours.pub")
    assert unsigned.exit_code == 3 and f"{SIGNATURE}: missing: the folder is not signed" in unsigned.stderr


def test_a_signature_over_an_older_manifest_or_other_files_is_refused(classifier, tmp_path, keys):
    folder = _signed_copy(classifier, tmp_path, keys)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["created_utc"] = "2030-01-01T00:00:00+00:00"  # a rebuilt manifest under the old signature
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))
    assert runtime.check(folder) == []
    refused = _cli("verify", folder, "--public-key", keys / "ours.pub")
    assert refused.exit_code == 3 and "manifest.json: changed after the folder was signed" in refused.stderr

    removed = _signed_copy(classifier, tmp_path / "removed", keys)
    (removed / "benchmark.md").unlink()
    _rehash(removed)
    refused = _cli("verify", removed, "--public-key", keys / "ours.pub")
    assert refused.exit_code == 3 and "benchmark.md: missing (removed after the folder was signed)" in refused.stderr

    added = _signed_copy(classifier, tmp_path / "added", keys)
    (added / "notes.txt").write_text("added later")
    _rehash(added)
    refused = _cli("verify", added, "--public-key", keys / "ours.pub")
    assert refused.exit_code == 3 and "notes.txt: added after the folder was signed" in refused.stderr


def _certificate(subject: str, key, issuer_name: x509.Name, issuer_key, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    usage = dict(digital_signature=not ca, content_commitment=False, key_encipherment=False, data_encipherment=False,
                 key_agreement=False, key_cert_sign=ca, crl_sign=ca, encipher_only=False, decipher_only=False)
    builder = builder.add_extension(x509.KeyUsage(**usage), critical=True)
    if not ca:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def test_certificate_signing_verifies_against_the_ca(classifier, tmp_path, keys):
    pem = serialization.Encoding.PEM
    cas = {}
    for name in ("ca", "other-ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cas[name] = (key, subject)
        (tmp_path / f"{name}.crt").write_bytes(_certificate(name, key, subject, key, ca=True).public_bytes(pem))
    leaf_key = _write_key_pair(tmp_path, "ci")
    ca_key, ca_name = cas["ca"]
    (tmp_path / "ci.crt").write_bytes(_certificate("ci signer", leaf_key, ca_name, ca_key, ca=False).public_bytes(pem))
    folder = Path(shutil.copytree(classifier, tmp_path / "art"))
    signed = _cli("sign", folder, "--key", tmp_path / "ci.pem", "--signing-certificate", tmp_path / "ci.crt",
                  "--certificate-chain", tmp_path / "ca.crt")
    assert signed.exit_code == 0, signed.stderr
    verified = _cli("verify", folder, "--certificate-chain", tmp_path / "ca.crt")
    assert verified.exit_code == 0 and "signed by the certificates in ca.crt" in verified.stdout
    other = _cli("verify", folder, "--certificate-chain", tmp_path / "other-ca.crt")
    assert other.exit_code == 3 and "does not verify against the certificates in other-ca.crt" in other.stderr
    both = _cli("verify", folder, "--public-key", keys / "ours.pub", "--certificate-chain", tmp_path / "ca.crt")
    assert both.exit_code == 2


def test_bad_keys_and_altered_folders_are_refused_before_signing(classifier, tmp_path, keys):
    missing = _cli("verify", classifier, "--public-key", tmp_path / "nope.pub")
    assert missing.exit_code == 2 and "--public-key" in missing.stderr and "not found" in missing.stderr
    private = _cli("verify", classifier, "--public-key", keys / "ours.pem")
    assert private.exit_code == 2 and "not a public key in PEM" in private.stderr
    folder = Path(shutil.copytree(classifier, tmp_path / "art"))
    wrong_key = _cli("sign", folder, "--key", keys / "ours.pub")
    assert wrong_key.exit_code == 2 and "not a usable elliptic-curve private key" in wrong_key.stderr
    (folder / "model.onnx").write_bytes(b"changed")
    altered = _cli("sign", folder, "--key", keys / "ours.pem")
    assert altered.exit_code == 3 and "not signed: artifact altered or incomplete: model.onnx" in altered.stderr
    assert not (folder / SIGNATURE).exists() and not list(folder.glob(f".{SIGNATURE}*"))


def test_without_model_signing_it_is_exit_4_with_the_install_command(classifier, tmp_path, keys, monkeypatch):
    monkeypatch.setitem(sys.modules, "model_signing", None)  # what an install without the extra sees: ImportError
    for args in (["verify", classifier, "--public-key", keys / "ours.pub"],
                 ["sign", Path(shutil.copytree(classifier, tmp_path / "art")), "--key", keys / "ours.pem"]):
        result = _cli(*args)
        assert result.exit_code == 4 and install_line("sign") in result.stderr
