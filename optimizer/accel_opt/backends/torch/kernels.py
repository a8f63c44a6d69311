"""What an AOTInductor package computes with, read from the compute ops its C++ wrapper calls by name: whether an
int8 build really runs int8 kernels (the OpenVINO and ONNX Runtime backends check the same of theirs)."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

# The package's C++ wrapper calls each compute op Inductor did not generate itself as aoti_torch_<device>_<op>: oneDNN's
# int8 kernels are _qconv_pointwise / _qlinear_pointwise; convolution, addmm, mm, bmm are float (measured with torch
# 2.13: PT2E int8 compiled without Inductor's freezing kept aoti_torch_cpu_convolution and _addmm_out, fed by fused
# dequantize kernels; with freezing, _qconv_pointwise_tensor and _qlinear_pointwise_tensor).
KERNEL_CALL = re.compile(r"\baoti_torch_(?:cpu|cuda)_(\w+?)(?:_out)?\(")
COMPUTE_OP = re.compile(r"conv|linear|mm$|^mm|addmm|bmm|matmul")


def compute_kernels(package: Path) -> dict[str, int]:
    """{op: calls} of the compute ops (convolutions, matrix products) the package's wrapper calls by name; the ones
    Inductor generated itself (Triton, C++ loops) are not listed."""
    counts: dict[str, int] = {}
    with zipfile.ZipFile(package) as archive:
        for name in archive.namelist():
            if name.endswith("wrapper.cpp"):
                for op in KERNEL_CALL.findall(archive.read(name).decode(errors="replace")):
                    if COMPUTE_OP.search(op):
                        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items()))


def int8_check(kernels: dict[str, int]) -> str:
    """Whether an int8 package computes in int8: its quantized kernel calls, and any float compute beside them."""
    quantized = {op: n for op, n in kernels.items() if op.startswith("_q")}
    in_float = {op: n for op, n in kernels.items() if not op.startswith("_q")}
    listed = ", ".join(f"{op} x{n}" for op, n in quantized.items())
    if quantized and not in_float:
        return f"int8 kernels run: {listed}"
    floats = ", ".join(f"{op} x{n}" for op, n in in_float.items())
    if not quantized:
        return f"the compute stays in fp32: no int8 kernel in the package ({floats or 'no compute call'})"
    return f"partly int8: {listed}; in float: {floats}"
