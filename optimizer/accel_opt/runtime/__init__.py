"""The runtime: load a built artifact folder and run it exactly as deployed.

`load(folder)` verifies the folder before anything runs (the manifest present, every file's sha256,
the environment able to run what was checked), then rebuilds the backend's runner from the files on
disk and `resource_config.json`: backend, precision, options, threads, shapes and batch size. The
accuracy gate, the benchmark and the automatic choice all load the folder through here, so what is
checked and timed is what ships. Nothing is deserialized before its hash has been checked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from polygraphy.backend.base import BaseRunner
from pydantic import BaseModel, ValidationError

from accel_opt.artifact.config import RESOURCE_CONFIG, SETTINGS_OF, ResourceConfig
from accel_opt.artifact.folder import MANIFEST, SIGNATURE, Manifest
from accel_opt.artifact.signing import TrustPolicy, native_code_of
from accel_opt.artifact.verified import MAX_MANIFEST_BYTES, PrivateCopy, entry_problems, plain_name, private_copy
from accel_opt.backends import Backend, CompiledModel, get_backend
from accel_opt.backends.base import casting_inputs
from accel_opt.data import DataSummary, Sample, load_samples, synthetic_samples
from accel_opt.errors import InputRejected, NotSignedOff, Unsupported, UsageError, first_line
from accel_opt.files import sha256_file
from accel_opt.graph.inspect import with_batch
from accel_opt.machine.cpu import CpuProfile, available_cpus
from accel_opt.report.verdict import Verdict

if TYPE_CHECKING:
    from accel_opt.artifact.signing import Trust

log = logging.getLogger(__name__)


def verify_files(folder: Path, expected: dict[str, str]) -> list[str]:
    """One line per problem: an entry that is not a regular file (a sub-folder, link, device...), a listed name
    that is not a plain file name, a file missing, changed (sha256) or not part of the artifact. A signature
    (`model.sig`, added after the build and covering the manifest) is the one file no manifest lists."""
    problems = entry_problems(folder)
    problems += [f"{name!r}: listed in the manifest, not a plain file name" for name in sorted(expected)
                 if not plain_name(name)]
    for name, digest in sorted(expected.items()):
        path = folder / name
        if not plain_name(name) or path.is_symlink():
            continue
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif sha256_file(path) != digest:
            problems.append(f"{name}: sha256 does not match the manifest (changed after the build)")
    present = {p.name for p in folder.iterdir() if p.is_file() and not p.is_symlink()
               and p.name not in (MANIFEST, SIGNATURE)}
    problems += [f"{name}: not part of the artifact (not in the manifest)" for name in sorted(present - set(expected))]
    return problems


def artifact_identity(folder: str | Path) -> str:
    """A folder's content identity: the sha256 of its manifest.json, which holds every other file's sha256
    and the build's inputs. The same for every copy of one build; a signature does not change it."""
    return sha256_file(Path(folder) / MANIFEST)


def read_manifest(folder: Path) -> Manifest:
    path = folder / MANIFEST
    if not path.is_file():
        raise InputRejected(f"{folder}: incomplete artifact: no {MANIFEST} (the build did not finish, or this is not "
                            "an artifact)")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise InputRejected(f"{folder}: {MANIFEST} is unreadable: over {MAX_MANIFEST_BYTES >> 20} MiB")
    try:
        return Manifest.model_validate_json(path.read_text())
    except (ValidationError, ValueError, OSError) as exc:
        raise InputRejected(f"{folder}: {MANIFEST} is unreadable: {first_line(exc)}") from None


