"""`accel-opt verify` and `accel-opt sign`: whether a built folder is whole, runs here as checked, and who made it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from accel_opt.cli.common import allow_not_signed_off_option, fail, trust_from, trust_options
from accel_opt.errors import AccelOptError

VERIFY_EXIT_CODES = """\b
Exit codes:
  0  complete, unaltered, signed off by its build, and runnable here as it was checked (and, with --public-key,
     signed by that key)
  1  not signed off by its build: its gate failed (the verdict's reason is printed); --accuracy: the re-check of
     the build's gate on this machine failed
  2  a --public-key or --certificate-chain file missing or not a usable key
  3  incomplete or altered (no manifest, a file missing, changed or not part of it); with --public-key,
     unsigned, signed by another key, or a file changed, added or removed after signing
  4  this machine cannot run it as it was checked (backend missing, another runtime version or CPU);
     --public-key without model-signing installed (accel-opt's `sign` extra)
  6  not signed off by its build: too few held-out samples to certify it
  7  not signed off by its build: no measured benefit over its fp32 build
  70 internal error (a bug; the log path is printed)
--accuracy runs the folder: one that is not signed off is refused (its verdict's code) unless --allow-not-signed-off."""


@click.command("verify", epilog=VERIFY_EXIT_CODES)
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--accuracy", is_flag=True, help="Also re-run the build's accuracy gate here, on the probe set the "
              "folder carries (seconds): the sign-off's verdict for this CPU's kernels. Exit 1 when it fails.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@allow_not_signed_off_option
@trust_options
def verify_command(artifact, accuracy, as_json, allow_not_signed_off, public_key, certificate_chain, trust_unsigned):
    """Check a built ARTIFACT folder before running it: its signature (with --public-key), manifest, every
    file's sha256, the environment, its build's verdict, and which CPU class its sign-off holds for (--accuracy
    re-checks it here)."""
    from accel_opt import runtime
    from accel_opt.machine.cpu import CpuProfile

    recheck = scope = trust = manifest = files = None
    try:
        trust, cpu = trust_from(public_key, certificate_chain, trust_unsigned), CpuProfile.here()
        problems = runtime.check(artifact, trust=trust, cpu=cpu)
        if not problems:
            files = artifact  # checked in place: nothing in it runs, its verdict is reported (and is the exit code)
            if accuracy:  # runs the folder: through the door (the verified copy, the verdict enforced), read from there
                from accel_opt.runtime.probe import recheck as run_recheck

                deployment = runtime.load(artifact, trust=trust, cpu=cpu, allow_not_signed_off=allow_not_signed_off)
                files, recheck = deployment.files, run_recheck(deployment)  # before the scope: its line says this
            manifest, scope = runtime.read_manifest(files), runtime.sign_off_scope(files, cpu)
            if recheck is not None and not scope.same_class:
                scope.remembered = recheck.passed
    except (AccelOptError, MemoryError, Exception) as exc:  # noqa: BLE001 - a bug is exit 70 with one line
        fail(exc, False, as_json)
        return
    exit_code = 3 if any(p.exit_code == 3 for p in problems) else 4 if problems else 0
    verdict = manifest.verdict if manifest is not None else None
    if verdict is not None and not verdict.signed_off:  # the build's own code: 1, 6 or 7
        exit_code = verdict.exit_code
    if recheck is not None and not recheck.passed:
        exit_code = 1
    judged, reach = None, []
    if recheck is not None:
        from accel_opt.runtime.probe import probe_evaluated, recheck_reach

        evaluated = probe_evaluated(files)
        judged = f"{recheck.sample_count} probe samples" + (f" of the {evaluated} the build judged"
                                                            if evaluated else "")
        reach = recheck_reach(recheck, evaluated)
    if as_json:
        click.echo(json.dumps({"artifact_dir": str(artifact), "ok": exit_code == 0, "exit_code": exit_code,
                               "signature_checked": trust is not None and trust.key is not None,
                               "signature": _signature_line(files, trust) if files else None,
                               "problems": [p.model_dump() for p in problems],
                               "signed_off": verdict.signed_off if verdict else None,
                               "verdict": verdict.model_dump(mode="json") if verdict else None,
                               "cpu_class": scope.model_dump() if scope else None,
                               "recheck": {**recheck.model_dump(mode="json",
                                                                include={"sample_count", "failures", "checks"}),
                                           "passed": recheck.passed, "judged": judged, "confirms": reach}
                               if recheck else None}))
    elif problems:
        for problem in problems:
            click.echo(f"accel-opt: {artifact}: {problem.line}", err=True)
    else:
        click.echo(f"{'ok' if exit_code == 0 else 'not ok'}: {artifact}: signature: {_signature_line(files, trust)}; "
                   f"{len(manifest.artifacts)} files match manifest.json; {manifest.backend} {manifest.precision} runs "
                   f"here as built; verdict: {verdict.line()}; "
                   f"{scope.line(artifact)}")
        if recheck is not None:
            verdict_line = (f"no check failed; what {recheck.sample_count} samples show:" if recheck.passed
                            else "FAILED: " + "; ".join(recheck.failures))
            click.echo(f"accuracy re-checked here ({scope.here}) on {judged}, worst cosine "
                       f"{recheck.worst_cosine:.6f}: {verdict_line}", err=not recheck.passed)
            for line in reach:
                click.echo(f"  {line}")
    sys.exit(exit_code)


def _signature_line(artifact: Path, trust) -> str:
    """The verified folder's signature state under the TrustPolicy `trust`, as `run` and `bench` would say it."""
    from accel_opt.artifact.config import RESOURCE_CONFIG, ResourceConfig
    from accel_opt.artifact.folder import SIGNATURE
    from accel_opt.artifact.signing import native_code_of

    if trust.key is None and (artifact / SIGNATURE).is_file():
        return f"{SIGNATURE} not checked (give --public-key)"
    config = ResourceConfig.model_validate_json((artifact / RESOURCE_CONFIG).read_text())
    return trust.describe(native_code_of(config.backend, config.settings))


SIGN_EXIT_CODES = """\b
Exit codes:
  0  signed: ARTIFACT/model.sig covers every file of the folder, manifest.json included
  2  a key or certificate file missing or unusable
  3  the folder is incomplete or altered (it is verified before it is signed)
  4  model-signing is not installed (accel-opt's `sign` extra)"""


@click.command("sign", epilog=SIGN_EXIT_CODES)
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--key", "private_key", type=click.Path(path_type=Path), required=True,
              help="Elliptic-curve private key (PEM).")
@click.option("--signing-certificate", type=click.Path(path_type=Path),
              help="The certificate of --key: the signature carries it, and verifiers trust its CA instead of one key.")
@click.option("--certificate-chain", "certificate_chain", multiple=True, type=click.Path(path_type=Path),
              help="Certificates from the signing certificate up to the CA (PEM; repeatable).")
def sign_command(artifact, private_key, signing_certificate, certificate_chain):
    """Sign a built ARTIFACT folder: model.sig, written inside it, certifies its files as they are NOW (the manifest's
    hashes only prove it intact, and anyone can recompute them). The folder is verified first, but a file changed
    before this and re-hashed cannot be told apart: to prove who built a folder, sign it as the build's last step
    (`accel-opt build --sign-key KEY`). Check it with `accel-opt verify ARTIFACT --public-key PUB.pem`, or give
    --public-key to run, bench and compare."""
    try:
        from accel_opt import runtime
        from accel_opt.artifact.signing import TrustPolicy, sign_folder
        from accel_opt.errors import InputRejected

        # Its hashes, whatever it holds: signing unsigned native code is how a folder comes to be trusted.
        altered = [p for p in runtime.check(artifact, trust=TrustPolicy(trust_unsigned=True)) if p.exit_code == 3]
        if altered:
            raise InputRejected(f"{artifact}: not signed: {altered[0].line}")
        signature = sign_folder(artifact, private_key, signing_certificate, certificate_chain)
        manifest = runtime.read_manifest(artifact)
    except (AccelOptError, Exception) as exc:  # noqa: BLE001 - every error maps to an exit code
        fail(exc, False, False)
        return
    by = f"the certificate {signing_certificate.name}" if signing_certificate else f"the key {private_key.name}"
    click.echo(f"signed: {signature}: {len(manifest.artifacts) + 1} files (manifest.json included) signed with {by}, "
               f"certified as they are now (build --sign-key signs as built); "
               f"verdict: {manifest.verdict.line()}")
    sys.exit(0)
