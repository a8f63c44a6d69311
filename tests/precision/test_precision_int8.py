"""Static int8 Q/DQ quantization on a small real ResNet with real photos and real ORT sessions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from accel_opt import zoo
from accel_opt.backends.onnxruntime.backend import CPU_PROVIDER, create_session
from accel_opt.errors import Unsupported
from accel_opt.machine.cpu import CpuProfile
from accel_opt.precision import transform
from accel_opt.precision.int8 import quantize
from accel_opt.precision.int8_presets import OPENVINO, ORT_CPU, TENSORRT, resolve_preset
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.stages import CalibrationConfig
from accel_opt.recipe.types import CalibrationMethod, Precision, QuantTarget

SIZE = 32


# int8 builds here run on this host's real kernels: 7-bit weights (an AVX2 target) compute exactly on every CPU
# class, so what these tests assert holds on each; the class-dependent choice itself is tested in
# tests/builder/test_cpu_profiles.py under every class.
CPU = CpuProfile.of_class("avx2")
@pytest.fixture(scope="module")
def photos() -> list[dict[str, np.ndarray]]:
    return zoo.photo_samples(SIZE)


@pytest.fixture(scope="module")
def calib(photos):
    return photos[:16]


@pytest.fixture(scope="module")
def evaluation(photos) -> np.ndarray:
    return np.concatenate([s["image"] for s in photos[16:48]])


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    # A random head (no head_training): these tests measure quantization error against the
    # float model's own outputs, which needs no class margins.
    model = zoo.resnet(layout=(1, 1), width=8, num_classes=10, image_size=SIZE)
    return zoo.save(model, tmp_path_factory.mktemp("int8") / "resnet.onnx")


def _run(path: Path, images: np.ndarray) -> np.ndarray:
    return create_session(path, [CPU_PROVIDER], threads=1).run(None, {"image": images})[0]


def _run_exact(path: Path, images: np.ndarray) -> np.ndarray:
    """ORT's exact x64 int8 path (u8u8, no int16 pair sums): the graph's own error, whatever this CPU's class. The
    TensorRT preset's signed activations run as u8s8 on ORT's CPU kernels, which saturate on AVX2 (measured
    there: 0.122 relative error) but not on VNNI/AMX or on a GPU."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.x64quantprecision", "1")
    session = ort.InferenceSession(str(path), options, providers=[CPU_PROVIDER])
    return session.run(None, {"image": images})[0]


def _relative_error(candidate: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(candidate - reference) / np.linalg.norm(reference))


def _quantize_ops(path: Path) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    model = onnx.load(str(path))
    return model, {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _activation_scales(path: Path) -> dict[str, float]:
    model, inits = _quantize_ops(path)
    return {n.input[0]: float(inits[n.input[1]]) for n in model.graph.node if n.op_type == "QuantizeLinear"}


def test_calibration_methods_give_different_scales(model_path, calib, evaluation, tmp_path):
    scales, errors = {}, {}
    for method in CalibrationMethod:
        config = CalibrationConfig(method=method, num_bins=256, percentile=99.9, samples=16)
        out = tmp_path / f"{method.value}.onnx"
        report = quantize(model_path, calib, config, "onnxruntime", out, cache_dir=None, cpu=CPU)
        assert report.calibration.method == method.value and report.calibration.sample_count == 16
        scales[method] = _activation_scales(out)
        errors[method] = _relative_error(_run(out, evaluation), _run(model_path, evaluation))
    assert max(errors.values()) < 0.2
    minmax, entropy, percentile = (scales[m] for m in CalibrationMethod)
    assert minmax.keys() == entropy.keys() == percentile.keys()
    names = sorted(minmax)
    for a, b in [(minmax, entropy), (minmax, percentile), (entropy, percentile)]:
        assert not np.allclose([a[n] for n in names], [b[n] for n in names], rtol=1e-3)
    # Percentile clips the tails: its ranges never exceed min/max's, and some are narrower.
    assert all(percentile[n] <= minmax[n] * (1 + 1e-6) for n in names)
    assert any(percentile[n] < minmax[n] * 0.99 for n in names)


def test_ort_cpu_preset_uint8_activations_int8_per_channel_weights(model_path, calib, evaluation, tmp_path):
    out = tmp_path / "ort.onnx"
    report = quantize(model_path, calib, CalibrationConfig(samples=8), "onnxruntime", out, cache_dir=None, cpu=CPU)
    cal = report.calibration
    assert (cal.preset, cal.activation_type, cal.weight_type,
            cal.symmetric_activations) == ("ort_cpu", "uint8", "int8", False)
    assert cal.sample_count == 8 and "uint8" in cal.preset_reason
    model, inits = _quantize_ops(out)
    q_zero_points = {inits[n.input[2]].dtype for n in model.graph.node if n.op_type == "QuantizeLinear"}
    assert q_zero_points == {np.dtype(np.uint8)}
    weight_dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
                 and inits[n.input[0]].ndim == 4]
    assert weight_dq and all(inits[n.input[0]].dtype == np.int8 for n in weight_dq)
    assert all(inits[n.input[1]].size > 1 for n in weight_dq)  # one scale per output channel
    assert _relative_error(_run(out, evaluation), _run(model_path, evaluation)) < 0.1