@dataclass
class Deployment:
    """A verified artifact, ready to run: its config, backend and compiled-model description."""

    folder: Path
    config: ResourceConfig
    backend: Backend
    compiled: CompiledModel
    cpu: CpuProfile  # the CPU it runs on: the class its sign-off is seen from
    staged_files: dict[str, str] | None = None  # name -> sha256 while the build is still staging (no manifest yet)
    # The private copy that was verified, which its bytes are read from (None: read in place, while the build stages
    # it).
    copy: PrivateCopy | None = None
    signature: str = "unsigned"  # its signature state as summaries say it (TrustPolicy.describe)
    trust: TrustPolicy = dataclasses.field(default_factory=TrustPolicy)  # the policy it loaded under
    # Its build's verdict, read from the verified copy's manifest (None while the build stages it: not decided yet).
    verdict: Verdict | None = None
    allow_not_signed_off: bool = False  # the caller allowed a folder that is not signed off (passed on to Ray's actors)
    said_not_signed_off: bool = False  # that warning was logged (once, on the first runner); True keeps it quiet

    @property
    def not_signed_off(self) -> bool:
        """It runs although its build did not sign it off (the caller allowed it): summaries say so."""
        return self.verdict is not None and not self.verdict.signed_off

    @property
    def files(self) -> Path:
        """Where the folder's files are read from: the verified private copy, or the folder while it is staged."""
        return self.copy.path if self.copy is not None else self.folder

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    @property
    def identity(self) -> str:
        """`artifact_identity` of the folder; while staging, the sha256 of its files' hashes instead."""
        if self.staged_files is not None:
            return hashlib.sha256(json.dumps(self.staged_files, sort_keys=True).encode()).hexdigest()
        return artifact_identity(self.files)

    @property
    def batch_axes(self) -> dict[str, int | None]:
        return self.config.batch_axes

    def scope(self):
        """Where the sign-off holds, seen from this machine (runtime.probe.Scope)."""
        return sign_off_scope(self.files, self.cpu, self.config)

    def describe(self, folder_name: str | None = None) -> str:
        """What runs, in one line: the folder (by `folder_name` while it is still staged) and its files."""
        files = ", ".join([self.config.model_file, *[f for f in self.config.extra_files if not f.endswith(".json")]])
        return (f"{folder_name or self.folder.name}/ ({files}), {self.config.backend} {self.config.precision.value}, "
                f"batch {self.batch_size}")

    @cached_property
    def text_encoder(self):
        """The folder's tokenizer with its text stage (preprocess.text.TextEncoder); None for other inputs."""
        if self.config.text is None:
            return None
        from accel_opt.preprocess.text import TOKENIZER_FILE, TextEncoder

        return TextEncoder(self.files / TOKENIZER_FILE, self.config.text, {i.name: i.dtype for i in self.config.inputs})

    @property
    def padding(self):
        """Text inputs: how texts of several lengths share a batch (preprocess.text.Padding); else None."""
        if self.text_encoder is None:
            return None
        # Length buckets bound the shapes of a backend that compiles per shape (OpenVINO static); elsewhere they
        # would only add padding.
        static = self.config.settings.get("shape_mode") == "static"
        return dataclasses.replace(self.text_encoder.padding, dynamic=self.config.batch_dynamic,
                                   buckets=self.text_encoder.padding.buckets if static else ())

    def samples(self, data_dir: str | Path | None, synthetic_count: int, seed: int) -> tuple[list[Sample], DataSummary]:
        """Inputs as this deployment takes them: read from `data_dir` with its recorded preprocessing (the
        host part, when the rest is fused into the model) or tokenizer, else seeded synthetic ones of one row each."""
        config = self.config
        if data_dir is not None:
            samples, summary = load_samples(data_dir, config.inputs, config.preprocessing.host_part()
                                            if config.preprocessing else None, text=self.text_encoder)
            if self.padding is not None:  # texts padded to one length: feeds any batching can take
                samples = self.padding.same_length(samples)
            return samples, summary
        if config.preprocessing is not None and config.preprocessing.fused:
            raise UsageError(f"{self.folder.name} takes decoded image crops (fused preprocessing): give --data with "
                             "images")
        shapes = with_batch(config.shapes, 1, config.batch_axes) if config.batch_dynamic else config.shapes
        bounds = {}
        if _reads_onnx(config):
            import onnx

            from accel_opt.graph.inspect import index_bounds

            bounds = index_bounds(onnx.load(str(self.files / config.model_file), load_external_data=False))
        return synthetic_samples(config.inputs, shapes, synthetic_count, seed, bounds)

    def runner(self, feed_dtypes: dict[str, Any] | None = None) -> BaseRunner:
        """A Polygraphy runner of the deployed model; inputs fed in other dtypes than it deploys
        (float16 I/O builds) are cast inside each call, as an application would have to."""
        if self.not_signed_off and not self.said_not_signed_off:  # allowed by the caller: said wherever it runs
            log.warning("running %s, which is %s (allow_not_signed_off)", self.folder, self.verdict.line())
            self.said_not_signed_off = True
        runner = self.backend.runner(self.compiled)
        runner.keep_alive = self.copy  # the files it loads stay while it lives, whoever drops the Deployment
        deployed = {i.name: i.dtype for i in self.config.inputs}
        return casting_inputs(runner, feed_dtypes or deployed, deployed)



