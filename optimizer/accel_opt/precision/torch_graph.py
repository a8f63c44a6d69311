"""An ONNX graph evaluated in PyTorch, node by node, so that a loss on its outputs has gradients: what fitting a Q/DQ
graph's integer weights to the float model's outputs (output_fit.py) trains through.

Written here because no library found runs a QuantizeLinear/DequantizeLinear graph differentiably with its rounding
kept: onnx2torch has no converter for either op (forks that add one skip the rounding, making a float model), and
ONNX Runtime's training API trains float graphs. Rounding passes
its gradient straight through (the straight-through estimator) and saturation stops it, as quantization-aware
training does. Only the operators of convolutional and dense networks are here; any other raises Unsupported, and
the caller checks the torch form against ONNX Runtime's output before trusting it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from accel_opt.errors import Unsupported


def conv_or_gemm(node: onnx.NodeProto, weight_ndim: int, functional) -> Callable | None:
    """fn(x, weight, bias) computing a Conv (explicit pads or none) or Gemm node as ONNX defines it, or None where
    samples stacked along the first axis would not stay apart (a Gemm reading its input transposed)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Gemm":
        if attrs.get("transA", 0):
            return None
        alpha, beta, trans_b = attrs.get("alpha", 1.0), attrs.get("beta", 1.0), attrs.get("transB", 0)
        return lambda x, w, b: alpha * (x @ (w.T if trans_b else w)) + (0 if b is None else beta * b)
    spatial = weight_ndim - 2
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID") or spatial not in (1, 2, 3):
        return None
    pads = list(attrs.get("pads", [0] * 2 * spatial))
    torch_pads = [p for axis in reversed(range(spatial)) for p in (pads[axis], pads[axis + spatial])]  # last axis first
    conv = getattr(functional, f"conv{spatial}d")
    stride, dilation, groups = attrs.get("strides", 1), attrs.get("dilations", 1), attrs.get("group", 1)
    return lambda x, w, b: conv(functional.pad(x, torch_pads) if any(torch_pads) else x, w, b, stride, 0,
                                dilation, groups)


def round_straight_through(x, low: int, high: int):
    """`x` (a torch tensor) rounded and clamped to [low, high], rounding's gradient passed straight through
    (saturation stops it)."""
    return (x + (x.round() - x).detach()).clamp(low, high)


@dataclass
class _Quantized:
    """A per-tensor QuantizeLinear's output, kept as its input until it is read: by its own DequantizeLinear (fused
    into one fake-quantize) or otherwise (its integers, as floats)."""

    x: object
    scale: float
    zero_point: int
    low: int
    high: int

    def integers(self, torch):
        return round_straight_through(self.x / self.scale + self.zero_point, self.low, self.high)


def _integer_range(zero_point: onnx.TensorProto) -> tuple[int, int]:
    info = np.iinfo(helper.tensor_dtype_to_np_dtype(zero_point.data_type))
    return int(info.min), int(info.max)


