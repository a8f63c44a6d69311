"""What ONNX Runtime's CPU EP computes a Q/DQ model in: the integer kernels it fused, and the quantized ops it still
runs in float (an int8 build in name only)."""

from __future__ import annotations

from pathlib import Path

from accel_opt.errors import Unsupported

# What ORT's CPU EP runs quantized math with, once it has fused a DequantizeLinear -> op -> QuantizeLinear group.
INTEGER_KERNELS = {"QGemm", "MatMulInteger", "ConvInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul",
                   "QAttention", "QOrderedMatMul"}
FLOAT_COMPUTE = {"Conv", "ConvTranspose", "MatMul", "Gemm", "FusedConv", "FusedMatMul", "FusedGemm", "NhwcFusedConv"}


def integer_kernels(optimized_path: Path) -> dict[str, int]:
    """{op: count} of the integer kernels in the graph ORT runs; Unsupported (exit 4) when a quantized
    compute op still runs in float (its input dequantized first) that the fallback did not leave in float
    on purpose (the model's metadata lists those), naming them: ORT fuses a Q/DQ group
    into an integer kernel only when the pattern suits it (a Conv without a QuantizeLinear after it,
    for one, stays a float Conv fed by DequantizeLinear), and the build would then be int8 in name only."""
    import onnx

    from accel_opt.precision.fallback import float_by_design

    model = onnx.load(str(optimized_path), load_external_data=False)
    graph = model.graph
    in_float = [name for name in float_run_quantized(graph) if name not in float_by_design(model)]
    if in_float:
        listed = ", ".join(in_float[:5]) + (f" (+{len(in_float) - 5} more)" if len(in_float) > 5 else "")
        raise Unsupported(f"ONNX Runtime runs {len(in_float)} quantized compute ops in float (not fused into integer "
                          f"kernels): {listed}")
    counts: dict[str, int] = {}
    for node in graph.node:
        if node.op_type.startswith("QLinear") or node.op_type in INTEGER_KERNELS:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items()))


def float_run_quantized(graph) -> list[str]:
    """The compute nodes of an optimized graph that run in float on dequantized inputs."""
    dequantized = {out for node in graph.node if node.op_type == "DequantizeLinear" for out in node.output}
    return [node.name or node.op_type for node in graph.node
            if node.op_type in FLOAT_COMPUTE and any(i in dequantized for i in node.input)]