def load(folder: str | Path, trust: TrustPolicy | None = None, threads: int | None = None,
         cpu: CpuProfile | None = None,
         *, public_key: str | Path | None = None, certificate_chain: tuple[str | Path, ...] = (),
         trust_unsigned: bool = False, allow_not_signed_off: bool = False) -> Deployment:
    """Verify `folder` and return its Deployment. Refuses (one line) an incomplete, changed or untrusted folder
    (exit 3), one this machine cannot run as it was checked (exit 4), and one its build did not sign off
    (NotSignedOff with the verdict's exit code: 1, 6 or 7) unless `allow_not_signed_off`: the door every command,
    the Python API and Ray's actors go through. The verdict is read from the verified private copy's manifest, before
    any model is loaded; `Deployment.verdict` holds it.

    Trust, the one policy of the CLI and the Ray APIs (artifact.signing.TrustPolicy): with `public_key` or
    `certificate_chain`, else the key ACCEL_OPT_PUBLIC_KEY names, the folder must carry a signature by it (exit 3 when
    unsigned or forged). Without a key, a folder holding native code (a torch package, a TensorRT plan or engine
    cache) is refused (exit 3) unless `trust_unsigned`; ONNX and OpenVINO folders load, "unsigned". `trust` passes a
    policy already built. Every file is copied into a private folder first, and verified and loaded from that copy.

    `threads` replaces the recorded compute threads (a Ray actor gets the CPUs it was scheduled with:
    ONNX Runtime's default pool would take every core of the node). `cpu`: this machine's CPU profile (read here by
    default), which the sign-off's scope and the backend's native-precision checks are judged on.
    """
    folder = Path(folder)
    policy = trust or TrustPolicy.of(public_key, certificate_chain, trust_unsigned)
    if not folder.is_dir():
        raise InputRejected(f"{folder}: artifact folder not found")
    return _load(folder, private_copy(folder), None, policy, threads, cpu or CpuProfile.here(), allow_not_signed_off)


def load_staged(staging: Path, staged_files: dict[str, str], cpu: CpuProfile) -> Deployment:
    """The folder this build process is staging (its own files, in the build folder it holds locked: read in place,
    no manifest yet, `staged_files` (name -> sha256) standing in for it, no verdict yet). Not an API for folders
    from anywhere else: `load` is, and it copies, checks the signature and enforces the verdict."""
    return _load(Path(staging), None, staged_files, TrustPolicy(trust_unsigned=True), None, cpu, True)


def _load(folder: Path, copy: PrivateCopy | None, expected_files: dict[str, str] | None, policy: TrustPolicy,
          threads: int | None, cpu: CpuProfile, allow_not_signed_off: bool) -> Deployment:
    files = copy.path if copy is not None else folder
    try:
        problems = check(files, expected_files, policy, cpu)
        if problems:
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            first = problems[0]
            raise (InputRejected if first.exit_code == 3 else Unsupported)(f"{folder}: {first.line}{more}")
        verdict = None if expected_files is not None else read_manifest(files).verdict
        if verdict is not None and not verdict.signed_off and not allow_not_signed_off:
            raise NotSignedOff(f"{folder} is {verdict.line()}; to run it anyway, allow it explicitly "
                               "(--allow-not-signed-off; runtime.load(..., allow_not_signed_off=True))",
                               verdict.exit_code)
        config = ResourceConfig.model_validate_json((files / RESOURCE_CONFIG).read_text())
    except BaseException:
        if copy is not None:
            copy.remove()
        raise
    # Never more compute threads than this process may use (a folder built on a larger machine, or forged): more
    # would only oversubscribe the CPUs. The count is bounded before this (artifact.config.MAX_THREADS).
    threads = min(threads or config.threads, available_cpus())
    settings = config.settings
    if "compile_config" in settings:  # OpenVINO compiles (and imports) with its own count
        settings = {**settings, "compile_config": {**settings["compile_config"], "INFERENCE_NUM_THREADS": str(threads)}}
    if "engine_host_code_allowed" in settings:  # the recipe's opt-in holds only for a signed folder (or our own build)
        settings = {**settings, "engine_host_code_allowed": bool(settings["engine_host_code_allowed"])
                    and (policy.key is not None or expected_files is not None)}
    compiled = CompiledModel(
        backend=config.backend, path=files / config.model_file, precision=config.precision, device=config.device,
        providers=config.providers, threads=threads, build_seconds=0.0, settings=settings,
        extra_files=[files / name for name in config.extra_files], keep_alive=copy,
    )
    return Deployment(folder=folder, config=config, backend=_backend_of(config, cpu), compiled=compiled, cpu=cpu,
                      staged_files=expected_files, copy=copy, trust=policy,
                      signature=policy.describe(native_code_of(config.backend, config.settings)), verdict=verdict,
                      allow_not_signed_off=allow_not_signed_off)


