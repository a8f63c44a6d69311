"""OpenVINO vs ONNX Runtime on the CPU, ResNet-50 layout: latency, accuracy, fraction of the GEMM ceiling.

Variants: ORT fp32 (default session), OpenVINO fp32 (f32 hint), OpenVINO bf16, OpenVINO reading the
ORT Q/DQ int8 model (static shapes, as the pipeline builds by default, and with a dynamic batch, as
`dynamic_shapes: true` builds), OpenVINO with NNCF int8 (the best peer), and the artifact
`accel-opt build --backend auto --precision auto` signs off. Blocks are interleaved in rounds; each waits
for idle CPUs (/proc/stat) and for a quiet host (a short int8 probe, see ContentionGate: this host
switches between a quiet and a contended state that /proc/stat cannot see). Medians over quiet blocks
and over all blocks are both printed. Run: python -m benchmarks.openvino_speed [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from accel_opt import zoo
from accel_opt.backends.onnxruntime.backend import OnnxRuntimeBackend
from accel_opt.backends.openvino.backend import OpenVinoBackend
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.stages import BenchmarkConfig
from accel_opt.recipe.types import Precision
from benchmarks._common import ContentionGate, wait_for_idle

SIZE = 224


def flops_per_image(model: onnx.ModelProto) -> float:
    """2 x multiply-accumulates of Conv and Gemm/MatMul nodes at batch 1."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1
    inferred = onnx.shape_inference.infer_shapes(probe)
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in inferred.graph.value_info}
    shapes.update({v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in inferred.graph.output})
    weights = {t.name: list(t.dims) for t in model.graph.initializer}
    total = 0.0
    for node in model.graph.node:
        if node.op_type == "Conv":
            c_out, c_in, kh, kw = weights[node.input[1]]
            total += 2.0 * c_in * kh * kw * np.prod(shapes[node.output[0]])
        elif node.op_type in ("Gemm", "MatMul"):
            total += 2.0 * np.prod(weights[node.input[1]])
    return total


# --- GEMM ceilings --------------------------------------------------------------------------------


def _best_seconds(call: Callable[[], object], reps: int, gate: ContentionGate) -> float:
    call()
    times = []
    for _ in range(reps):
        wait_for_idle()
        gate.wait()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def torch_gemm_tflops(n: int, dtype: str, threads: int, reps: int, gate: ContentionGate) -> float:
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(n, n).to(getattr(torch, dtype))
    b = torch.randn(n, n).to(getattr(torch, dtype))
    return 2 * n**3 / _best_seconds(lambda: torch.mm(a, b), reps, gate) / 1e12


def matmul_chain(n: int, layers: int, int8: bool) -> onnx.ModelProto:
    """`layers` chained n x n GEMMs sharing one weight; with int8, Q/DQ u8 activations and s8 weights."""
    rng = np.random.default_rng(0)
    weight = rng.normal(0, 1 / np.sqrt(n), (n, n)).astype(np.float32)
    inits, nodes, x = [], [], "x"
    if int8:
        inits += [
            numpy_helper.from_array(np.clip(np.round(weight / 0.002), -127, 127).astype(np.int8), "w_q"),
            numpy_helper.from_array(np.array(0.002, np.float32), "w_s"),
            numpy_helper.from_array(np.array(0, np.int8), "w_z"),
            numpy_helper.from_array(np.array(0.05, np.float32), "a_s"),
            numpy_helper.from_array(np.array(128, np.uint8), "a_z"),
        ]
        nodes.append(helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"]))
    else:
        inits.append(numpy_helper.from_array(weight, "w"))
    for i in range(layers):
        if int8:
            nodes += [
                helper.make_node("QuantizeLinear", [x, "a_s", "a_z"], [f"q{i}"]),
                helper.make_node("DequantizeLinear", [f"q{i}", "a_s", "a_z"], [f"d{i}"]),
            ]
            x = f"d{i}"
        # Gemm with transB keeps the weight in FullyConnected's [N, K] layout: no runtime Transpose.
        nodes.append(helper.make_node("Gemm", [x, "w"], [f"y{i}"], transB=1))
        x = f"y{i}"
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, n])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [n, n])], inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@contextlib.contextmanager
def openvino_chain(n: int, precision: Precision, recipe: Recipe, workdir: Path,
                   layers: int = 4) -> Iterator[Callable[[], object]]:
    """A compiled chain of `layers` n x n GEMMs on OpenVINO, as a call that runs it once."""
    path = zoo.save(matmul_chain(n, layers, precision is Precision.int8), workdir / f"chain-{n}-{precision.value}.onnx")
    backend = OpenVinoBackend()
    feed = {"x": np.random.default_rng(1).normal(size=(n, n)).astype(np.float32)}
    with backend.runner(backend.compile(path, precision, recipe, workdir)) as runner:
        yield lambda: runner.infer(feed, check_inputs=False)


