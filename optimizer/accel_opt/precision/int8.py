"""int8 as a graph transform: calibrated QuantizeLinear/DequantizeLinear pairs (static PTQ, QDQ format).

One Q/DQ graph serves ONNX Runtime, OpenVINO (reads Q/DQ ONNX as int8) and TensorRT (explicit
quantization), but the integer types must suit the target's kernels: hence per-target presets.
ONNX Runtime's quantize_static is wrapped once, in `_quantize_with_ranges`; its string-keyed
options never leave that function.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from accel_opt.data import Sample
from accel_opt.errors import InputRejected, Unsupported
from accel_opt.files import copy_file, made_copy, mark_made, sha256_file
from accel_opt.graph.inspect import opset_of
from accel_opt.graph.save import EXTERNAL_DATA_ABOVE_BYTES, external_files, tensor_bytes, upgrade_opset
from accel_opt.machine.cpu import CpuProfile
from accel_opt.precision.calibration import calibration_errors
from accel_opt.precision.finite import refuse_nonfinite_ranges, refuse_nonfinite_weights
from accel_opt.precision.fp16 import validate
from accel_opt.precision.int8_presets import QuantPreset, resolve_preset, weight_range
from accel_opt.precision.remedies import Refining, refine
from accel_opt.precision.report import CalibrationReport, KeptNode, PrecisionReport
from accel_opt.recipe.stages import CalibrationConfig
from accel_opt.recipe.types import CalibrationMethod, Precision

log = logging.getLogger(__name__)

MIN_OPSET = 13  # per-channel DequantizeLinear (`axis`) exists from opset 13; opset 12 gives invalid models
CALIBRATION_CHUNK = 8  # samples per calibrator pass: bounds the memory of histogram calibration
_CACHE_FORMAT = 4  # bump when this module's output for the same inputs changes


@dataclass(frozen=True)
class QuantSettings:
    """Everything that decides the quantized graph besides the model and the samples."""

    preset: QuantPreset
    method: CalibrationMethod
    per_channel: bool
    percentile: float
    num_bins: int
    op_types: tuple[str, ...] | None = None  # None: every op with a Q/DQ kernel in ORT
    reduce_range: bool = False  # 7-bit weights (see weight_range)
    # entropy: bins of the quantized distribution in the KL search (ORT and TensorRT use 128)
    num_quantized_bins: int = 128
    moving_average: bool = False  # minmax: ranges as a moving average of each sample's (ORT's CalibMovingAverage)
    bias_correction: bool = False  # biases absorb the mean shift of their rounded weights (bias_correction.py)
    weight_rounding: str = "nearest"  # or "adaround" (adaround.py)
    adaround_iterations: int = 300
    adaround_time_budget_s: float = 600.0
    bias_fit: bool = False  # every layer's bias fitted together to the outputs (output_fit.py)
    bias_fit_steps: int = 200
    bias_fit_time_budget_s: float = 600.0
    weight_fit: bool = False  # the int8 weights fitted with the biases (output_fit.py)
    weight_fit_steps: int = 600
    weight_fit_time_budget_s: float = 900.0


_FITS = ("bias_fit", "bias_fit_steps", "bias_fit_time_budget_s", "weight_fit", "weight_fit_steps",
         "weight_fit_time_budget_s")
_REFINEMENTS = ("bias_correction", "weight_rounding", "adaround_iterations", "adaround_time_budget_s",
                *_FITS)  # QuantSettings' fields taken as the recipe names them


def quantize(model_path: Path, samples: list[Sample], config: CalibrationConfig, backend_name: str, out_path: Path,
             cache_dir: Path | None, cpu: CpuProfile, exclude: Sequence[str] = ()) -> PrecisionReport:
    """Write the calibrated Q/DQ int8 version of `model_path` to `out_path` (validated), reusing the cache; the weights'
    range suits the int8 kernels of the CPU `cpu` unless the recipe targets another class (weight_range).
    `exclude`: nodes left in float. The pre-processed model and the activation ranges are cached apart
    from the quantized model, so a rebuild with other exclusions does not recalibrate."""
    start = time.perf_counter()
    model_path, out_path = Path(model_path), Path(out_path)
    samples = list(samples[: config.samples])
    if not samples:
        raise InputRejected("int8 calibration needs at least one sample")
    preset = resolve_preset(config.target, backend_name)
    if config.keep_removable_activations:
        preset = dataclasses.replace(preset, keep_removable_activations=True)
    target_cpu, reduce_range, reduce_range_reason = weight_range(preset, config, cpu)
    settings = QuantSettings(preset, config.method, config.per_channel, config.percentile, config.num_bins,
                             tuple(config.op_types) if config.op_types else None, reduce_range,
                             moving_average=config.moving_average,
                             **{name: getattr(config, name) for name in _REFINEMENTS})
    # auto's int8 candidates share ranges
    key, ranges_key, rounding_key = calibration_keys(model_path, samples, settings)
    fit_key = key  # what the bias fit learns on the whole graph serves the builds with layers excluded
    key = key if not exclude else hashlib.sha256(f"{key}|{sorted(exclude)}".encode()).hexdigest()
    opset_before = opset_of(onnx.load(str(model_path), load_external_data=False))
    notes: list[str] = []
    out_path.parent.mkdir(parents=True, exist_ok=True)
    cached = Path(cache_dir) / f"{key}.onnx" if cache_dir is not None else None
    cache_hit = False
    calib_start = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="accel-opt-int8-") as tmp_name:
        tmp = Path(tmp_name)
        if cached is not None and made_copy(cached, out_path):  # only an entry this user's build made
            try:
                validate(out_path, run_session=True, tmp=tmp)
                cache_hit = True
                notes.append(f"calibration cache hit: {cached}")
            except Exception as exc:  # a damaged entry: recalibrate, and overwrite it below
                notes.append(f"calibration cache entry {cached.name} is invalid ({exc}); recalibrated")
        if not cache_hit:
            prepared, ranges, large = _prepared_and_ranges(model_path, samples, settings, tmp, cache_dir,
                                                           ranges_key, notes)
            movers = [name for name, _ in output_movers(prepared)]
            refuse_nonfinite_weights(prepared, set(_op_types(settings)), {*exclude, *movers})  # names the cause first
            refuse_nonfinite_ranges(ranges)
            # Staged under the final name: an external data file keeps the name the model refers to.
            staged = tmp / "staged" / out_path.name
            staged.parent.mkdir()
            overrides = _signed_input_overrides(prepared, ranges) if settings.preset.symmetric_signed_inputs else {}
            _quantize_with_ranges(prepared, ranges, overrides, settings, staged, large, [*exclude, *movers])
            if not large:  # a model beyond protobuf's 2 GB is refined nowhere yet
                notes += refine(Refining(prepared, staged, samples, settings, cache_dir, rounding_key, fit_key,
                                         key if exclude else None))
            validate(staged, run_session=True, tmp=tmp)
            for produced in staged.parent.iterdir():
                shutil.move(str(produced), str(out_path.parent / produced.name))
            if cached is not None and not large:
                copy_file(out_path, cached)
                mark_made(cached)
            elif cached is not None:
                notes.append("not cached: the quantized model keeps its weights in an external data file")
    calib_seconds = time.perf_counter() - calib_start

    kept = [KeptNode(node=name, op_type=op, reason="produces a graph output and only moves or squashes values: "
                     "a Q/DQ pair there would round what the user reads, for no integer kernel")
            for name, op in output_movers(out_path)]
    return PrecisionReport(
        precision=Precision.int8,
        kept_in_higher_precision=kept,
        transform=f"static int8 Q/DQ ({preset.activation_type} activations, {'7-bit ' if reduce_range else ''}"
        f"{preset.weight_type} {'per-channel' if config.per_channel else 'per-tensor'} weights), "
        f"{config.method.value}{' moving-average' if config.moving_average else ''} calibration"
        f"{', Relu/Clip kept explicit' if config.keep_removable_activations else ''}"
        f"{', AdaRound' if settings.weight_rounding == 'adaround' else ''}"
        f"{', biases corrected' if settings.bias_correction else ''}, for {target_cpu} CPUs",
        opset_before=opset_before,
        opset_after=opset_of(onnx.load(str(out_path), load_external_data=False)),
        keep_io_types=True,
        calibration=CalibrationReport(
            method=config.method.value,
            preset=preset.name,
            preset_reason=preset.reason,
            activation_type=preset.activation_type,
            weight_type=preset.weight_type,
            per_channel=config.per_channel,
            symmetric_activations=preset.symmetric_activations,
            sample_count=len(samples),
            target_cpu=target_cpu,
            reduce_range=reduce_range,
            reduce_range_reason=reduce_range_reason,
            seconds=calib_seconds,
            cache_hit=cache_hit,
            cache_key=key,
        ),
        seconds=time.perf_counter() - start,
        notes=notes,
    )


def calibration_keys(model_path: Path, samples: list[Sample], settings: QuantSettings) -> tuple[str, str, str]:
    """(the quantized graph's key, the activation ranges' key, AdaRound's rounding's key): content hashes of (model
    bytes + external data, sample bytes, settings, tool versions), the model and samples hashed once. The ranges' key
    takes only the settings the calibrator reads: ONNX Runtime's and OpenVINO's presets make different graphs from the
    same ranges. The rounding's leaves bias correction and the fits out: they come after the rounding."""
    import onnxruntime

    content = hashlib.sha256()
    for path in [model_path, *external_files(model_path)]:
        content.update(f"{path.name}|{sha256_file(path)}".encode())
    for sample in samples:
        for name in sorted(sample):
            array = sample[name]
            content.update(f"{name}|{array.dtype.str}|{array.shape}".encode())
            content.update(array.tobytes())
    tools = f"ort={onnxruntime.__version__}|onnx={onnx.__version__}|format={_CACHE_FORMAT}"
    graph = {**dataclasses.asdict(settings), "method": settings.method.value}
    calibrator = {"method": settings.method.value, "symmetric": settings.preset.symmetric_activations,
                  "num_bins": settings.num_bins, "num_quantized_bins": settings.num_quantized_bins,
                  "percentile": settings.percentile, "op_types": _op_types(settings),
                  "moving_average": settings.moving_average}

    def key(fields: dict) -> str:
        digest = content.copy()
        digest.update(f"{sorted(fields.items())}|{tools}".encode())
        return digest.hexdigest()

    after_rounding = dict.fromkeys(("bias_correction", *_FITS))
    return key(graph), key(calibrator), key(graph | after_rounding)


