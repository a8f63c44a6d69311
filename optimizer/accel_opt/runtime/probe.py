"""The probe set a folder carries so any CPU can re-check its sign-off, and the re-check.

A sign-off is a fact about a folder on a class of CPU: int8, bf16 and even fp32 accumulation run other
kernels on AVX2, AVX-512 VNNI and AMX (ONNX Runtime's MLAS and oneDNN pick them by CPUID at run time). Measured:
the same int8 EfficientNet-Lite0 kept top-1 on 85% of 300 photos on a VNNI/AMX CPU and on 52% on an AVX2 one.
So the build writes a few evaluation inputs as the artifact takes them, the fp32 reference's outputs on them
and the gate's tolerance (`probe.npz`, `probe.json`, both hashed in the manifest), and `recheck` runs the
folder as deployed on them and judges it with the build's own gate. The folder is never modified: a re-check's
verdict is remembered in the user's cache, keyed by the manifest's sha256 and the CPU class.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ValidationError

from accel_opt.artifact.folder import MANIFEST, now_utc, sha256_file, user_cache_dir, write_bytes, write_json
from accel_opt.errors import InputRejected, first_line
from accel_opt.machine.cpu import kernel_class
from accel_opt.recipe import TaskMetric, Tolerance

log = logging.getLogger(__name__)

PROBE_NPZ = "probe.npz"
PROBE_JSON = "probe.json"
PROBE_MAX_BYTES = 4 << 20  # inputs + reference outputs: a re-check takes seconds and the folder stays small
PROBE_MAX_SAMPLES = 32


class ProbeSet(BaseModel):
    """`probe.json`: what `probe.npz` holds and how its samples are judged."""

    format: int = 1
    samples: list[str]  # the evaluation samples' names, in order
    inputs: list[str]  # input names: probe.npz holds in_<sample>_<input>
    outputs: list[str]  # output names: probe.npz holds ref_<sample>_<output>
    tolerance: Tolerance
    task_metrics: list[TaskMetric] = []
    noise_floor: dict[str, float] = {}  # the gate's float32 noise floor per output, as measured at build
    cpu_class: str  # the CPU class whose kernels the build's gate ran (kernel_class)


class Scope(BaseModel):
    """Where a folder's sign-off holds, seen from this machine."""

    built_on: str | None  # the CPU class the gate ran on (None: a folder from before classes were recorded)
    here: str
    remembered: bool | None = None  # the verdict of an earlier re-check of this folder on this class

    @property
    def same_class(self) -> bool:
        return self.built_on == self.here

    def line(self, folder: Path) -> str:
        """One line for a person: whether the sign-off describes the kernels that run here."""
        if self.same_class:
            return f"signed off on this CPU class ({self.here})"
        built = self.built_on or "an unrecorded CPU class"
        if self.remembered is not None:
            verdict = "passed" if self.remembered else "FAILED"
            return f"checked on {built}; re-checked on this CPU class ({self.here}): {verdict}"
        return (f"checked on {built}, this CPU is {self.here}: its kernels differ and were not checked here; "
                f"`accel-opt verify {folder} --accuracy` re-checks it in seconds")


def write_probe(folder: Path, inputs: list[dict[str, np.ndarray]], references: list[dict[str, np.ndarray]],
                names: list[str], tolerance: Tolerance, task_metrics: list, noise_floor: dict[str, float],
                cpu_class: str) -> int:
    """Write the first samples (as many as fit PROBE_MAX_BYTES, at least one) into `folder`; return their count."""
    arrays: dict[str, np.ndarray] = {}
    input_names, output_names = list(inputs[0]), list(references[0])
    taken, total_bytes = 0, 0
    for i, (feed, ref) in enumerate(list(zip(inputs, references))[:PROBE_MAX_SAMPLES]):
        size = sum(np.asarray(a).nbytes for a in [*feed.values(), *ref.values()])
        if taken and total_bytes + size > PROBE_MAX_BYTES:
            break
        arrays.update({f"in_{i}_{j}": np.asarray(feed[n]) for j, n in enumerate(input_names)})
        arrays.update({f"ref_{i}_{j}": np.asarray(ref[n]) for j, n in enumerate(output_names)})
        taken, total_bytes = taken + 1, total_bytes + size
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_bytes(folder / PROBE_NPZ, buffer.getvalue())
    write_json(folder / PROBE_JSON, ProbeSet(
        samples=names[:taken], inputs=input_names, outputs=output_names, tolerance=tolerance,
        task_metrics=task_metrics, noise_floor=noise_floor, cpu_class=cpu_class))
    return taken


