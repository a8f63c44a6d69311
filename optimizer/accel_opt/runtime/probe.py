"""The probe set a folder carries so any machine can re-check its sign-off, and the re-check.

A sign-off is a fact about a folder on a class of machine: int8, bf16 and even fp32 accumulation run other
kernels on AVX2, AVX-512 VNNI and AMX CPUs (ONNX Runtime's MLAS and oneDNN pick them by CPUID at run time), and
on each GPU model. Measured: the same int8 EfficientNet-Lite0 kept top-1 on 85% of 300 photos on a VNNI/AMX CPU
and on 52% on an AVX2 one. So the build writes evaluation inputs as the artifact takes them, the fp32
reference's outputs on them and the gate's tolerance (`probe.npz`, `probe.json`, both hashed in the manifest),
and `recheck` runs the folder as deployed on them and judges it with the build's own gate.

How many: the gate's verdict is per sample (one broken sample fails a build), so a re-check on one or two samples
is not the gate the folder was signed off with. The probe set keeps `accuracy.probe_samples` of the evaluated
samples (16 by default, or every one when the build judged fewer), whatever their size: image inputs are stored
as the uint8 crops they were normalized from (4x smaller, and rebuilt bit for bit by the recorded
preprocessing), and everything is zip-compressed.

The folder is never modified: a re-check's verdict is remembered in the user's cache, keyed by the folder's
identity, the machine class, and every version that changes kernels (runtimes, oneDNN's ISA cap).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ValidationError

from accel_opt.artifact.folder import MANIFEST, Manifest
from accel_opt.errors import InputRejected, first_line
from accel_opt.files import now_utc, sha256_file, tool_versions, user_cache_dir, write_bytes, write_json
from accel_opt.machine.cpu import cpu_class
from accel_opt.preprocess.images import to_model_input
from accel_opt.recipe.deployed import Preprocessing
from accel_opt.recipe.gate import LabelsConfig, TaskMetric, Tolerance

log = logging.getLogger(__name__)

PROBE_NPZ = "probe.npz"
PROBE_JSON = "probe.json"
UINT8_IMAGE = "uint8_image"  # an input stored as the uint8 HWC crops it was normalized from


class ProbeSet(BaseModel):
    """`probe.json`: what `probe.npz` holds and how its samples are judged."""

    format: int = 2
    samples: list[str]  # the evaluation samples' names, in order
    evaluated: int | None = None  # samples the build's gate judged (the probe set is the first `len(samples)`)
    inputs: list[str]  # input names: probe.npz holds in_<sample>_<input>
    input_encoding: dict[str, str] = {}  # input name -> UINT8_IMAGE (rebuilt with `image_preprocessing`)
    image_preprocessing: Preprocessing | None = None
    outputs: list[str]  # output names: probe.npz holds ref_<sample>_<output>
    tolerance: Tolerance
    task_metrics: list[TaskMetric] = []
    noise_floor: dict[str, float] = {}  # the gate's float32 noise floor per output, as measured at build
    cpu_class: str  # the machine class whose kernels the build's gate ran (kernel_class, or the GPU)
    labels: list[int] = []  # each probe sample's class, where the build had labels (--labels)
    labels_config: LabelsConfig | None = None  # and how they gate (accuracy.labels)


class Scope(BaseModel):
    """Where a folder's sign-off holds, seen from this machine."""

    built_on: str | None  # the CPU class (or GPU) the gate ran on; None: unknown
    here: str
    device: str = "cpu"  # "cpu" or "cuda": what kind of machine class the two name
    remembered: bool | None = None  # the verdict of an earlier re-check of this folder on this machine class

    @property
    def same_class(self) -> bool:
        return self.built_on == self.here

    @property
    def what(self) -> str:
        return "CPU class" if self.device == "cpu" else "GPU"

    def line(self, folder: Path) -> str:
        """One line for a person: whether the sign-off describes the kernels that run here."""
        if self.same_class:
            return f"checked on this {self.what} ({self.here})"
        built = self.built_on or f"an unrecorded {self.what}"
        if self.remembered is not None:
            verdict = "passed" if self.remembered else "FAILED"
            return f"checked on {built}; re-checked on this {self.what} ({self.here}): {verdict}"
        return (f"checked on {built}, this {self.what} is {self.here}: its kernels differ and were not checked here; "
                f"`accel-opt verify {folder} --accuracy` re-checks it in seconds")


def probe_count(evaluated: int, wanted: int) -> int:
    """Samples a probe set keeps: `wanted` (the recipe's accuracy.probe_samples), or every evaluated one if fewer."""
    return max(1, min(evaluated, wanted))


