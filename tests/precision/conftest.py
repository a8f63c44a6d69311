"""The small mobile block AdaRound and the bias fit are both tested on, and what their tests share."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from accel_opt.machine.cpu import CpuProfile

from ..conftest import make_model, save

CPU = CpuProfile.of_class("avx2")  # 7-bit weights for ORT's preset: coarser steps, so the rounding matters more
CHANNELS = 16


def mobile_block(path: Path) -> Path:
    """A MobileNet-like block: conv 3->16 with asymmetric pads, Clip(0, 6) (ReLU6), depthwise 3x3, ReLU6, 1x1
    projection, global pool, Gemm 16->10."""
    rng = np.random.default_rng(0)
    weights = {"w1": rng.normal(0, 0.4, (CHANNELS, 3, 3, 3)), "b1": rng.normal(0, 0.1, CHANNELS),
               "w2": rng.normal(0, 0.5, (CHANNELS, 1, 3, 3)), "b2": rng.normal(0, 0.1, CHANNELS),
               "w3": rng.normal(0, 0.3, (CHANNELS, CHANNELS, 1, 1)), "b3": rng.normal(0, 0.1, CHANNELS),
               "w4": rng.normal(0, 0.5, (10, CHANNELS)), "b4": np.zeros(10), "low": np.array(0.0),
               "high": np.array(6.0)}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h1"], name="stem", pads=[0, 0, 1, 1], strides=[2, 2]),
             helper.make_node("Clip", ["h1", "low", "high"], ["r1"], name="relu6_1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["h2"], name="depthwise", group=CHANNELS, pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["h2", "low", "high"], ["r2"], name="relu6_2"),
             helper.make_node("Conv", ["r2", "w3", "b3"], ["h3"], name="project"),
             helper.make_node("GlobalAveragePool", ["h3"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "w4", "b4"], ["y"], name="fc", transB=1)]
    inits = [numpy_helper.from_array(np.asarray(a, np.float32), n) for n, a in weights.items()]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])], inits)
    return save(model, path)


def weights_of(path: Path) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}


@pytest.fixture(scope="module")
def block(tmp_path_factory):
    """(the block, 32 calibration samples, 32 held out)."""
    folder = tmp_path_factory.mktemp("mobile-block")
    rng = np.random.default_rng(1)
    samples = [{"x": rng.uniform(-1, 1, (1, 3, 16, 16)).astype(np.float32)} for _ in range(64)]
    return mobile_block(folder / "block.onnx"), samples[:32], samples[32:]