def machine_class(config: ResourceConfig, cpu: CpuProfile) -> str:
    """The class of this machine whose kernels `config`'s folder runs on: the kernel class of its CPU `cpu` for the
    backend, or for a GPU build the GPU's model and compute capability ("no GPU" without one)."""
    if config.device != "cpu":
        from accel_opt.machine.gpu import gpu_class

        return gpu_class(config.device) or "no GPU"
    return cpu.kernel_class(config.backend)


def sign_off_scope(folder: Path, cpu: CpuProfile, config: ResourceConfig | None = None):
    """Where the sign-off of a verified `folder` holds, seen from this machine (runtime.probe.Scope): the CPU class
    its gate ran against this CPU's, or for a GPU build the GPU model and compute capability against this one's."""
    from accel_opt.runtime.probe import recorded_class, scope

    folder = Path(folder)
    config = config or ResourceConfig.model_validate_json((folder / RESOURCE_CONFIG).read_text())
    manifest = read_manifest(folder)
    built_on = manifest.gpu if config.device != "cpu" else recorded_class(manifest, config.backend)
    return scope(folder, built_on, machine_class(config, cpu), device=config.device)


class Problem(BaseModel):
    line: str  # one line, for a person
    exit_code: int  # 3: the folder is incomplete or altered; 4: this machine cannot run it as it was checked


def check(folder: Path, expected_files: dict[str, str] | None = None, trust: Trust | TrustPolicy | None = None,
          cpu: CpuProfile | None = None) -> list[Problem]:
    """Every reason `folder` must not be run here, on the CPU `cpu` (this machine's, read here, by default),
    altered/incomplete/untrusted ones (exit 3) first; [] when it may. `trust`: a key whose signature the folder must
    carry, or a whole TrustPolicy (which also refuses unsigned native code it does not trust). Nothing in the folder
    is deserialized before its hash has matched."""
    cpu = cpu or CpuProfile.here()
    # No policy given: the strict one, as `load` applies it (native code only signed): a caller that means to accept
    # unsigned native code says so with TrustPolicy(trust_unsigned=True).
    policy = trust if isinstance(trust, TrustPolicy) else TrustPolicy(key=trust)
    if not folder.is_dir():
        return [Problem(line=f"artifact folder not found: {folder}", exit_code=3)]
    if policy.key is not None:  # first: the signature covers the manifest, which is read next
        from accel_opt.artifact.signing import signature_problem

        if line := signature_problem(folder, policy.key):
            return [Problem(line=f"signature check failed: {line}", exit_code=3)]
    try:
        expected = read_manifest(folder).artifacts if expected_files is None else expected_files
    except InputRejected as exc:
        return [Problem(line=str(exc).removeprefix(f"{folder}: "), exit_code=3)]
    problems = [Problem(line=f"artifact altered or incomplete: {p}",
                        exit_code=3) for p in verify_files(folder, expected)]
    if problems:
        return problems
    try:
        config = ResourceConfig.model_validate_json((folder / RESOURCE_CONFIG).read_text())
    except (ValidationError, ValueError, OSError) as exc:
        return [Problem(line=f"{RESOURCE_CONFIG} is unreadable: {first_line(exc)}", exit_code=3)]
    if line := _config_problem(config, expected, policy):
        return [Problem(line=line, exit_code=3)]
    if _reads_onnx(config):  # what loading would refuse, refused here: verify says what run says
        from accel_opt.graph.load import check_model_file

        try:
            check_model_file(folder / config.model_file)
        except (InputRejected, Unsupported) as exc:
            return [Problem(line=f"{config.model_file}: {str(exc).removesuffix(f': {folder / config.model_file}')}",
                            exit_code=exc.exit_code)]
    try:
        _backend_of(config, cpu)
    except Unsupported as exc:
        return [Problem(line=str(exc), exit_code=4)]
    return [Problem(line=line, exit_code=4) for line in _environment_problems(folder, config, cpu)]


