"""Signed artifact folders: who built a folder, on top of the manifest's hashes (which only prove it is intact).

`accel-opt sign` writes `model.sig` inside the folder with the OpenSSF `model-signing` package: a Sigstore
bundle over an in-toto statement of every file's sha256, `manifest.json` included, signed with an
elliptic-curve key (or a key whose certificate chains to a CA). Anyone can change a file and re-hash the
manifest; nobody without the private key can sign the result. Verification hashes the folder's bytes and
parses only the signature itself, so it runs before anything in the folder is deserialized.

model-signing is an optional extra, imported here only. In 1.1.1 `import model_signing` needs pyOpenSSL,
which it does not declare (the extra does); its Python API hashes the signature file too unless told to
ignore it; a verifying Config reused across folders keeps the previous folder's ignore paths, so each
verification builds a fresh one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from accel_opt.artifact.folder import SIGNATURE
from accel_opt.errors import Unsupported, UsageError, first_line
from accel_opt.files import install_line

# a trusted public key for run/bench/verify/compare when --public-key is not given
PUBLIC_KEY_ENV = "ACCEL_OPT_PUBLIC_KEY"
INSTALL = install_line("sign")
# Backends whose artifact is native code once deserialized: loading it runs whatever its builder put there.
NATIVE_CODE = {"torch": "an AOTInductor package (a compiled shared library)",
               "tensorrt": "a TensorRT plan (executable GPU code)"}
TRUST_HINT = (f"give --public-key KEY (or {PUBLIC_KEY_ENV}=KEY) of whoever built and signed it, or --trust-unsigned "
              "to run it anyway")


@dataclass(frozen=True)
class Trust:
    """Whose signature a folder must carry: an elliptic-curve public key, or the CA certificates a signing
    certificate must chain to."""

    public_key: Path | None = None
    certificate_chain: tuple[Path, ...] = ()

    def describe(self) -> str:
        if self.public_key is not None:
            return f"the key in {self.public_key.name}"
        return f"the certificates in {', '.join(p.name for p in self.certificate_chain)}"


@dataclass(frozen=True)
class TrustPolicy:
    """What may run: folders signed by `key` (checked first), or with no key unsigned ones, where native code (a
    torch package, a TensorRT plan or engine cache) runs only when `trust_unsigned` says so. One policy for the CLI,
    `runtime.load` and the Ray APIs, built by `of` from the same arguments and the same environment variable."""

    key: Trust | None = None
    trust_unsigned: bool = False

    @classmethod
    def of(cls, public_key: str | Path | None = None, certificate_chain: Iterable[str | Path] = (),
           trust_unsigned: bool = False, environ: dict[str, str] | None = None) -> TrustPolicy:
        """The policy of these arguments; without a key or chain, the key named by ACCEL_OPT_PUBLIC_KEY. That variable
        set but empty is a usage error (exit 2): a deployment that meant to pin a key must not silently run unsigned."""
        environ = os.environ if environ is None else environ
        chain = tuple(certificate_chain or ())
        if public_key is None and not chain and PUBLIC_KEY_ENV in environ:
            public_key = environ[PUBLIC_KEY_ENV]
            if not public_key.strip():
                raise UsageError(f"{PUBLIC_KEY_ENV} is set but empty: name a public key (PEM), or unset it")
        return cls(key=trust_of(public_key, chain), trust_unsigned=trust_unsigned)

    def as_arguments(self) -> dict:
        """The keyword arguments of `runtime.load` (and the Ray APIs) that rebuild this policy in another process,
        whatever its environment."""
        key = self.key or Trust()
        return {"public_key": str(key.public_key.resolve()) if key.public_key else None,
                "certificate_chain": tuple(str(p.resolve()) for p in key.certificate_chain),
                "trust_unsigned": self.trust_unsigned}

    def refusal(self, native_code: str | None) -> str | None:
        """Why an unsigned folder holding `native_code` (NATIVE_CODE's words; None: none) may not load, or None."""
        if self.key is not None or native_code is None or self.trust_unsigned:
            return None
        return f"it holds {native_code} and is not signed by a trusted key: {TRUST_HINT}"

    def describe(self, native_code: str | None) -> str:
        """The folder's signature state as every summary says it, once the folder has loaded under this policy."""
        if self.key is not None:
            return f"signed by {self.key.describe()}"
        return "unsigned native code, run by --trust-unsigned" if native_code else "unsigned"


def native_code_of(backend: str, settings: dict) -> str | None:
    """What native code a folder of `backend` with these resource-config `settings` loads (None: none): a torch
    package or TensorRT plan, or the TensorRT EP's serialized engines of an ONNX Runtime build."""
    if backend in NATIVE_CODE:
        return NATIVE_CODE[backend]
    # Any TensorRT EP cache counts, not only files listed as engines: an engine listed as a timing file (and a prefix
    # pointing there) would load just the same; and an engine cache switched on reads what it finds.
    cache, options = settings.get("trt_engine_cache"), settings.get("provider_options")
    cache = cache if isinstance(cache, dict) else {}  # a forged type is refused by the settings check after this
    options = options.get("TensorrtExecutionProvider") if isinstance(options, dict) else None
    options = options if isinstance(options, dict) else {}
    cache_enabled = str(options.get("trt_engine_cache_enable")).lower() == "true"
    if cache.get("engine_files") or cache.get("timing_files") or cache_enabled:
        return "TensorRT EP engines (executable GPU code)"
    return None


def trust_of(public_key: str | Path | None, certificate_chain: Iterable[str | Path] = ()) -> Trust | None:
    """The Trust the options ask for, or None (no signature required). Key files are checked here (exit 2)."""
    chain = tuple(Path(p) for p in certificate_chain)
    if public_key is not None and chain:
        raise UsageError("--public-key and --certificate-chain: give one (a key, or the CA a signing certificate "
                         "chains to)")
    if public_key is None and not chain:
        return None
    for path, option in [(Path(public_key),
                          "--public-key")] if public_key is not None else [(p, "--certificate-chain") for p in chain]:
        if not path.is_file():
            raise UsageError(f"{option} {path}: not found")
    if public_key is not None:
        _check_public_key(Path(public_key))
    return Trust(public_key=Path(public_key) if public_key is not None else None, certificate_chain=chain)


def signer_of(private_key: Path, signing_certificate: Path | None = None,
              certificate_chain: Iterable[Path] = (), option: str = "--key") -> Signer:
    """A Signer with this key (and certificate); the key is loaded and checked now (exit 2), so `build --sign-key`
    refuses a bad key before it builds."""
    signing, _, hashing = _model_signing()
    chain = [Path(p) for p in certificate_chain]
    for path, name in [(private_key, option), *([(signing_certificate,
                                                  "--signing-certificate")] if signing_certificate else []),
                       *[(p, "--certificate-chain") for p in chain]]:
        if not Path(path).is_file():
            raise UsageError(f"{name} {path}: not found")
    if chain and signing_certificate is None:
        raise UsageError(f"--certificate-chain needs --signing-certificate (the certificate of {option})")
    config = signing.Config()
    try:
        if signing_certificate is not None:
            config.use_certificate_signer(private_key=private_key, signing_certificate=signing_certificate,
                                          certificate_chain=chain)
        else:
            config.use_elliptic_key_signer(private_key=private_key)
    except (ValueError, TypeError) as exc:  # not PEM, not a private key, not an elliptic curve
        raise UsageError(f"{option} {private_key}: not a usable elliptic-curve private key "
                         f"({first_line(exc)})") from None
    config.set_hashing_config(_hashing_config(hashing))
    return Signer(config, Path(private_key), option, by_certificate=signing_certificate is not None)


class Signer:
    """Signs every file of a folder (a previous signature excepted) into `folder/model.sig` (calling it returns that
    path): the signature certifies the folder's contents as they are when it runs. `signed(folder)` says whether a
    folder already carries a valid signature by this very key: the proof a build needs before it reuses a folder it
    finds under --out instead of building it."""

    def __init__(self, config, private_key: Path, option: str, by_certificate: bool):
        self._config, self.private_key, self._option, self._by_certificate = config, private_key, option, by_certificate

    def __call__(self, folder: Path) -> Path:
        target = folder / SIGNATURE
        # The bundle is written after the folder is hashed, to a temporary name, then renamed: a reader never
        # sees half a signature, and the temporary file does not exist while the files are hashed.
        tmp = folder / f".{SIGNATURE}.{os.getpid()}.tmp"
        try:
            self._config.sign(folder, tmp)
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        # a certificate that does not match the key, a symlink in the folder, ...
        except (ValueError, TypeError) as exc:
            raise UsageError(f"cannot sign {folder} with {self._option} {self.private_key}: "
                             f"{first_line(exc)}") from None
        finally:
            Path(tmp).unlink(missing_ok=True)
        return target

    def signed(self, folder: Path) -> bool:
        """Whether `folder`'s signature verifies against this key's public half. A certificate signer answers False
        (its folders are rebuilt rather than trusted by a chain anyone with a certificate from that CA satisfies)."""
        if self._by_certificate or not (folder / SIGNATURE).is_file():
            return False
        import tempfile

        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_pem_private_key

        public = load_pem_private_key(self.private_key.read_bytes(), password=None).public_key()
        with tempfile.TemporaryDirectory(prefix="accel-opt-key-") as tmp:
            pem = Path(tmp) / "signer.pub"
            pem.write_bytes(public.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
            return signature_problem(folder, Trust(public_key=pem)) is None


def sign_folder(folder: Path, private_key: Path, signing_certificate: Path | None = None,
                certificate_chain: Iterable[Path] = ()) -> Path:
    """Sign every file of `folder` (a previous signature excepted) into `folder/model.sig`; return its path.
    With `signing_certificate`, the bundle carries that certificate (and `certificate_chain`) instead of a key hint."""
    return signer_of(private_key, signing_certificate, certificate_chain)(folder)


def signature_problem(folder: Path, trust: Trust) -> str | None:
    """One line naming why `folder` is not signed by `trust` (the file changed, added or missing, or the key),
    or None when the signature covers exactly the folder's files."""
    _, verifying, hashing = _model_signing()
    signature = folder / SIGNATURE
    if not signature.is_file():
        return f"{SIGNATURE}: missing: the folder is not signed (accel-opt sign ARTIFACT --key KEY)"
    config = verifying.Config()  # fresh per folder: a reused one keeps the last folder's ignore paths
    if trust.public_key is not None:
        config.use_elliptic_key_verifier(public_key=trust.public_key)
    else:
        config.use_certificate_verifier(certificate_chain=list(trust.certificate_chain))
    config.set_hashing_config(_hashing_config(hashing))
    try:
        config.verify(folder, signature)
    except Exception as exc:  # noqa: BLE001 - any failure to verify is a refusal (signature parse errors, chain errors)
        return _explain(exc, trust)
    return None


def _explain(exc: Exception, trust: Trust) -> str:
    text = str(exc).replace("\\'", "'")  # a list's repr: an item holding quotes escapes them
    found = []  # model-signing lists every difference; name each file once, on one line
    if changed := re.findall(r"Hash mismatch for '([^']+)'", text):
        found.append(f"{', '.join(changed)}: changed after the folder was signed")
    if missing := re.search(r"Missing files in model '[^']*': ([^\"'\]]+)", text):
        found.append(f"{missing.group(1).strip()}: missing (removed after the folder was signed)")
    if extra := re.search(r"Extra files found in model '[^']*': ([^\"'\]]+)", text):
        found.append(f"{extra.group(1).strip()}: added after the folder was signed (not covered by its signature)")
    if found:
        return "; ".join(found)
    if "Key mismatch" in text or isinstance(exc, AttributeError):  # AttributeError: a bundle of the other kind
        return f"{SIGNATURE}: not signed by {trust.describe()}"
    return f"{SIGNATURE}: does not verify against {trust.describe()} ({type(exc).__name__}: {first_line(exc)})"


def _hashing_config(hashing):
    """Every file of the folder, git paths included, but the signature itself."""
    return hashing.Config().set_ignored_paths(paths=[SIGNATURE], ignore_git_paths=False)


def _check_public_key(path: Path) -> None:
    _model_signing()  # cryptography comes with it
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePublicKey
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    try:
        key = load_pem_public_key(path.read_bytes())
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--public-key {path}: not a public key in PEM ({first_line(exc)})") from None
    if not isinstance(key, EllipticCurvePublicKey):
        raise UsageError(f"--public-key {path}: not an elliptic-curve key ({type(key).__name__}); model signing uses "
                         "EC keys")


def _model_signing():
    """(signing, verifying, hashing) of model-signing, or Unsupported (exit 4) naming the extra to install."""
    try:
        from model_signing import hashing, signing, verifying
    except ImportError as exc:
        raise Unsupported(f"signing needs the model-signing package ({first_line(exc)}): {INSTALL}") from None
    return signing, verifying, hashing