class TorchGraph:
    """`model`'s graph as a function of torch tensors. `overrides` maps a tensor's name to its value (a trained
    parameter) or a function that gives it at each run; every other initializer is a constant."""

    def __init__(self, model: onnx.ModelProto, overrides: dict[str, object] | None = None):
        import torch
        from torch.nn import functional

        self.torch, self.functional = torch, functional
        self.graph = model.graph
        self.overrides = overrides or {}
        self.constants = {i.name: torch.from_numpy(numpy_helper.to_array(i).copy()) for i in self.graph.initializer}
        self.integer_ranges = {i.name: _integer_range(i) for i in self.graph.initializer
                               if i.data_type in (onnx.TensorProto.UINT8, onnx.TensorProto.INT8,
                                                  onnx.TensorProto.UINT16, onnx.TensorProto.INT16)}
        self.outputs = [o.name for o in self.graph.output]
        unknown = sorted({n.op_type for n in self.graph.node if n.domain not in ("", "ai.onnx")
                          or not hasattr(self, f"_{n.op_type}")})
        if unknown:
            raise Unsupported(f"no differentiable form of {', '.join(unknown)} here")

    def __call__(self, feeds: dict[str, object]) -> list:
        """The graph's outputs for `feeds` (tensors by input name)."""
        trained = {name: value() if callable(value) else value for name, value in self.overrides.items()}
        values = dict(self.constants) | trained | feeds
        for node in self.graph.node:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            inputs = [values[name] if name else None for name in node.input]
            if node.op_type != "DequantizeLinear":
                inputs = [v.integers(self.torch) if isinstance(v, _Quantized) else v for v in inputs]
            produced = getattr(self, f"_{node.op_type}")(node, attrs, *inputs)
            for name, value in zip(node.output, produced if isinstance(produced, tuple) else (produced,)):
                if name not in self.overrides:
                    values[name] = value
        return [values[name].integers(self.torch) if isinstance(values[name], _Quantized) else values[name]
                for name in self.outputs]

    # Quantization: the integers are kept as floats, rounding's gradient passes straight through (saturation stops
    # it). A per-tensor QuantizeLinear read by its own DequantizeLinear (an activation's pair) is one fused
    # fake-quantize, not seven ops whose every intermediate tensor the backward pass would keep.
    def _QuantizeLinear(self, node, attrs, x, scale, zero_point=None):
        low, high = self.integer_ranges.get(node.input[2], (0, 255)) if len(node.input) > 2 else (0, 255)
        if scale.numel() == 1:
            return _Quantized(x, float(scale), 0 if zero_point is None else int(zero_point), low, high)
        scaled = x / self._along(scale, attrs, x.ndim) + (0 if zero_point is None else
                                                          self._along(zero_point.float(), attrs, x.ndim))
        return round_straight_through(scaled, low, high)

    def _DequantizeLinear(self, node, attrs, q, scale, zero_point=None):
        if isinstance(q, _Quantized):
            if scale.numel() == 1 and float(scale) == q.scale and (zero_point is None
                                                                   or int(zero_point) == q.zero_point):
                return self.torch.fake_quantize_per_tensor_affine(q.x, q.scale, q.zero_point, q.low, q.high)
            q = q.integers(self.torch)
        zero = 0 if zero_point is None else self._along(zero_point.float(), attrs, q.ndim)
        return (q.float() - zero) * self._along(scale, attrs, q.ndim)

    @staticmethod
    def _along(values, attrs, ndim: int):
        if values.ndim != 1 or values.numel() == 1:
            return values
        shape = [1] * ndim
        shape[attrs.get("axis", 1) % ndim] = -1
        return values.reshape(shape)

    # Layers
    def _Conv(self, node, attrs, x, w, b=None):
        forward = conv_or_gemm(node, w.ndim, self.functional)
        if forward is None:
            raise Unsupported(f"no differentiable form of {node.name}'s padding")
        return forward(x, w, b)

    def _Gemm(self, node, attrs, a, b, c=None):
        forward = conv_or_gemm(node, b.ndim, self.functional)
        if forward is None:
            raise Unsupported(f"no differentiable form of {node.name}'s transposed input over stacked samples")
        return forward(a, b, c)

    def _MatMul(self, node, attrs, a, b):
        return a @ b

    # Element-wise
    def _Add(self, node, attrs, a, b):
        return a + b

    def _Sub(self, node, attrs, a, b):
        return a - b

    def _Mul(self, node, attrs, a, b):
        return a * b

    def _Div(self, node, attrs, a, b):
        return a / b

    def _Relu(self, node, attrs, x):
        return self.functional.relu(x)

    def _LeakyRelu(self, node, attrs, x):
        return self.functional.leaky_relu(x, attrs.get("alpha", 0.01))

    def _Sigmoid(self, node, attrs, x):
        return self.torch.sigmoid(x)

    def _HardSigmoid(self, node, attrs, x):
        return (attrs.get("alpha", 0.2) * x + attrs.get("beta", 0.5)).clamp(0, 1)

    def _HardSwish(self, node, attrs, x):
        return self.functional.hardswish(x)

    def _Tanh(self, node, attrs, x):
        return self.torch.tanh(x)

    def _Clip(self, node, attrs, x, low=None, high=None):
        low = float(low) if low is not None else attrs.get("min")
        high = float(high) if high is not None else attrs.get("max")
        return x.clamp(low, high)

    def _Softmax(self, node, attrs, x):
        return self.torch.softmax(x, attrs.get("axis", -1))

    # Pooling and shapes
    def _GlobalAveragePool(self, node, attrs, x):
        return x.mean(dim=tuple(range(2, x.ndim)), keepdim=True)

    def _ReduceMean(self, node, attrs, x, axes=None):
        axes = attrs.get("axes") if axes is None else axes.tolist()
        dims = tuple(axes) if axes else tuple(range(x.ndim))
        return x.mean(dim=dims, keepdim=bool(attrs.get("keepdims", 1)))

    def _pool(self, node, attrs, x, kind: str):
        spatial = x.ndim - 2
        if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID"):
            raise Unsupported(f"no differentiable form of {node.name}'s padding")
        pads = list(attrs.get("pads", [0] * 2 * spatial))
        if pads[:spatial] != pads[spatial:]:
            raise Unsupported(f"no differentiable form of {node.name}'s uneven padding")
        pool = getattr(self.functional, f"{kind}_pool{spatial}d")
        extra = {"count_include_pad": bool(attrs.get("count_include_pad", 0))} if kind == "avg" else {}
        return pool(x, attrs["kernel_shape"], attrs.get("strides", 1), pads[:spatial],
                    ceil_mode=bool(attrs.get("ceil_mode", 0)), **extra)

    def _AveragePool(self, node, attrs, x):
        return self._pool(node, attrs, x, "avg")

    def _MaxPool(self, node, attrs, x):
        return self._pool(node, attrs, x, "max")

    def _Flatten(self, node, attrs, x):
        axis = attrs.get("axis", 1) % max(x.ndim, 1)
        return x.reshape(int(np.prod(x.shape[:axis])), -1)

    def _Reshape(self, node, attrs, x, shape):
        target = [x.shape[i] if d == 0 and not attrs.get("allowzero", 0) else int(d) for i,
                  d in enumerate(shape.tolist())]
        return x.reshape(target)

    def _Transpose(self, node, attrs, x):
        return x.permute(attrs.get("perm", list(reversed(range(x.ndim)))))

    def _Concat(self, node, attrs, *xs):
        return self.torch.cat(xs, attrs["axis"])

    def _Squeeze(self, node, attrs, x, axes=None):
        axes = attrs.get("axes") if axes is None else axes.tolist()
        return x.squeeze() if not axes else x.squeeze(tuple(a % x.ndim for a in axes))

    def _Unsqueeze(self, node, attrs, x, axes=None):
        for axis in sorted(attrs.get("axes") if axes is None else axes.tolist()):
            x = x.unsqueeze(axis)
        return x

    def _Identity(self, node, attrs, x):
        return x

    def _Constant(self, node, attrs):
        return self.torch.from_numpy(numpy_helper.to_array(attrs["value"]).copy())