def write_probe(folder: Path, inputs: list[dict[str, np.ndarray]], references: list[dict[str, np.ndarray]],
                names: list[str], count: int, tolerance: Tolerance, task_metrics: list, noise_floor: dict[str, float],
                machine_class: str, preprocessing: Preprocessing | None, labels: list[int] | None = None,
                labels_config: LabelsConfig | None = None) -> int:
    """Write the first `count` samples into `folder`, images as their uint8 crops where that rebuilds them exactly,
    with their `labels` where the build had them; return the count written."""
    inputs, references = inputs[:count], references[:count]
    input_names, output_names = list(inputs[0]), list(references[0])
    encoding = {n: UINT8_IMAGE for n in input_names if _crops_rebuild(inputs, n, preprocessing)}
    arrays: dict[str, np.ndarray] = {}
    for i, (feed, ref) in enumerate(zip(inputs, references)):
        for j, n in enumerate(input_names):
            value = np.asarray(feed[n])
            arrays[f"in_{i}_{j}"] = _crops_of(value, preprocessing) if n in encoding else value
        arrays.update({f"ref_{i}_{j}": np.asarray(ref[n]) for j, n in enumerate(output_names)})
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    write_bytes(folder / PROBE_NPZ, buffer.getvalue())
    write_json(folder / PROBE_JSON, ProbeSet(
        samples=names[:len(inputs)], evaluated=len(names), inputs=input_names, input_encoding=encoding,
        image_preprocessing=preprocessing if encoding else None, outputs=output_names, tolerance=tolerance,
        task_metrics=task_metrics, noise_floor=noise_floor, cpu_class=machine_class,
        labels=(labels or [])[:len(inputs)], labels_config=labels_config if labels else None))
    return len(inputs)


def _crops_of(x: np.ndarray, pre: Preprocessing) -> np.ndarray:
    """The uint8 HWC crops a normalized image input was made from (to_model_input inverted, then rounded)."""
    std, mean = np.asarray(pre.std, np.float64), np.asarray(pre.mean, np.float64)
    pixels = x.astype(np.float64).transpose(0, 2, 3, 1) if pre.layout == "NCHW" else x.astype(np.float64)
    return np.clip(np.rint((pixels * std + mean) * 255.0), 0, 255).astype(np.uint8)


def _crops_rebuild(inputs: list[dict[str, np.ndarray]], name: str, pre: Preprocessing | None) -> bool:
    """True when every sample's `name` is a float image that `pre` rebuilds bit for bit from its uint8 crops."""
    if pre is None or pre.dtype == "uint8" or any(np.asarray(s[name]).dtype.kind != "f" for s in inputs):
        return False
    try:
        return all(np.array_equal(to_model_input(_crops_of(np.asarray(s[name]), pre), pre), s[name]) for s in inputs)
    except (ValueError, IndexError):  # not an image of this layout
        return False


