"""Shared fixtures: small real ONNX models and a fast recipe. No mocks: real ORT sessions throughout."""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from accel_opt import zoo
from accel_opt.recipe.load import load_recipe
from accel_opt.recipe.schema import Recipe

# Tests of class-dependent decisions run under each of these CPU classes (an injected CpuProfile): the summary counts
# them per class, so a run on any host shows every class was exercised.
CPU_CLASSES = ("avx2", "avx512", "avx512_vnni", "amx")
_by_class: dict[str, Counter] = {name: Counter() for name in CPU_CLASSES}


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        ids = report.nodeid.rpartition("[")[2].rstrip("]").split("-") if report.nodeid.endswith("]") else []
        for name in set(ids) & set(CPU_CLASSES):
            _by_class[name][report.outcome] += 1


def pytest_terminal_summary(terminalreporter) -> None:
    if any(_by_class.values()):
        counts = "; ".join(f"{name}: " + ", ".join(f"{n} {outcome}" for outcome, n in sorted(_by_class[name].items()))
                           for name in CPU_CLASSES)
        terminalreporter.write_line(f"class-dependent decisions tested under each CPU class (injected) -- {counts}")


@pytest.fixture(autouse=True, scope="session")
def _temporary_files_under_pytest(tmp_path_factory):
    """What accel-opt leaves in the temporary folder on purpose (crash logs, TensorRT build logs: the user reads them)
    goes under pytest's own folder, which pytest prunes, in this process and the CLI runs it starts; Ray keeps the
    system's (its socket paths have a length limit)."""
    saved = {name: os.environ.get(name) for name in ("TMPDIR", "RAY_TMPDIR")}
    os.environ.setdefault("RAY_TMPDIR", tempfile.gettempdir())
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmpdir"))
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    tempfile.tempdir = None


# min_speedup 0: whether a tiny model's int8 build runs faster than its fp32 build depends on the host, and no test's
# outcome may; the benefit rule is tested with injected timings and with a minimum no build reaches (test_verdict.py).
FAST_BENCH = {"warmup_iterations": 1, "min_iterations": 5, "min_seconds": 0.05, "max_iterations": 50,
              "batch_sizes": [1, 2],
              "concurrency": [1], "window_seconds": 0.02, "max_windows": 4, "min_speedup": 0}


@pytest.fixture(scope="session")
def tiny_cnn_path(tmp_path_factory) -> Path:
    """A ResNet-layout classifier small enough to build in about a second: image [batch,3,32,32] -> logits [batch,10].
    """
    path = tmp_path_factory.mktemp("models") / "tiny_cnn.onnx"
    return zoo.save(zoo.resnet(layout=(1, 1), width=8, num_classes=10, image_size=32, seed=0), path)


CLASSIFIER_PRE = {"resize": 36, "crop": 32}  # the `classifier` fixture's preprocessing


@pytest.fixture(scope="session")
def photos(tmp_path_factory) -> Path:
    """12 real JPEGs of different sizes (scikit-image's photos, rotated and scaled)."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("photos")
    for i, photo in enumerate(zoo._skimage_photos()[:6]):
        for j, scale in enumerate((0.5, 0.8)):
            img = Image.fromarray(photo)
            img.resize((int(img.width * scale),
                        int(img.height * scale))).rotate(90 * j, expand=True).save(folder / f"{i:02d}_{j}.jpg")
    return folder


@pytest.fixture(scope="session")
def classifier(tiny_cnn_path, photos, tmp_path_factory) -> Path:
    """The tiny CNN built from the photos with a classifier's preprocessing and top-k postprocess (batch 4).
    Shared: tests that change the folder work on a copy."""
    from accel_opt.builder.pipeline import build

    recipe = load_recipe().with_overrides(benchmark=FAST_BENCH, preprocessing=CLASSIFIER_PRE, postprocess={"topk": 3},
                                          **{"selection.target_batch_size": 4})
    result = build(tiny_cnn_path, recipe, data_dir=photos, out_dir=tmp_path_factory.mktemp("out"))
    assert result.signed_off, result.failures
    return Path(result.artifact_dir)


@pytest.fixture()
def fast_recipe() -> Recipe:
    return load_recipe().model_copy(deep=True).with_overrides(
        benchmark=FAST_BENCH, **{"accuracy.synthetic_samples": 4}
    )


def make_model(nodes, inputs, outputs, initializers=(), opset=17, domains=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


def matmul_model(in_shape=("batch", 4), out_dim: int = 3, seed: int = 0) -> onnx.ModelProto:
    """y = relu(x @ W): a two-node model with one weight, for fast focused tests."""
    w = np.random.default_rng(seed).standard_normal((in_shape[-1], out_dim)).astype(np.float32)
    return make_model(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(in_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*in_shape[:-1], out_dim])],
        [numpy_helper.from_array(w, "W")],
    )


def save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


def outputs_as_written(path: Path, samples) -> np.ndarray:
    """The first output of the model at `path` on each sample, concatenated, with ONNX Runtime's graph optimizations
    off: a Q/DQ graph runs as written (float arithmetic on dequantized values, no integer kernel), so what is
    compared is the graph a transform changed, alike on every CPU class."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, s)[0] for s in samples])