def _reads_onnx(config: ResourceConfig) -> bool:
    """Whether the folder's backend parses its model file as ONNX: by the backend, never by the file's suffix (an
    engine node in `model.ONNX` passed a check keyed on ".onnx"). OpenVINO reads its IR (.xml) otherwise."""
    return config.backend == "onnxruntime" or (config.backend == "openvino"
                                               and not config.model_file.lower().endswith(".xml"))


def _config_problem(config: ResourceConfig, listed: dict[str, str], policy: TrustPolicy) -> str | None:
    """What makes a verified folder's config unsafe to load: a file it names that the manifest does not list, native
    code the policy does not trust, or ONNX Runtime provider options beyond the allowlist (library paths)."""
    stray = [name for name in [config.model_file, *config.extra_files] if name not in listed]
    if stray:
        return f"{RESOURCE_CONFIG} names {stray[0]!r}, which is not a file of the artifact (not in the manifest)"
    if refusal := policy.refusal(native_code_of(config.backend, config.settings)):
        return refusal
    try:
        SETTINGS_OF[config.backend].model_validate(config.settings)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(map(str, error["loc"]))
        return f"{RESOURCE_CONFIG}: settings.{where} of a {config.backend} folder: {error['msg']}"
    if config.backend == "onnxruntime":
        from accel_opt.backends.onnxruntime.gpu import provider_option_problem

        return provider_option_problem(config.settings.get("provider_options") or {})
    return None


def _backend_of(config: ResourceConfig, cpu: CpuProfile):
    """The backend as the build ran it (a GPU EP recorded there, or the torch package's device, is required here too).
    """
    return get_backend(config.backend, providers=config.settings.get("providers_requested"),
                       allow_cpu_nodes=config.settings.get("cpu_ep_fallback") == "allowed", device=config.device,
                       cpu=cpu)


def _environment_problems(folder: Path, config: ResourceConfig, cpu: CpuProfile) -> list[str]:
    """The runtime version that was checked must be the one here (major.minor): another one may pick
    other kernels, so the sign-off would not describe what runs. (Another CPU is not refused here: the sign-off's
    CPU class is re-checked on the folder's probe set, runtime.probe.)"""
    if config.backend == "onnxruntime":
        import onnxruntime

        recorded, here = config.settings.get("onnxruntime_version"), onnxruntime.__version__
    elif config.backend == "openvino":
        import openvino

        recorded, here = config.settings.get("openvino_version"), openvino.get_version()
    # a package runs only on the torch release, CPU ISA and GPU capability it was built for
    elif config.backend == "torch":
        from accel_opt.backends.torch.package import environment_problems

        return environment_problems(config.settings, cpu)
    elif config.backend == "tensorrt":  # an engine runs only on the GPU model and TensorRT version that built it
        from accel_opt.backends.tensorrt.backend import here_facts
        from accel_opt.backends.tensorrt.plan import check_engine_compatible

        reason = check_engine_compatible(config.settings, here_facts())
        return [f"{config.model_file}: {reason}"] if reason else []
    else:
        return []
    problems = []
    if recorded and _major_minor(recorded) != _major_minor(here):
        problems.append(f"built and checked with {config.backend} {recorded}, this machine has {here}: rebuild here")
    # an OpenVINO blob of another CPU: its model.onnx is compiled here (backends.openvino.load_compiled)
    return problems


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("-")[0].split(".")[:2])


def feed_dtypes_of(samples: list[dict[str, np.ndarray]]) -> dict[str, np.dtype]:
    return {name: array.dtype for name, array in samples[0].items()}

