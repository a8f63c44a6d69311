"""What a torch build's package is and needs: the precision plan the compile applies to the module, the runner over
an AOTInductor package (model.pt2), the package's recorded metadata and the environment it is tied to (checked
before it runs). The backend that makes packages is backend.py."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from accel_opt.backends.torch.loader import load_package
from accel_opt.backends.torch.runner import TorchRunner
from accel_opt.errors import Unsupported, first_line
from accel_opt.graph.inspect import TensorSpec
from accel_opt.machine.cpu import CpuProfile
from accel_opt.recipe.types import Precision

log = logging.getLogger(__name__)

PLAN_SUFFIX = ".torch-plan.json"
REDUCED_DTYPES = {Precision.fp16: "float16", Precision.bf16: "bfloat16"}
MAX_BATCH = 4096  # the dynamic batch axis's upper bound in the exported program
TORCHAO_INSTALL = "pip install torchao"
# AOTI_CPU_ISA's words (Inductor's vector ISA names) -> the /proc/cpuinfo flags each needs (its compiler flags).
ISA_FLAGS = {"avx512": {"avx512f", "avx512dq", "avx512vl", "avx512bw"}, "avx2": {"avx2", "fma"},
             "avx512_vnni": {"avx512_vnni"}, "amx_tile": {"amx_tile"}, "asimd": {"asimd"}}


class PrecisionPlan(BaseModel):
    """What the precision stage decided for a torch build: written beside the work, read by compile()."""

    precision: Precision
    keep_fp32: list[str] = []  # qualified names of submodules kept in float32


def write_plan(path: Path, plan: PrecisionPlan) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(plan.model_dump_json(indent=1))
    return path


def read_plan(path: Path, precision: Precision) -> PrecisionPlan:
    """The plan at `path`, or for any other file (the exported ONNX, as the fp32 baseline passes it) the plain
    transform of `precision` with nothing kept."""
    if path.name.endswith(PLAN_SUFFIX):
        return PrecisionPlan.model_validate_json(path.read_text())
    return PrecisionPlan(precision=precision)


class AotiRunner(TorchRunner):
    """A TorchRunner over an AOTInductor package: loaded with `aoti_load_package` on its recorded device (the
    package's own compiled device checked against it), float32 in and out, timed like every torch runner."""

    def __init__(self, package: Path, inputs: list[TensorSpec], output_names: list[str], **kwargs: Any):
        super().__init__(None, inputs, output_names, **kwargs)
        self.package = Path(package)

    def _load_model(self, torch: Any) -> Any:
        index = torch.device(self.device).index or 0 if self.on_cuda else -1
        try:
            with quiet():
                loaded = load_package(torch, self.package, index)
        except Exception as exc:  # noqa: BLE001 - a package of another torch, or a broken file
            raise Unsupported(f"{self.package.name}: AOTInductor cannot load it here: {first_line(exc)}") from exc
        built_for = str(loaded.get_metadata().get("AOTI_DEVICE_KEY", ""))
        if built_for != ("cuda" if self.on_cuda else "cpu"):
            raise Unsupported(f"{self.package.name} was compiled for {built_for or 'an unknown device'}, the "
                              "deployment "
                              f"runs it on {self.device}")
        return loaded


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """torch's own chatter kept off the job's stderr: deprecation notices (pytree's LeafSpec, ...), warnings of its
    loggers, and the graph torch.export prints when it cannot trace (the error's first line says why; the whole
    text goes to the debug log)."""
    torch_log = logging.getLogger("torch")
    level = torch_log.level
    printed = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch_log.setLevel(logging.ERROR)
        try:
            yield
        finally:
            torch_log.setLevel(level)
            if printed.getvalue():
                log.debug("torch printed: %s", printed.getvalue())


@contextlib.contextmanager
def fp32_is_fp32(torch: Any) -> Iterator[None]:
    """TF32 off while Inductor lowers the program: its matmul and convolution choices read these flags, and TF32
    rounds fp32 operands to a 10-bit mantissa (restored after)."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


def package_metadata(package: Path) -> dict[str, str]:
    """What AOTInductor recorded about the package's target: platform, CPU vector ISA, device, compute capability."""
    with zipfile.ZipFile(package) as archive:
        name = next((n for n in archive.namelist() if n.endswith("_metadata.json")), None)
        if name is None:
            return {}
        return {k: str(v) for k, v in json.loads(archive.read(name)).items()}


def environment_problems(settings: dict[str, Any], cpu: CpuProfile) -> list[str]:
    """Why a package recorded with `settings` cannot run here, on the CPU `cpu`: another torch release, a CPU vector
    ISA this CPU lacks, another GPU compute capability. (Another GPU model of the same capability is re-checked
    instead.)"""
    import torch

    problems = []
    recorded = settings.get("torch_version", "")
    if _major_minor(recorded) != _major_minor(torch.__version__):
        problems.append(f"built and checked with torch {recorded}, this machine has {torch.__version__}: rebuild here")
    aoti = settings.get("aoti", {})
    isa = aoti.get("AOTI_CPU_ISA", "").lower()
    if settings.get("device") == "cpu" and isa:
        missing = [word for word in isa.split() if not ISA_FLAGS.get(word, {word}) <= cpu.flags]
        if missing:
            problems.append(f"model.pt2's C++ kernels use {isa.upper()}, which this CPU lacks ({', '.join(missing)}): "
                            "rebuild here")
    capability = aoti.get("AOTI_COMPUTE_CAPABILITY", "")
    if str(settings.get("device", "")).startswith("cuda") and capability and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(torch.device(settings["device"]))
        if capability.replace(".", "") != f"{major}{minor}":
            problems.append(f"model.pt2 was compiled for compute capability {capability}, this GPU is {major}.{minor}: "
                            "rebuild here")
    return problems


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(re.split(r"[.+]", version)[:2])