def openvino_gemm_tops(n: int, precision: Precision, recipe: Recipe, workdir: Path, reps: int, gate: ContentionGate,
                       layers: int = 4) -> float:
    with openvino_chain(n, precision, recipe, workdir, layers) as chain:
        seconds = _best_seconds(chain, reps, gate)
    return 2 * n**3 * layers / seconds / 1e12


def ceilings(threads: int, recipe: Recipe, workdir: Path, quick: bool, gate: ContentionGate) -> dict[str, float]:
    """Best measured dense throughput per precision (TFLOP/s or TOPS), 4096^2 GEMMs in quiet moments."""
    n, reps = 4096, 3 if quick else 5
    found: dict[str, list[float]] = {"fp32": [], "bf16": [], "int8": []}
    try:
        found["fp32"].append(torch_gemm_tflops(n, "float32", threads, reps, gate))
        found["bf16"].append(torch_gemm_tflops(n, "bfloat16", threads, reps, gate))
    except ImportError:
        ones = np.ones((n, n), np.float32)
        found["fp32"].append(2 * n**3 / _best_seconds(lambda: ones @ ones, reps, gate) / 1e12)
    found["fp32"].append(openvino_gemm_tops(n, Precision.fp32, recipe, workdir, reps, gate))
    if OpenVinoBackend().supports(Precision.bf16):
        found["bf16"].append(openvino_gemm_tops(n, Precision.bf16, recipe, workdir, reps, gate))
    found["int8"].append(openvino_gemm_tops(n, Precision.int8, recipe, workdir, reps, gate))
    return {k: max(v) for k, v in found.items() if v}


# --- models and variants --------------------------------------------------------------------------