def test_openvino_preset_quantizes_the_signed_image_input_symmetric_int8(model_path, calib, evaluation, tmp_path):
    out = tmp_path / "ov.onnx"
    report = quantize(model_path, calib, CalibrationConfig(samples=8), "openvino", out, cache_dir=None, cpu=CPU)
    assert report.calibration.preset == "openvino"
    model, inits = _quantize_ops(out)
    zero_points = {n.input[0]: inits[n.input[2]] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    image = zero_points.pop("image")  # normalized pixels go negative: int8 with zero point 0, no compensation
    assert image.dtype == np.int8 and not image.any()
    assert zero_points and {z.dtype for z in zero_points.values()} == {np.dtype(np.uint8)}  # after Relu: uint8
    assert _relative_error(_run(out, evaluation), _run(model_path, evaluation)) < 0.1


def test_tensorrt_preset_is_symmetric_int8_with_float_bias(model_path, calib, evaluation, tmp_path):
    out = tmp_path / "trt.onnx"
    config = CalibrationConfig(target=QuantTarget.tensorrt, samples=8)
    report = quantize(model_path, calib, config, "onnxruntime", out, cache_dir=None, cpu=CPU)
    assert report.calibration.preset == "tensorrt" and report.calibration.symmetric_activations
    model, inits = _quantize_ops(out)
    zero_points = [inits[n.input[2]] for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert {z.dtype for z in zero_points} == {np.dtype(np.int8)}
    assert all(not z.any() for z in zero_points)  # symmetric: every zero point is 0
    assert not any(t.data_type == TensorProto.INT32 for t in model.graph.initializer)  # biases stay float
    assert any(n.op_type == "Relu" for n in model.graph.node)  # kept explicit for TensorRT's fusions
    assert _relative_error(_run_exact(out, evaluation), _run(model_path, evaluation)) < 0.1


def test_auto_target_follows_backend():
    assert resolve_preset(QuantTarget.auto, "onnxruntime") is ORT_CPU
    assert resolve_preset(QuantTarget.auto, "openvino") is OPENVINO
    assert resolve_preset(QuantTarget.auto, "tensorrt") is TENSORRT
    assert resolve_preset(QuantTarget.tensorrt, "onnxruntime") is TENSORRT
    with pytest.raises(Unsupported):
        resolve_preset(QuantTarget.auto, "tflite")


def test_cache_hit_on_second_call_and_key_follows_settings(model_path, calib, tmp_path):
    cache = tmp_path / "cache"
    config = CalibrationConfig(samples=8)
    first = quantize(model_path, calib, config, "onnxruntime", tmp_path / "a.onnx", cache, cpu=CPU)
    second = quantize(model_path, calib, config, "onnxruntime", tmp_path / "b.onnx", cache, cpu=CPU)
    assert not first.calibration.cache_hit and second.calibration.cache_hit
    assert first.calibration.cache_key == second.calibration.cache_key
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    key = first.calibration.cache_key  # each entry with its mark (files.mark_made); no temp files left
    assert sorted(p.name for p in cache.iterdir() if p.is_file()) == [f"{key}.onnx", f"{key}.onnx.made"]
    (ranges,) = (cache / "ranges").iterdir()  # the activation ranges, for fallback rebuilds
    assert sorted(p.name for p in ranges.iterdir()) == ["prepared.onnx", "prepared.onnx.made", "ranges.json",
                                                       "ranges.json.made"]
    other = quantize(model_path, calib, CalibrationConfig(samples=8, per_channel=False), "onnxruntime",
                     tmp_path / "c.onnx", cache, cpu=CPU)
    assert not other.calibration.cache_hit and other.calibration.cache_key != first.calibration.cache_key
    shifted = [{"image": s["image"] + 0.01} for s in calib]
    assert quantize(model_path, shifted, config, "onnxruntime", tmp_path / "d.onnx", cache,
                    cpu=CPU).calibration.cache_key \
        != first.calibration.cache_key


def test_opset12_model_is_upgraded_for_per_channel(model_path, calib, evaluation, tmp_path):
    model = onnx.load(str(model_path))
    model.opset_import[0].version = 12  # every op of the ResNet is unchanged between 12 and 17
    onnx.checker.check_model(model)
    source = tmp_path / "opset12.onnx"
    onnx.save(model, str(source))
    out = tmp_path / "q.onnx"
    report = quantize(source, calib, CalibrationConfig(samples=8, per_channel=True), "onnxruntime", out, None, cpu=CPU)
    assert report.opset_before == 12 and report.opset_after >= 13
    assert any("opset 12 -> 13" in note for note in report.notes)
    quantized = onnx.load(str(out))
    onnx.checker.check_model(quantized, full_check=True)
    assert any(a.name == "axis" for n in quantized.graph.node if n.op_type == "DequantizeLinear" for a in n.attribute)
    assert _relative_error(_run(out, evaluation), _run(model_path, evaluation)) < 0.1


def test_dynamic_height_width_model_quantizes(calib, tmp_path):
    model = zoo.resnet(layout=(1,), width=8, num_classes=10, image_size=SIZE)
    for dim, name in zip(model.graph.input[0].type.tensor_type.shape.dim[2:], ("height", "width"), strict=True):
        dim.dim_param = name
    source = zoo.save(model, tmp_path / "dynamic.onnx")
    out = tmp_path / "q.onnx"
    quantize(source, calib, CalibrationConfig(samples=4), "onnxruntime", out, None, cpu=CPU)
    larger = np.random.default_rng(0).standard_normal((1, 3, 48, 48)).astype(np.float32)
    assert _run(out, larger).shape == (1, 10)


def test_calibrating_on_mis_scaled_data_gives_visibly_larger_error(model_path, calib, evaluation, tmp_path):
    config = CalibrationConfig(samples=16)
    good = tmp_path / "good.onnx"
    broken = tmp_path / "broken.onnx"
    quantize(model_path, calib, config, "onnxruntime", good, None, cpu=CPU)
    # Ranges calibrated on 1000x smaller inputs: real activations clip at the quantization limits.
    quantize(model_path, [{"image": s["image"] * 1e-3} for s in calib], config, "onnxruntime", broken, None, cpu=CPU)
    reference = _run(model_path, evaluation)
    good_error = _relative_error(_run(good, evaluation), reference)
    broken_error = _relative_error(_run(broken, evaluation), reference)
    assert good_error < 0.1
    assert broken_error > 0.5 and broken_error > 5 * good_error


def test_transform_entry_point_dispatches_int8_and_fp16(model_path, calib, tmp_path):
    recipe = Recipe()
    int8 = transform(model_path, Precision.int8, recipe, "onnxruntime", calib, tmp_path / "i.onnx",
                     tmp_path / "c", cpu=CPU)
    assert int8.precision is Precision.int8 and int8.calibration.sample_count == len(calib)
    half = transform(model_path, Precision.fp16, recipe, "onnxruntime", [], tmp_path / "h.onnx", None, cpu=CPU)
    assert half.precision is Precision.fp16 and half.calibration is None


def test_onnx_runtime_and_openvino_presets_share_one_calibration(model_path, calib, tmp_path):
    """The two presets make different graphs from the same activation ranges (OpenVINO's signed input is symmetric
    int8): the second build reads the first one's ranges instead of calibrating again."""
    config = CalibrationConfig(samples=8, method="percentile")
    ort = quantize(model_path, calib, config, "onnxruntime", tmp_path / "ort.onnx", tmp_path / "cache", cpu=CPU)
    ov = quantize(model_path, calib, config, "openvino", tmp_path / "ov.onnx", tmp_path / "cache", cpu=CPU)
    assert ort.calibration.cache_key != ov.calibration.cache_key and not ov.calibration.cache_hit
    assert len(list((tmp_path / "cache" / "ranges").iterdir())) == 1
    assert any(n.startswith("activation ranges from the cache") for n in ov.notes)
    assert (tmp_path / "ort.onnx").read_bytes() != (tmp_path / "ov.onnx").read_bytes()
    symmetric = quantize(model_path, calib, config.model_copy(update={"target": "tensorrt"}), "onnxruntime",
                         tmp_path / "trt.onnx", tmp_path / "cache", cpu=CPU)  # symmetric activations: other ranges
    assert not any(n.startswith("activation ranges from the cache") for n in symmetric.notes)
    assert len(list((tmp_path / "cache" / "ranges").iterdir())) == 2


def test_excluded_nodes_stay_float_and_rebuilds_reuse_the_ranges(model_path, calib, tmp_path):
    """`exclude` leaves those nodes unquantized; a rebuild with other exclusions reuses the cached
    pre-processed model and activation ranges instead of recalibrating."""
    config = CalibrationConfig(samples=16)
    plain = quantize(model_path, calib, config, "onnxruntime", tmp_path / "plain.onnx", tmp_path / "cache", cpu=CPU)
    assert plain.kept_in_higher_precision == [] and not plain.calibration.cache_hit
    convs = [n.name for n in onnx.load(str(tmp_path / "plain.onnx")).graph.node if n.op_type == "Conv"]
    again = quantize(model_path, calib, config, "onnxruntime", tmp_path / "ex.onnx", tmp_path / "cache",
                     exclude=[convs[0]], cpu=CPU)
    assert again.calibration.cache_key != plain.calibration.cache_key
    assert list((tmp_path / "cache" / "ranges").iterdir()), "the ranges were not cached"
    graph = onnx.load(str(tmp_path / "ex.onnx")).graph
    producers = {o: n.op_type for n in graph.node for o in n.output}
    first = next(n for n in graph.node if n.name == convs[0])
    assert producers.get(first.input[1]) != "DequantizeLinear", "the excluded Conv still reads int8 weights"



def test_a_preset_reason_quotes_no_speed_measured_elsewhere():
    """A preset's reason goes into every user's signoff.md: a speed-up measured on another machine ("2.7x fp32
    here") would read as this build's. The build's own benchmark states its speed."""
    import re

    from accel_opt.precision.int8_presets import PRESETS

    for preset in PRESETS.values():
        assert not re.search(r"\d+(\.\d+)?x\b|\bhere\b|\bms\b", preset.reason), preset.reason


def test_onnx_runtimes_other_quantizer_options_change_the_graph_as_named(model_path, calib, evaluation, tmp_path):
    """The rescue search's cheap remedies from ONNX Runtime's quantizer: moving-average ranges (never wider than the
    extremes over all samples, some narrower), Relu kept explicit between Q/DQ pairs, per-tensor weights."""
    def build(name: str, **options) -> Path:
        out = tmp_path / f"{name}.onnx"
        quantize(model_path, calib, CalibrationConfig(samples=16, **options), "onnxruntime", out,
                 cache_dir=None, cpu=CPU)
        assert _relative_error(_run(out, evaluation), _run(model_path, evaluation)) < 0.3
        return out

    plain, averaged = _activation_scales(build("plain")), _activation_scales(build("averaged", moving_average=True))
    assert plain.keys() == averaged.keys()
    assert all(averaged[n] <= plain[n] * (1 + 1e-6)
               for n in plain) and any(averaged[n] < plain[n] * 0.99 for n in plain)
    relus = {str(path): sum(n.op_type == "Relu" for n in onnx.load(str(path)).graph.node)
             for path in (tmp_path / "plain.onnx", build("explicit", keep_removable_activations=True))}
    assert relus[str(tmp_path / "plain.onnx")] == 0 < relus[str(tmp_path / "explicit.onnx")]  # folded vs kept
    model, inits = _quantize_ops(build("per-tensor", per_channel=False))
    assert all(inits[n.input[1]].size == 1 for n in model.graph.node if n.op_type == "DequantizeLinear")