# Ops that move, squash or combine values elementwise: at a graph output their Q/DQ pair rounds what the
# user reads and speeds nothing up (no Conv/MatMul integer kernel gains from it). A YOLO head concatenates box pixels
# (0-1024) and class scores (0-1) into one output:
# one uint8 scale of 1024/255 rounds every score to 0 (measured: recall 0 with cosine 0.998).
OUTPUT_MOVERS = ("Concat", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Split", "Slice", "Gather",
                 "Sigmoid", "Softmax", "Resize", "MaxPool", "AveragePool", "GlobalAveragePool", "Add", "Mul",
                 "Sub", "Div")


def output_movers(model_path: Path) -> list[tuple[str, str]]:
    """(name, op type) of the nodes producing a graph output that are OUTPUT_MOVERS: left in float."""
    graph = onnx.load(str(model_path), load_external_data=False).graph
    outputs = {o.name for o in graph.output}
    return [(n.name, n.op_type) for n in graph.node
            if n.name and n.op_type in OUTPUT_MOVERS and any(o in outputs for o in n.output)]


def _prepared_and_ranges(model_path: Path, samples: list[Sample], settings: QuantSettings, tmp: Path,
                         cache_dir: Path | None, key: str, notes: list[str]) -> tuple[Path, Path, bool]:
    """The pre-processed model and its activation ranges (ORT's calibration-cache file), from the cache
    when an earlier build of the same model, samples and settings left them (a fallback rebuild)."""
    entry = Path(cache_dir) / "ranges" / key if cache_dir is not None else None
    # Read from copies this user's build is proved to have made (files.made_copy), never from the entry in place.
    if entry is not None and made_copy(entry / "ranges.json", tmp / "ranges.json") and \
            made_copy(entry / "prepared.onnx", tmp / "prepared.onnx"):
        notes.append("activation ranges from the cache (calibrated once for this model, samples and method): "
                     f"{entry.name}")
        return tmp / "prepared.onnx", tmp / "ranges.json", tensor_bytes(tmp
                                                                        / "prepared.onnx") > EXTERNAL_DATA_ABOVE_BYTES
    prepared = _prepare(model_path, tmp, notes)
    large = tensor_bytes(prepared) > EXTERNAL_DATA_ABOVE_BYTES
    ranges = _calibrate(prepared, samples, settings, tmp, large)
    if entry is None or large:
        return prepared, ranges, large
    entry.mkdir(parents=True, exist_ok=True)
    for path in (prepared, ranges):  # ranges.json last: an entry without its mark is not reused
        copy_file(path, entry / path.name)
        mark_made(entry / path.name)
    return prepared, ranges, large