def read_probe(folder: Path) -> tuple[ProbeSet, list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    """The probe set of a verified folder: (description, inputs, reference outputs). No pickles are loaded."""
    try:
        probe = ProbeSet.model_validate_json((folder / PROBE_JSON).read_text())
    except FileNotFoundError:
        raise InputRejected(f"{folder}: no {PROBE_JSON}: the folder predates probe sets; rebuild it to re-check it") from None
    except (ValidationError, ValueError, OSError) as exc:
        raise InputRejected(f"{folder}: {PROBE_JSON} is unreadable: {first_line(exc)}") from None
    try:
        with np.load(folder / PROBE_NPZ, allow_pickle=False) as npz:
            count = len(probe.samples)
            inputs = [{n: npz[f"in_{i}_{j}"] for j, n in enumerate(probe.inputs)} for i in range(count)]
            refs = [{n: npz[f"ref_{i}_{j}"] for j, n in enumerate(probe.outputs)} for i in range(count)]
    except (OSError, KeyError, ValueError) as exc:
        raise InputRejected(f"{folder}: {PROBE_NPZ} is unreadable: {first_line(exc)}") from None
    return probe, inputs, refs


def scope(folder: Path, backend: str, built_on: str | None) -> Scope:
    """This folder's sign-off seen from here, with a remembered re-check verdict when there is one."""
    here = kernel_class(backend)
    result = Scope(built_on=built_on, here=here)
    if not result.same_class:
        result.remembered = _remembered(folder, here)
    return result


def recheck(deployment):
    """Run `deployment` (a verified runtime.Deployment) on its probe set here and judge it with the build's gate;
    the verdict is remembered for this folder and CPU class. Returns the AccuracyReport."""
    from accel_opt.accuracy import judge, run_candidate

    probe, inputs, refs = read_probe(deployment.folder)
    runner = deployment.runner({name: array.dtype for name, array in inputs[0].items()})
    with runner:
        outs, evaluation = run_candidate(runner, inputs, refs, deployment.batch_size, deployment.batch_axes)
    here = kernel_class(deployment.config.backend)
    report = judge(refs, outs, probe.samples, probe.tolerance, probe.task_metrics,
                   f"reference-fp32 (recorded on {probe.cpu_class})", f"{runner.name} on {here}", evaluation,
                   probe.noise_floor)
    _remember(deployment.folder, here, report.passed)
    return report


def _record_path(folder: Path, cpu: str) -> Path:
    return user_cache_dir("rechecks") / f"{sha256_file(folder / MANIFEST)[:32]}-{cpu}.json"


def _remember(folder: Path, cpu: str, passed: bool) -> None:
    try:
        path = _record_path(folder, cpu)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"folder": str(folder), "cpu_class": cpu, "passed": passed,
                                    "checked_utc": now_utc()})
    except OSError as exc:  # a read-only home: the re-check still answered, it is just not remembered
        log.warning("could not remember the re-check of %s: %s", folder, exc)


def _remembered(folder: Path, cpu: str) -> bool | None:
    try:
        return bool(json.loads(_record_path(folder, cpu).read_text())["passed"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def signed_off_here(deployment, recheck_allowed: bool = True) -> str | None:
    """Make sure the sign-off of `deployment` holds for this CPU's kernels before it runs: on another CPU class
    re-check it (once; the verdict is remembered) unless `recheck_allowed` is False. Returns a line to tell the
    user (None when there is nothing to say); raises GateFailed (exit 1) when the re-check fails."""
    from accel_opt.errors import GateFailed

    where = deployment.scope()
    if where.same_class:
        return None
    folder = deployment.folder
    if not recheck_allowed:
        return f"{folder}: {where.line(folder)} (--no-recheck)"
    if where.remembered is None:
        report = recheck(deployment)
        where.remembered = report.passed
        if not report.passed:
            raise GateFailed(f"{folder}: checked on {where.built_on}, re-checked on this CPU class ({where.here}) on "
                             f"{report.sample_count} probe samples and FAILED: {report.failures[0]}")
    elif not where.remembered:
        raise GateFailed(f"{folder}: {where.line(folder)}; `accel-opt verify {folder} --accuracy` says why")
    return f"{folder}: {where.line(folder)}"
