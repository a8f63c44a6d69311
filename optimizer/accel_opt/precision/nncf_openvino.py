"""int8 by NNCF on the OpenVINO model: the quantizer of `calibration.quantizer: nncf`, and a remedy of the rescue search
of an OpenVINO int8 build.

NNCF places and calibrates its own FakeQuantize nodes on the model OpenVINO converts from the ONNX file, with full
bias correction, and, where asked, SmoothQuant and ChannelAlignment: the algorithms NNCF runs on its OpenVINO backend
only. What it writes is an OpenVINO IR (model.xml + model.bin), and that IR is what ships: the build compiles, judges
and times it like any other model file. No ONNX Q/DQ graph holds the same thing, so this quantizer serves the OpenVINO
backend alone.

The model comes from `ov.convert_model`, not `Core.read_model`: measured on EfficientNet-Lite0 and on the demo's
classifier, NNCF's bias correction (fast or full, even with no threshold) changed no output of a model read by
`read_model` (its Conv biases stay behind an unfolded constant path NNCF does not match).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from accel_opt.data import Sample
from accel_opt.errors import InputRejected, Unsupported, first_line
from accel_opt.files import install_line
from accel_opt.precision.report import CalibrationReport, PrecisionReport
from accel_opt.recipe.stages import CalibrationConfig
from accel_opt.recipe.types import Precision

log = logging.getLogger(__name__)

IR_SUFFIX = ".xml"  # the IR's topology; its weights are the .bin of the same stem
INSTALL = install_line("openvino")


def missing() -> str | None:
    """Why NNCF cannot quantize here (None: it can)."""
    absent = [name for name in ("openvino", "nncf") if importlib.util.find_spec(name) is None]
    return f"needs {' and '.join(absent)}: {INSTALL}" if absent else None


def ir_files(xml_path: Path) -> list[Path]:
    """The files of the IR whose topology is `xml_path`: the .xml and its .bin."""
    return [xml_path, xml_path.with_suffix(".bin")]


def quantize_ir(model_path: Path, samples: list[Sample], config: CalibrationConfig, backend_name: str, out_path: Path,
                exclude: Sequence[str] = ()) -> PrecisionReport:
    """Write NNCF's int8 OpenVINO IR of the ONNX `model_path` to `out_path` (.xml, its .bin beside it), calibrated on
    `samples`, `exclude` (ONNX node names) left in float; compiled and run once on one sample before it is returned."""
    if backend_name != "openvino":
        raise Unsupported(f"calibration.quantizer nncf writes an OpenVINO IR, which only the openvino backend runs "
                          f"(this build's backend: {backend_name}); use quantizer: accel-opt")
    why = missing()
    if why:
        raise Unsupported(f"calibration.quantizer nncf {why}")
    samples = list(samples[: config.samples])
    if not samples:
        raise InputRejected("int8 calibration needs at least one sample")
    import nncf
    import openvino as ov
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, AdvancedSmoothQuantParameters

    started = time.perf_counter()
    model = ov.convert_model(str(model_path))
    ignored = _ov_names(model, exclude)
    options: dict = {"fast_bias_correction": False}  # full bias correction: NNCF's stronger form, OpenVINO only
    advanced: dict = {}
    if config.channel_alignment:
        advanced["disable_channel_alignment"] = False
    if config.smooth_quant:  # NNCF smooths only for its transformer model type; convolutions at its alpha for them
        options["model_type"] = nncf.ModelType.TRANSFORMER
        advanced["smooth_quant_alphas"] = AdvancedSmoothQuantParameters(convolution=0.15, matmul=-1)
    if advanced:
        options["advanced_parameters"] = AdvancedQuantizationParameters(**advanced)
    if ignored:
        options["ignored_scope"] = nncf.IgnoredScope(names=ignored)
    try:
        with _quiet():
            quantized = nncf.quantize(model, nncf.Dataset(samples), subset_size=len(samples),
                                      target_device=nncf.TargetDevice.CPU, **options)
    except Exception as exc:  # NNCF's own failure on this model (3.4.0's ChannelAlignment on Lite0: a KeyError)
        raise Unsupported(f"NNCF {_version('nncf')} failed: {type(exc).__name__}: {first_line(exc)}") from None
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(quantized, str(out_path), compress_to_fp16=False)
    compiled = ov.Core().compile_model(str(out_path), "CPU")
    compiled(samples[0])  # written, compiled and run: a broken IR fails here, not in the search's judge
    algorithms = ["full bias correction", *(["SmoothQuant"] if config.smooth_quant else []),
                  *(["ChannelAlignment"] if config.channel_alignment else [])]
    seconds = time.perf_counter() - started
    return PrecisionReport(
        precision=Precision.int8,
        transform=f"NNCF {_version('nncf')} int8 on the OpenVINO model ({', '.join(algorithms)}), "
                  "shipped as OpenVINO IR",
        opset_before=_opset(model_path), opset_after=0, keep_io_types=True,
        calibration=CalibrationReport(
            method="nncf", preset="nncf-openvino-cpu", preset_reason="NNCF's presets for OpenVINO's CPU plugin",
            activation_type="uint8/int8 (NNCF)", weight_type="int8", per_channel=True, symmetric_activations=True,
            sample_count=len(samples), seconds=seconds, cache_hit=False, cache_key=""),
        seconds=seconds,
        notes=[f"NNCF quantized the OpenVINO model on {len(samples)} samples in {seconds:.1f} s"
               + (f", {len(exclude)} layer(s) left in float" if exclude else "")])


@contextlib.contextmanager
def _quiet():
    """NNCF's progress bars (stdout) and INFO lines (its own handler) silenced: the build prints its own progress."""
    nncf_log = logging.getLogger("nncf")
    level = nncf_log.level
    nncf_log.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        nncf_log.setLevel(level)


def _ov_names(model, onnx_nodes: Sequence[str]) -> list[str]:
    """The OpenVINO operations of the ONNX nodes `onnx_nodes`: OpenVINO's ONNX reader names an op after its node and
    splits a Conv/Gemm with a bias into `NAME/WithoutBiases` (the product) and `NAME` (the bias Add): both."""
    wanted = set(onnx_nodes) | {f"{n}/WithoutBiases" for n in onnx_nodes}
    names = [op.get_friendly_name() for op in model.get_ordered_ops() if op.get_friendly_name() in wanted]
    found = {n.removesuffix("/WithoutBiases") for n in names}
    lost = sorted(set(onnx_nodes) - found)
    if lost:
        raise Unsupported(f"NNCF cannot keep {len(lost)} layer(s) in float: OpenVINO's model has no operation named "
                          f"after them ({', '.join(lost[:3])})")
    return names


def _opset(model_path: Path) -> int:
    import onnx

    from accel_opt.graph.inspect import opset_of

    return opset_of(onnx.load(str(model_path), load_external_data=False))


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)