@contextlib.contextmanager
def _working_directory(path: Path):
    """contextlib.chdir (3.11+) for Python 3.10."""
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def _prepare(model_path: Path, tmp: Path, notes: list[str]) -> Path:
    """Opset 13+ (per-channel), then ORT's pre-processing (shape inference + graph optimization)."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    source = model_path
    skeleton = onnx.load(str(model_path), load_external_data=False)
    opset = opset_of(skeleton)
    if opset < MIN_OPSET:
        source = upgrade_opset(model_path, MIN_OPSET, tmp / "upgraded.onnx",
                               f"per-channel int8 (model at opset {opset})")
        notes.append(f"opset {opset} -> {MIN_OPSET}: per-channel DequantizeLinear needs opset 13")
    prepared = tmp / "prepared.onnx"
    large = tensor_bytes(source) > EXTERNAL_DATA_ABOVE_BYTES
    # Dynamic height/width make ORT's symbolic shape inference fail ("Incomplete symbolic shape
    # inference"); ONNX shape inference alone is enough for image models.
    skip_symbolic = _dynamic_spatial(skeleton)
    source, prepared = source.resolve(), prepared.resolve()  # before the chdir below: a relative path means here
    for attempt_skip in ([True] if skip_symbolic else [False, True]):
        try:
            # ORT writes sym_shape_infer_temp.onnx (+ a .data file) into the *current* folder when
            # symbolic inference is incomplete: run it from the temporary folder.
            with contextlib.redirect_stdout(io.StringIO()), _working_directory(tmp):
                quant_pre_process(str(source), str(prepared), skip_symbolic_shape=attempt_skip,
                                  save_as_external_data=large, all_tensors_to_one_file=True)
            if attempt_skip and not skip_symbolic:
                notes.append("symbolic shape inference failed; pre-processed with ONNX shape inference only")
            break
        except Exception as exc:
            if attempt_skip:
                raise Unsupported(f"ONNX Runtime's quantization pre-processing failed: {exc}") from None
            log.info("pre-processing with symbolic shapes failed (%s); retrying without", exc)
    return prepared


def _calibrate(model: Path, samples: list[Sample], settings: QuantSettings, tmp: Path, large: bool) -> Path:
    """Activation ranges, computed once, written as ORT's calibration-cache file.

    quantize_static forwards only some calibrator options (CalibPercentile, CalibTensorRangeSymmetric,
    ...) and not the histogram's bin counts, so its entropy calibration runs with 128 bins = 128
    quantized bins, which is the min/max range: a file byte-identical to MinMax (checked with ORT 1.32). So the
    calibrator runs here with every option explicit, and its ranges reach quantize_static through
    its calibration-cache file (which also lets the fallback re-quantize without recalibrating).
    """
    from onnxruntime.quantization.calibrate import create_calibrator, save_tensors_data

    from accel_opt.precision.calibration import SampleReader

    calibrator_options = {
        "symmetric": settings.preset.symmetric_activations,  # percentile: cut both tails unless the target is symmetric
        "moving_average": settings.moving_average,  # False: plain min/max over all samples
        "num_bins": settings.num_bins,
        "num_quantized_bins": settings.num_quantized_bins,
        "percentile": settings.percentile,
    }
    # the collector prints progress
    with contextlib.redirect_stdout(io.StringIO()), calibration_errors(settings.method):
        calibrator = create_calibrator(
            model,
            _op_types(settings),
            augmented_model_path=str(tmp / "augmented.onnx"),
            calibrate_method=_ort_method(settings.method),
            use_external_data_format=large,
            providers=["CPUExecutionProvider"],
            extra_options=calibrator_options,
        )
        for begin in range(0, len(samples), CALIBRATION_CHUNK):
            calibrator.collect_data(SampleReader(samples[begin : begin + CALIBRATION_CHUNK]))
        ranges = calibrator.compute_data()
    del calibrator
    ranges_file = tmp / "ranges.json"
    save_tensors_data(ranges, ranges_file)
    return ranges_file


def _op_types(settings: QuantSettings) -> list[str]:
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    return list(settings.op_types or sorted(set(QLinearOpsRegistry) | set(QDQRegistry)))  # ORT's default set


def _ort_method(method: CalibrationMethod):
    from onnxruntime.quantization import CalibrationMethod as OrtMethod

    return {
        CalibrationMethod.minmax: OrtMethod.MinMax,
        CalibrationMethod.entropy: OrtMethod.Entropy,
        CalibrationMethod.percentile: OrtMethod.Percentile,
    }[method]


def _quantize_with_ranges(
    model: Path, ranges_file: Path, overrides: dict[str, list[dict]], settings: QuantSettings, out: Path, large: bool,
    exclude: Sequence[str] = (),
) -> None:
    """The one call site of ORT's static quantization; all of its string options live here.
    `overrides`: ORT's per-tensor TensorQuantOverrides (see `_signed_input_overrides`)."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    preset = settings.preset
    qtypes = {"uint8": QuantType.QUInt8, "int8": QuantType.QInt8}
    quantize_static(
        str(model),
        str(out),
        calibration_data_reader=None,
        quant_format=QuantFormat.QDQ,
        per_channel=settings.per_channel,
        reduce_range=settings.reduce_range,  # 7-bit weights where the target's kernels saturate (weight_range)
        activation_type=qtypes[preset.activation_type],
        weight_type=qtypes[preset.weight_type],
        calibrate_method=_ort_method(settings.method),
        use_external_data_format=large,
        calibration_cache_path=str(ranges_file),
        op_types_to_quantize=_op_types(settings),
        nodes_to_exclude=list(exclude),
        extra_options={
            "ActivationSymmetric": preset.symmetric_activations,
            "WeightSymmetric": preset.symmetric_weights,
            "QDQKeepRemovableActivations": preset.keep_removable_activations,
            "DedicatedQDQPair": preset.dedicated_qdq_pairs,
            "QuantizeBias": preset.quantize_bias,
            "AddQDQPairToWeight": False,  # int8 weights + DequantizeLinear: 4x smaller than float weights + Q/DQ
            "CalibTensorRangeSymmetric": preset.symmetric_activations,
            "TensorQuantOverrides": overrides,
        },
    )


def _signed_input_overrides(model: Path, ranges_file: Path) -> dict[str, list[dict]]:
    """ORT's per-tensor overrides making graph inputs whose calibrated range goes negative symmetric int8."""
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.calibrate import load_tensors_data

    ranges = load_tensors_data(ranges_file)
    inputs = [i.name for i in onnx.load(str(model), load_external_data=False).graph.input]
    return {name: [{"quant_type": QuantType.QInt8, "symmetric": True}] for name in inputs
            if name in ranges and float(np.min(ranges[name].range_value[0])) < 0}


def _dynamic_spatial(model: onnx.ModelProto) -> bool:
    """True when an image-like input (rank >= 4) has a dynamic dim besides the batch."""
    initializers = {t.name for t in model.graph.initializer}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims = value.type.tensor_type.shape.dim
        if len(dims) >= 4 and any(not d.HasField("dim_value") for d in dims[1:]):
            return True
    return False