def ort_qdq(fp32_path: Path, calibration: list[dict[str, np.ndarray]], out: Path) -> Path:
    """ORT's int8 Q/DQ: u8 activations, s8 per-channel weights, MinMax calibration."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.samples = iter(calibration)

        def get_next(self):
            return next(self.samples, None)

    quantize_static(
        str(fp32_path), str(out), Reader(), quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8, per_channel=True, calibrate_method=CalibrationMethod.MinMax,
    )
    return out


def nncf_int8(fp32_path: Path, calibration: list[dict[str, np.ndarray]], out: Path) -> Path:
    """NNCF post-training quantization of the OpenVINO model (default preset), saved as IR."""
    import nncf
    import openvino as ov

    model = ov.Core().read_model(str(fp32_path))
    quantized = nncf.quantize(model, nncf.Dataset(calibration, lambda s: s["image"]), subset_size=len(calibration))
    ov.save_model(quantized, str(out), compress_to_fp16=False)
    return out


@dataclass
class Variant:
    label: str
    kind: str  # ceiling key: fp32 / bf16 / int8
    runner_for: Callable[[int], object]  # batch size -> activated runner
    ms: dict[int, float] = field(default_factory=dict)  # median over quiet blocks (all blocks if too few were quiet)
    ms_all: dict[int, float] = field(default_factory=dict)  # median over every block, contended ones included
    quiet: dict[int, str] = field(default_factory=dict)  # "quiet blocks/blocks"
    cosine: float = float("nan")
    feature_cosine: float = float("nan")
    top1: float = float("nan")
    task_accuracy: float = float("nan")


def _runner_for(backend, compiled) -> Callable[[int], object]:
    """Batch size -> activated runner; one runner serves every batch (OpenVINO compiles per shape inside)."""

    def runner_for(_batch: int):
        runner = backend.runner(compiled)
        runner.activate()
        return runner

    return runner_for


def ov_variant(
    label: str, kind: str, path: Path, precision: Precision, recipe: Recipe, workdir: Path, dynamic: bool = False
) -> Variant:
    """Static (default): the runner compiles one model per batch size on first use, during warm-up or the
    accuracy pass. dynamic: one compile with a dynamic batch serves every batch size."""
    backend = OpenVinoBackend()
    compiled = backend.compile(path, precision, recipe.with_overrides(dynamic_shapes=dynamic),
                               workdir / label.replace(" ", "_").replace("/", "_"),
                               shapes={"image": [1, 3, SIZE, SIZE]})

    return Variant(label, kind, _runner_for(backend, compiled))


def ort_variant(path: Path, recipe: Recipe, workdir: Path) -> Variant:
    backend = OnnxRuntimeBackend()
    compiled = backend.compile(path, Precision.fp32, recipe, workdir)

    return Variant("ORT fp32", "fp32", _runner_for(backend, compiled))


def accel_opt_auto_variant(fp32_path: Path, photos: list[dict[str, np.ndarray]], work: Path) -> tuple[Variant, str]:
    """What `accel-opt build --backend auto --precision auto --recipe image-classifier --data DIR` signs
    off on this machine: the winner's folder, loaded through the runtime as deployed."""
    from accel_opt import runtime
    from accel_opt.builder.auto import build_auto
    from accel_opt.recipe.load import load_recipe

    data = work / "photos"
    data.mkdir()
    for i, sample in enumerate(photos):
        np.savez(data / f"photo_{i:03d}.npz", **sample)
    recipe = load_recipe("image-classifier")
    start = time.perf_counter()
    result, selection = build_auto(fp32_path, recipe, "auto", "auto", data, work / "artifacts")
    if result is None:
        raise SystemExit("accel-opt auto signed off no candidate:\n"
                         + "\n".join(c.verdict for c in selection.candidates))
    summary = (f"accel-opt auto ({time.perf_counter() - start:.0f} s, {len(selection.candidates)} candidates): "
               + "; ".join(f"{c.backend}/{c.precision} {c.latency_p50_ms or float('nan'):.1f} ms {c.verdict}"
                           for c in selection.candidates))
    artifact = Path(result.artifact_dir)
    kernels = json.loads((artifact / "resource_config.json").read_text())["settings"].get("kernels_by_layer_type")
    if kernels:
        summary += f"\nauto's compute kernels: {kernels}"
    runner = runtime.load(artifact, allow_not_signed_off=True).runner({"image": np.dtype(np.float32)})

    def runner_for(_batch: int):
        runner.activate()
        return runner

    kind = {"fp32": "fp32", "bf16": "bf16", "int8": "int8", "fp16": "bf16"}[result.precision]
    return Variant(f"accel-opt auto: {result.backend} {result.precision}", kind, runner_for), summary


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def measure_accuracy(
    variants: list[Variant], runners: dict[str, object], evaluation: list[dict[str, np.ndarray]], labels: np.ndarray
) -> None:
    """Cosine (logits and pooled features) and top-1 agreement against ORT fp32, all photos together,
    and task accuracy: the predicted class against the photo each crop came from."""
    outs = {}
    for v in variants:
        per_sample = [list(runners[v.label].infer(s).values()) for s in evaluation]  # [logits, features]
        outs[v.label] = [np.concatenate([o[i] for o in per_sample]) for i in range(2)]
    ref_logits, ref_features = outs[variants[0].label]
    for v in variants:
        logits, features = outs[v.label]
        v.cosine, v.feature_cosine = _cosine(logits, ref_logits), _cosine(features, ref_features)
        v.top1 = float(np.mean(logits.argmax(1) == ref_logits.argmax(1)))
        v.task_accuracy = float(np.mean(logits.argmax(1) == labels))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds and iterations: checks the script works")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    # Batch 8 carries the targets, so it gets more rounds; quiet phases can be rare, so blocks wait long for one.
    rounds, min_block_s, quiet_wait_s = ({8: 2, 1: 1}, 0.1, 2.0) if args.quick else ({8: 6, 1: 3}, 0.5, 25.0)
    recipe = Recipe(benchmark=BenchmarkConfig(threads=args.threads))

    photos, labels = zoo.photo_dataset(SIZE)
    head = zoo.HEAD_TRAINING_COUNT
    model = zoo.resnet(head_training=(photos[:head], labels[:head]))
    # After the head's images: accel-opt's --data (its own calibration/gate split), then the held-out
    # evaluation set. The peers calibrate on the first 64 of accel-opt's data.
    auto_data, evaluation, eval_labels = photos[head:head + 128], photos[head + 128:], labels[head + 128:]
    calibration = auto_data[:64]
    # Pooled features as a second output: a cosine that does not depend on how the synthetic head
    # was fitted (an earlier head amplified noise in near-constant channels: logits cosine 0.2).
    features = next(n for n in model.graph.node if n.op_type == "Flatten").output[0]
    model.graph.output.append(helper.make_tensor_value_info(features, TensorProto.FLOAT, ["batch", 2048]))
    gflop = flops_per_image(model) / 1e9
    with tempfile.TemporaryDirectory(prefix="ov-speed-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        fp32_path = zoo.save(model, work / "resnet50.onnx")
        start = time.perf_counter()
        qdq_path = ort_qdq(fp32_path, calibration, work / "resnet50.qdq.onnx")
        print(f"ORT quantize_static: {time.perf_counter() - start:.1f} s")
        start = time.perf_counter()
        nncf_path = nncf_int8(fp32_path, calibration, work / "resnet50.nncf.xml")
        print(f"NNCF quantize: {time.perf_counter() - start:.1f} s")

        variants = [
            ort_variant(fp32_path, recipe, work / "ort"),
            ov_variant("OV fp32 (f32 hint)", "fp32", fp32_path, Precision.fp32, recipe, work),
        ]
        if OpenVinoBackend().supports(Precision.bf16):
            variants.append(ov_variant("OV bf16", "bf16", fp32_path, Precision.bf16, recipe, work))
        variants += [
            ov_variant("OV int8 (ORT Q/DQ ONNX)", "int8", qdq_path, Precision.int8, recipe, work),
            ov_variant("OV int8 (Q/DQ, dynamic)", "int8", qdq_path, Precision.int8, recipe, work, dynamic=True),
            ov_variant("OV int8 (NNCF)", "int8", nncf_path, Precision.int8, recipe, work),
        ]
        auto_variant, auto_summary = accel_opt_auto_variant(fp32_path, auto_data, work)
        variants.append(auto_variant)
        print(auto_summary)

        # The gate's probe: a ~3 ms int8 GEMM chain on the AMX units that contention slows most.
        gate = ContentionGate(stack.enter_context(openvino_chain(1024, Precision.int8, recipe, work / "probe")))
        deadline = time.monotonic() + (2 if args.quick else 60)
        while time.monotonic() < deadline:  # learn the quiet probe time before the first block waits on it
            gate.sample()
        noise: list[float] = []
        blocks: list[tuple[str, int, float, float, float]] = []  # label, batch, median ms, probe before, after
        for batch in (8, 1):
            runners = {v.label: v.runner_for(batch) for v in variants}
            feed = {"image": np.concatenate([photos[i % len(photos)]["image"] for i in range(batch)])}
            if batch == 1:
                measure_accuracy(variants, runners, evaluation, eval_labels)
            for runner in runners.values():
                for _ in range(2):
                    runner.infer(feed, check_inputs=False)
            for r in range(rounds[batch]):
                for v in variants if r % 2 == 0 else variants[::-1]:  # alternate so drift favours no one
                    noise.append(wait_for_idle())
                    before = gate.wait(timeout_s=quiet_wait_s)
                    times: list[float] = []
                    while len(times) < 3 or sum(times) < min_block_s:
                        start = time.perf_counter()
                        runners[v.label].infer(feed, check_inputs=False)
                        times.append(time.perf_counter() - start)
                    blocks.append((v.label, batch, statistics.median(times) * 1e3, before, gate.sample()))
            for runner in runners.values():
                runner.deactivate()
        summarize_blocks(variants, blocks, gate)

        start = time.perf_counter()
        ceiling = ceilings(args.threads, recipe, work / "gemm", args.quick, gate)
        print(f"GEMM ceilings ({time.perf_counter() - start:.0f} s): "
              + ", ".join(f"{k} {v:.2f} T{'OPS' if k == 'int8' else 'FLOP/s'}" for k, v in ceiling.items()))

    base, base_all = variants[0].ms, variants[0].ms_all
    print(f"\nResNet-50 layout, {gflop:.2f} GFLOP/image, {args.threads} threads, {rounds[8]} interleaved rounds at "
          "batch 8, "
          f"{rounds[1]} at batch 1"
          f"{' (--quick)' if args.quick else ''}; accuracy over {len(evaluation)} held-out photo crops "
          f"(unseen by the head's training, the calibrations and accel-opt's gate)")
    header = (f"{'variant':32} {'b1 ms':>7} {'ratio':>6} {'b8 ms':>7} {'ratio':>6} {'b8 % ceil':>10} {'quiet':>7} "
              f"{'b8 all':>7} {'ratio':>6} {'cos logit':>9} {'cos feat':>9} {'top1':>6} {'task':>6}")
    print(header)
    print("-" * len(header))
    for v in variants:
        achieved = 8 * gflop / (v.ms[8] / 1e3) / 1e3  # TFLOP/s at batch 8
        frac = achieved / ceiling[v.kind] if v.kind in ceiling else float("nan")
        pct = f"{100 * frac:.0f}% {v.kind}" + ("!" if frac > 1 else "")
        print(f"{v.label:32} {v.ms[1]:7.2f} {v.ms[1] / base[1]:6.2f} {v.ms[8]:7.2f} {v.ms[8] / base[8]:6.2f} {pct:>10} "
              f"{v.quiet[8]:>7} {v.ms_all[8]:7.2f} {v.ms_all[8] / base_all[8]:6.2f} "
              f"{v.cosine:9.5f} {v.feature_cosine:9.5f} {v.top1:6.3f} {v.task_accuracy:6.3f}")
    by_label = {v.label: v for v in variants}
    static, dynamic = by_label["OV int8 (ORT Q/DQ ONNX)"], by_label["OV int8 (Q/DQ, dynamic)"]
    print(f"int8 dynamic batch / static shapes: batch 1 {dynamic.ms[1] / static.ms[1]:.3f}, "
          f"batch 8 {dynamic.ms[8] / static.ms[8]:.3f} (>1: static is faster)")
    if any(8 * gflop / (v.ms[8] / 1e3) / 1e3 > ceiling.get(v.kind, float("inf")) for v in variants):
        print("!: above the measured GEMM ceiling, so that ceiling was measured low (noisy CPUs or too few reps)")
    print("ms and ratio: medians over quiet blocks; b8 all: over every block, contended ones included;\n"
          "top1: agreement with ORT fp32's class; task: accuracy against the photo each crop came from")
    auto, nncf = variants[-1], by_label["OV int8 (NNCF)"]
    if auto.kind in ceiling and "fp32" in ceiling:
        # What the hardware allows: the speedup if both ran at the fractions of their ceilings they reach.
        fp32_frac = 8 * gflop / (base[8] / 1e3) / 1e3 / ceiling["fp32"]
        print(f"ceilings this run: {auto.kind} / fp32 = {ceiling[auto.kind] / ceiling['fp32']:.1f}x; with ORT fp32 at "
              f"{fp32_frac:.0%} of its ceiling, 8x needs {auto.kind} at "
              f"{8 * fp32_frac * ceiling['fp32'] / ceiling[auto.kind]:.0%} of its own")
    checks = {
        f"auto at batch 8 >= 8x ORT fp32: {base[8] / auto.ms[8]:.1f}x quiet, {base_all[8] / auto.ms_all[8]:.1f}x all "
        "blocks":
            base[8] / auto.ms[8] >= 8,
        f"auto at batch 8 at least as fast as NNCF int8: {auto.ms[8]:.1f} vs {nncf.ms[8]:.1f} ms quiet, "
        f"{auto.ms_all[8]:.1f} vs {nncf.ms_all[8]:.1f} all blocks": auto.ms[8] <= nncf.ms[8],
        f"auto cosine >= 0.99 ({auto.cosine:.5f})": auto.cosine >= 0.99,
        f"auto top-1 agreement >= 99% ({auto.top1:.1%})": auto.top1 >= 0.99,
    }
    for name, ok in checks.items():
        print(f"  [{'met' if ok else 'NOT MET'}] {name}")
    print(f"\nnoise: CPUs busy before blocks: median {statistics.median(noise):.0%}, max {max(noise):.0%} "
          f"(blocks wait up to 20 s for <15%); a block is quiet when the int8 probe before and after it ran "
          f"within {gate.tolerance:.2f}x of its fastest ({gate.best_s * 1e3:.2f} ms); blocks wait up to "
          f"{quiet_wait_s:.0f} s for that")


def summarize_blocks(variants: list[Variant], blocks: list, gate: ContentionGate) -> None:
    """Per variant and batch: the median over quiet blocks, and over all blocks. Quiet medians are used
    only when every variant has at least two quiet blocks at that batch, so ratios compare like with like."""
    for batch in sorted({b[1] for b in blocks}):
        per_variant = {v.label: [b for b in blocks if b[0] == v.label and b[1] == batch] for v in variants}
        quiet = {label: [ms for _, _, ms, before, after in mine if gate.is_quiet(before, after)]
                 for label, mine in per_variant.items()}
        use_quiet = all(len(q) >= 2 for q in quiet.values())
        for v in variants:
            every = [ms for _, _, ms, _, _ in per_variant[v.label]]
            v.ms_all[batch] = statistics.median(every)
            v.ms[batch] = statistics.median(quiet[v.label]) if use_quiet else v.ms_all[batch]
            v.quiet[batch] = f"{len(quiet[v.label])}/{len(every)}" + ("" if use_quiet else "*")
        if not use_quiet:
            print(f"batch {batch}: too few quiet blocks for some variant; its ms are over all blocks (marked *)")

if __name__ == "__main__":
    main()
