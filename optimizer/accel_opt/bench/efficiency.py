"""How close the build runs to the machine: FLOPs and bytes counted from the graph, against measurements of the
host measured in the same run (an fp32 GEMM and a memory copy), and whether a batch is compute- or
memory-bound (its arithmetic intensity against the machine's balance point, the roofline model).

Counted by hand because none of the project's libraries counts FLOPs: ONNX shape inference gives
every tensor's shape at the deployed shapes, and Conv / ConvTranspose / MatMul / Gemm carry the math
(2 FLOPs per multiply-add); elementwise ops are left out, as the usual model FLOP counts do.
"""

from __future__ import annotations

import time

import numpy as np
import onnx
from pydantic import BaseModel

GEMM_N = 1024
COPY_MIB = 64  # well past the last-level cache, small enough for any build machine


class BatchEfficiency(BaseModel):
    batch_size: int
    achieved_gflops: float  # counted FLOPs x batch / p50
    fraction_of_fp32_ceiling: float
    arithmetic_intensity: float  # FLOPs per byte moved (weights once + inputs and outputs)
    bound: str  # "compute" or "memory", against the machine balance


class Efficiency(BaseModel):
    gflop_per_sample: float
    weight_mib: float
    io_mib_per_sample: float
    fp32_ceiling_gflops: float  # numpy GEMM, all threads, best of 5, in this run
    memory_gib_per_s: float  # numpy copy, in this run
    machine_balance: float  # FLOPs per byte at which the two ceilings meet
    precision_note: str
    batches: list[BatchEfficiency]


def count_flops(model_path, shapes: dict[str, list[int]]) -> tuple[int, int, int]:
    """(FLOPs, weight bytes, input + output bytes) of one forward pass at `shapes` (batch 1: per sample)."""
    per_node, model, inferred = _node_flops(model_path, shapes)
    weights = {t.name for t in model.graph.initializer}
    weight_bytes = sum(int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
                       for t in model.graph.initializer)
    io_bytes = 0
    for value in [*inferred.graph.input, *inferred.graph.output]:
        if value.name in weights:
            continue
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).itemsize
        io_bytes += int(np.prod(dims)) * itemsize if all(d > 0 for d in dims) else 0
    return sum(per_node.values()), weight_bytes, io_bytes


def node_flops(model_path, shapes: dict[str, list[int]]) -> dict[str, int]:
    """FLOPs of each named Conv / ConvTranspose / MatMul / Gemm node at `shapes`."""
    return _node_flops(model_path, shapes)[0]


def _node_flops(model_path, shapes: dict[str, list[int]]) -> tuple[dict[str, int], onnx.ModelProto, onnx.ModelProto]:
    model = onnx.load(str(model_path))
    for value in model.graph.input:
        if value.name in shapes:
            dims = value.type.tensor_type.shape.dim
            for dim, size in zip(dims, shapes[value.name]):
                dim.ClearField("dim_param")
                dim.dim_value = size
    del model.graph.value_info[:]  # shapes recorded with symbolic dims would win over the ones set above
    inferred = onnx.shape_inference.infer_shapes(model)
    known = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
             for v in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]}
    weights = {t.name: tuple(t.dims) for t in model.graph.initializer}
    flops: dict[str, int] = {}
    for index, node in enumerate(inferred.graph.node):
        out = known.get(node.output[0]) if node.output else None
        if not out:
            continue
        out = [d if d > 0 else 1 for d in out]  # a dim inference left symbolic: the batch, set to 1 above
        count = 0
        if node.op_type in ("Conv", "ConvTranspose"):
            kernel = weights.get(node.input[1]) or tuple(known.get(node.input[1], ()))
            if len(kernel) >= 3:
                groups = next((a.i for a in node.attribute if a.name == "group"), 1)
                per_output = (int(np.prod(kernel[1:])) if node.op_type == "Conv"
                              else int(np.prod(kernel[2:])) * kernel[0] // groups)
                count = 2 * int(np.prod(out)) * per_output
        elif node.op_type in ("MatMul", "Gemm"):
            a = known.get(node.input[0]) or list(weights.get(node.input[0], ()))
            if a:
                transposed = node.op_type == "Gemm" and any(x.name == "transA" and x.i for x in node.attribute)
                k = a[-2] if transposed and len(a) >= 2 else a[-1]
                count = 2 * int(np.prod(out)) * k
        if count:
            flops[node.name or f"#{index}"] = count
    return flops, model, inferred


def measured_fp32_gflops(reps: int = 5) -> float:
    a = np.random.default_rng(0).standard_normal((GEMM_N, GEMM_N), dtype=np.float32)
    best = min(_seconds(lambda: a @ a) for _ in range(reps))
    return 2 * GEMM_N**3 / best / 1e9


def measured_memory_gib_per_s(reps: int = 3) -> float:
    src = np.ones(COPY_MIB * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    best = min(_seconds(lambda: np.copyto(dst, src)) for _ in range(reps))
    return 2 * src.nbytes / best / 2**30  # read + write


def _seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def efficiency(fp32_model_path, shapes_batch1: dict[str, list[int]], p50_ms_by_batch: dict[int, float],
               precision: str) -> Efficiency:
    """Efficiency of the candidate's measured p50s, from the fp32 graph's FLOPs (precision changes the
    kernels, not the count) and the host measurements taken now."""
    flops, weight_bytes, io_bytes_per_sample = count_flops(fp32_model_path, shapes_batch1)
    ceiling, bandwidth = measured_fp32_gflops(), measured_memory_gib_per_s()
    balance = ceiling * 1e9 / (bandwidth * 2**30)
    batches = []
    for batch, p50_ms in sorted(p50_ms_by_batch.items()):
        achieved = flops * batch / (p50_ms / 1e3) / 1e9
        intensity = flops * batch / max(weight_bytes + io_bytes_per_sample * batch, 1)
        batches.append(BatchEfficiency(batch_size=batch, achieved_gflops=achieved,
                                       fraction_of_fp32_ceiling=achieved / ceiling,
                                       arithmetic_intensity=intensity,
                                       bound="compute" if intensity >= balance else "memory"))
    note = ("fp32: the ceiling is this precision's" if precision == "fp32" else
            f"{precision}: its kernels' ceiling is higher than the fp32 GEMM's (no {precision} measurement here); "
            "a fraction above 1 means the reduced precision pays")
    return Efficiency(gflop_per_sample=flops / 1e9, weight_mib=weight_bytes / 2**20,
                      io_mib_per_sample=io_bytes_per_sample / 2**20,
                      fp32_ceiling_gflops=ceiling, memory_gib_per_s=bandwidth, machine_balance=balance,
                      precision_note=note, batches=batches)
