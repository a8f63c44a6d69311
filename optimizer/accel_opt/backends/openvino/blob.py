"""OpenVINO compiled blobs: saved with what they depend on (OpenVINO version, CPU model and ISA flags, the config),
imported only where those match and the content hash holds; elsewhere the folder's model.onnx is compiled instead."""

from __future__ import annotations

import hashlib
import io
import json
import logging
from pathlib import Path
from typing import Any

from accel_opt.backends.base import CompiledModel
from accel_opt.backends.openvino.compile import (
    DEVICE,
    _compile,
    _core,
    _verify_precision,
    execution_precisions,
    isa_flags,
)
from accel_opt.errors import Unsupported, first_line
from accel_opt.files import write_bytes, write_json
from accel_opt.machine.cpu import CpuProfile

log = logging.getLogger(__name__)

def environment(cpu: CpuProfile) -> dict[str, Any]:
    """What a compiled blob depends on: OpenVINO version, the CPU `cpu` (model name and ISA flags) and oneDNN's ISA cap
    (ONEDNN_MAX_CPU_ISA): a blob compiled for AMX kernels must not be imported where the cap forbids them."""
    import openvino as ov

    return {
        "openvino_version": ov.get_version(),
        "cpu_model": str(_core().get_property(DEVICE, "FULL_DEVICE_NAME")),
        "cpu_isa_flags": isa_flags(cpu.flags),
        "onednn_max_cpu_isa": cpu.onednn_max_cpu_isa,
    }


BLOB_DEPENDS_ON = ("openvino_version", "cpu_model", "cpu_isa_flags", "onednn_max_cpu_isa")


def blob_mismatch(meta: dict[str, Any], cpu: CpuProfile, blob: bytes | None = None) -> str | None:
    """Why a blob recorded with `meta` must not be loaded on the CPU `cpu` (None: it may be). A blob recorded before
    the cap was recorded counts as compiled without one."""
    here = environment(cpu)
    for key in BLOB_DEPENDS_ON:
        if meta.get(key, "" if key == "onednn_max_cpu_isa" else None) != here[key]:
            return f"blob built for {key}={meta.get(key)!r}, this machine has {here[key]!r}"
    if blob is not None and hashlib.sha256(blob).hexdigest() != meta.get("sha256"):
        return "blob content does not match its recorded sha256"
    return None

def load_cached_blob(blob_path: Path, cpu: CpuProfile, meta: dict[str, Any] | None = None):
    """The openvino.CompiledModel in `blob_path`, or None (rebuild) if it was built for another CPU than `cpu` or
    altered."""
    blob_path = Path(blob_path)
    meta_path = blob_path.with_suffix(blob_path.suffix + ".json")
    try:
        meta = json.loads(meta_path.read_text()) if meta is None else meta
        blob = blob_path.read_bytes()
    except (OSError, ValueError):
        return None
    reason = blob_mismatch(meta, cpu, blob)
    if reason:
        log.info("not reusing %s: %s", blob_path, reason)
        return None
    try:  # the import config matters: a blob imported without its hint runs bf16 on AMX CPUs
        compiled = _core().import_model(blob, DEVICE, meta.get("config") or {})
    except Exception as exc:  # OpenVINO refuses blobs of other versions with a RuntimeError
        log.info("not reusing %s: %s", blob_path, first_line(exc))
        return None
    ran = execution_precisions(compiled)
    if ran != meta.get("execution_precision_by_layer_type"):
        log.info("not reusing %s: it runs %s, recorded %s", blob_path, ran,
                 meta.get("execution_precision_by_layer_type"))
        return None
    return compiled

def _save_blob(compiled, blob_path: Path, meta: dict[str, Any]) -> tuple[Path, Path]:
    """Write the exported blob, then its meta (with the blob's sha256); both atomically."""
    blob_path.parent.mkdir(parents=True, exist_ok=True)
    blob = compiled.export_model()
    blob = blob.getvalue() if isinstance(blob, io.BytesIO) else bytes(blob)
    write_bytes(blob_path, blob)
    meta_path = blob_path.with_suffix(".blob.json")
    write_json(meta_path, {**meta, "sha256": hashlib.sha256(blob).hexdigest()})
    return blob_path, meta_path

def load_compiled(compiled: CompiledModel, cpu: CpuProfile):
    """The openvino.CompiledModel in the saved blob, the model that was checked. A blob compiled for another CPU
    (model, ISA flags, or a oneDNN ISA cap here) is not imported: the folder's model.onnx, the graph the blob was
    compiled from, is compiled here with the recorded config instead, and said so; on another CPU class the
    runtime re-checks that build on the folder's probe set before it runs (runtime.probe). Another OpenVINO
    version is refused earlier, by runtime.check."""
    blob = next((p for p in compiled.extra_files if p.suffix == ".blob"), None)
    model = None
    if blob is not None:
        meta_path = blob.with_suffix(blob.suffix + ".json")
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as exc:
            raise Unsupported(f"OpenVINO blob {blob.name} cannot run here: its description {meta_path.name} is "
                              f"unreadable ({exc})") from None
        if hashlib.sha256(blob.read_bytes()).hexdigest() != meta.get("sha256"):  # altered: what was checked is gone
            raise Unsupported(f"OpenVINO blob {blob.name} cannot run here: its content does not match its recorded "
                              "sha256; rebuild the artifact")
        reason = blob_mismatch(meta, cpu)
        threads = compiled.settings.get("compile_config", {}).get("INFERENCE_NUM_THREADS")
        if threads is not None:  # the deployment's thread count (runtime.load may override the build's) wins
            meta = {**meta, "config": {**(meta.get("config") or {}), "INFERENCE_NUM_THREADS": threads}}
        model = load_cached_blob(blob, cpu, meta) if reason is None else None
        if model is None:
            log.warning("OpenVINO blob %s was compiled for other kernels (%s): compiling %s here with its recorded "
                        "config",
                        blob.name, reason or "it does not import as recorded", compiled.path.name)
    if model is None:
        model = _compile(compiled.path, compiled.settings["compile_config"], compiled.settings["static_shapes"])
        _verify_precision(model, compiled.precision)
    return model