def read_probe(folder: Path) -> tuple[ProbeSet, list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    """The probe set of a verified folder: (description, inputs as the artifact takes them, reference outputs).
    No pickles are loaded."""
    try:
        probe = ProbeSet.model_validate_json((folder / PROBE_JSON).read_text())
    except FileNotFoundError:
        raise InputRejected(f"{folder}: no {PROBE_JSON}: the folder predates probe sets and was built on another "
                            "machine class; rebuild it here, or run it with --no-recheck") from None
    except (ValidationError, ValueError, OSError) as exc:
        raise InputRejected(f"{folder}: {PROBE_JSON} is unreadable: {first_line(exc)}") from None
    try:
        with np.load(folder / PROBE_NPZ, allow_pickle=False) as npz:
            count = len(probe.samples)
            inputs = [{n: _decoded(probe, n, npz[f"in_{i}_{j}"]) for j,
                       n in enumerate(probe.inputs)} for i in range(count)]
            refs = [{n: npz[f"ref_{i}_{j}"] for j, n in enumerate(probe.outputs)} for i in range(count)]
    except (OSError, KeyError, ValueError) as exc:
        raise InputRejected(f"{folder}: {PROBE_NPZ} is unreadable: {first_line(exc)}") from None
    return probe, inputs, refs


def _decoded(probe: ProbeSet, name: str, stored: np.ndarray) -> np.ndarray:
    if probe.input_encoding.get(name) == UINT8_IMAGE:
        return to_model_input(stored, probe.image_preprocessing)
    return stored


def recorded_class(manifest: Manifest, backend: str) -> str | None:
    """The CPU class a folder's gate ran on: recorded since classes exist; for an older folder, derived from the CPU
    flags its manifest holds (the same rule, without oneDNN's cap, which older builds did not record)."""
    if manifest.cpu_class:
        return manifest.cpu_class
    flags, machine = manifest.cpu.get("flags"), manifest.cpu.get("machine")
    if not flags or not machine:
        return None
    return cpu_class(frozenset(flags), machine)


def scope(folder: Path, built_on: str | None, here: str, device: str = "cpu") -> Scope:
    """This folder's sign-off seen from here, with a remembered re-check verdict when there is one. `here` is this
    machine's class for `device` (runtime.machine_class)."""
    result = Scope(built_on=built_on, here=here, device="cpu" if device == "cpu" else "cuda")
    if not result.same_class:
        result.remembered = _remembered(folder, here)
    return result


def recheck(deployment):
    """Run `deployment` (a verified runtime.Deployment) on its probe set here and judge it with the build's gate;
    the verdict is remembered for this folder and machine class. Returns the AccuracyReport, whose `sample_count`
    says how many samples were judged."""
    from accel_opt.accuracy import judge, run_candidate
    from accel_opt.accuracy.run import add_labeled_checks

    probe, inputs, refs = read_probe(deployment.files)
    runner = deployment.runner({name: array.dtype for name, array in inputs[0].items()})
    with runner:
        outs, evaluation = run_candidate(runner, inputs, refs, deployment.batch_size, deployment.batch_axes,
                                         deployment.padding)
    here = deployment.scope().here
    report = judge(refs, outs, probe.samples, probe.tolerance, probe.task_metrics,
                   f"reference-fp32 (recorded on {probe.cpu_class})", f"{runner.name} on {here}", evaluation,
                   probe.noise_floor)
    if probe.labels and probe.labels_config is not None:  # observed, like every rate of a re-check
        add_labeled_checks(report, refs, outs, probe.labels, probe.labels_config, bounded=False)
    _remember(deployment.files, here, report.passed)
    return report


def recheck_reach(report, evaluated: int | None) -> list[str]:
    """What a re-check on the probe set can and cannot confirm: it judges the observed rates against the build's
    minimums (a regression shows), but its few samples bound each rate only so far; the sign-off's own bound rests on
    the `evaluated` held-out samples of the build."""
    lines = []
    for check in report.checks:
        if check.labeled is not None:
            lines.append(f"on the probe samples, {check.labeled.line()}")
        ev = check.evidence
        if ev is None:
            continue
        reach = f"{ev.what} >= {ev.lower:.1%} at {ev.confidence:.0%} confidence ({ev.counted()})"
        if ev.minimum < 1.0 and ev.needed and ev.trials < ev.needed:
            reach += (f"; it cannot confirm the minimum {ev.minimum:.1%} alone ({ev.needed} needed)"
                      + (f": that rests on the {evaluated} held-out samples the build judged" if evaluated else ""))
        lines.append(("reported, not gated: " if not check.gated else "") + f"the probe set confirms {reach}")
    return lines


def probe_evaluated(folder: Path) -> int | None:
    """How many samples the build's gate judged, as the probe set records it (None: not recorded)."""
    try:
        return ProbeSet.model_validate_json((folder / PROBE_JSON).read_text()).evaluated
    except (OSError, ValidationError, ValueError):
        return None


def _record_path(folder: Path, machine_class: str) -> Path:
    """Where a verdict is remembered: keyed by everything that picks kernels, not only the class. Another ONNX
    Runtime, OpenVINO or torch patch release, or another oneDNN ISA cap, is another key: re-checked, not trusted."""
    key = json.dumps({"identity": sha256_file(folder / MANIFEST), "class": machine_class, "tools": tool_versions(),
                      "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "")}, sort_keys=True)
    return user_cache_dir("rechecks") / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.json"


def _remember(folder: Path, machine_class: str, passed: bool) -> None:
    try:
        path = _record_path(folder, machine_class)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"folder": str(folder), "class": machine_class, "passed": passed, "checked_utc": now_utc()})
    except OSError as exc:  # a read-only home: the re-check still answered, it is just not remembered
        log.warning("could not remember the re-check of %s: %s", folder, exc)


def _remembered(folder: Path, machine_class: str) -> bool | None:
    try:
        return bool(json.loads(_record_path(folder, machine_class).read_text())["passed"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def signed_off_here(deployment, recheck_allowed: bool = True) -> str | None:
    """Make sure the sign-off of `deployment` holds for this machine's kernels before it runs: on another CPU class
    or GPU re-check it (once; the verdict is remembered) unless `recheck_allowed` is False. Returns a line to tell the
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
            raise GateFailed(f"{folder}: checked on {where.built_on}, re-checked on this {where.what} ({where.here}) "
                             f"on {report.sample_count} probe samples and FAILED: {report.failures[0]}")
    elif not where.remembered:
        raise GateFailed(f"{folder}: {where.line(folder)}; `accel-opt verify {folder} --accuracy` says why")
    return f"{folder}: {where.line(folder)}"