def image_npz_folder(folder: Path, count: int, seed: int = 0, name: str = "image", size: int = 32) -> Path:
    """`count` .npz feed dicts of one random [1, 3, size, size] image each (`s00.npz`, ...)."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        np.savez(folder / f"s{i:02d}.npz", **{name: rng.standard_normal((1, 3, size, size)).astype(np.float32)})
    return folder


def spiky_cnn(seed: int = 0) -> onnx.ModelProto:
    """A CNN that per-tensor int8 breaks: one channel of a middle activation is scaled x2000 and the next
    1x1 Conv scales it back, so the fp32 function is ordinary but that tensor's int8 range rounds the
    other 15 channels to zero. image [batch,3,32,32] -> logits [batch,10]."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def conv(name, x, cin, cout, k=3, weight_scale=None):
        w = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
        if weight_scale is not None:
            w *= weight_scale
        nodes.extend([helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [name], pads=[k // 2] * 4, name=name),
                      helper.make_node("Relu", [name], [f"{name}_r"], name=f"{name}_relu")])
        inits.extend([numpy_helper.from_array(w, f"{name}_w"),
                      numpy_helper.from_array(np.zeros(cout, np.float32), f"{name}_b")])
        return f"{name}_r"

    x = "image"
    for i, cin in enumerate([3, 16, 16, 16]):
        x = conv(f"c{i}", x, cin, 16)
    spike = np.ones((1, 16, 1, 1), np.float32)
    spike[0, 0] = 2000.0
    inits.append(numpy_helper.from_array(spike, "spike_scale"))
    nodes.append(helper.make_node("Mul", [x, "spike_scale"], ["spiky"], name="spike"))
    x = conv("c_after", "spiky", 16, 16, k=1, weight_scale=(1 / spike).reshape(1, 16, 1, 1))
    for i in range(2):
        x = conv(f"d{i}", x, 16, 16)
    inits.append(numpy_helper.from_array((rng.standard_normal((16, 10)) * 0.3).astype(np.float32), "fc_w"))
    nodes += [helper.make_node("GlobalAveragePool", [x], ["gap"], name="gap"),
              helper.make_node("Flatten", ["gap"], ["flat"], name="flat"),
              helper.make_node("MatMul", ["flat", "fc_w"], ["logits"], name="fc")]
    return make_model(nodes, [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, 32, 32])],
                      [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])], inits)


def lonely_qdq_conv(path: Path) -> Path:
    """A Q/DQ Conv with no QuantizeLinear after it: ORT cannot fuse it into QLinearConv and runs it in float."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.integers(-100, 100, (4, 3, 3, 3)).astype(np.int8), "w_q"),
               numpy_helper.from_array(np.array(0.01, np.float32), "scale"),
               numpy_helper.from_array(np.array(0, np.int8), "zero_s8"),
               numpy_helper.from_array(np.array(0, np.uint8), "zero_u8")]
    return save(make_model(
        [helper.make_node("QuantizeLinear", ["x", "scale", "zero_u8"], ["x_q"]),
         helper.make_node("DequantizeLinear", ["x_q", "scale", "zero_u8"], ["x_dq"]),
         helper.make_node("DequantizeLinear", ["w_q", "scale", "zero_s8"], ["w"]),
         helper.make_node("Conv", ["x_dq", "w"], ["y"], name="lonely_conv")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])], weights, opset=17,
    ), path)
