"""`--backend auto` and `--precision auto`: what is worth trying on this machine, with a reason each.

Which CPU backend is faster is a measurement, not a flag: on an AVX2-only Zen 3, OpenVINO fp32 ran a PicoDet
layout detector 1.64x faster than ONNX Runtime fp32 (PP-OCRv4 det 1.41x, YOLOv8n 0.92x), while on an AMX
Sapphire Rapids the same PicoDet ran 3.5x slower on OpenVINO. So on x86 with OpenVINO installed, `auto` builds
on both and the runoff's timings decide. Pure functions of the CPU profile they are given (machine.cpu.CpuProfile),
so the choices are tested under every CPU class.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from accel_opt.backends.openvino.backend import precision_support
from accel_opt.files import install_line
from accel_opt.machine.cpu import CpuProfile
from accel_opt.recipe.types import BackendName, Precision

X86 = ("x86_64", "amd64", "i686", "i386")


def _openvino_importable() -> bool:
    return importlib.util.find_spec("openvino") is not None


def auto_backend(cpu: CpuProfile, openvino_importable: bool | None = None) -> tuple[BackendName, str]:
    """The CPU backend to use on `cpu` and a one-line reason (`openvino_importable` defaults to this environment)."""
    flags, machine = cpu.flags, cpu.machine.lower()
    importable = _openvino_importable() if openvino_importable is None else openvino_importable
    if machine not in X86:
        return (BackendName.onnxruntime,
                f"{machine} CPU: OpenVINO's fast paths are x86; ONNX Runtime is the portable default")
    wide = ", ".join(sorted(f for f in flags if f.startswith("amx")
                            or f in ("avx512f", "avx512_vnni", "avx2"))) or "x86"
    if not importable:
        return BackendName.onnxruntime, (
            f"x86 CPU ({wide}) where OpenVINO is often the faster runtime, but openvino is not installed "
            f"({install_line('openvino')}); using ONNX Runtime"
        )
    return BackendName.openvino, (f"x86 CPU ({wide}): OpenVINO and ONNX Runtime are both built and timed; which is "
                                  "faster depends on the model and the CPU")


def candidate_precisions(backend: BackendName | str, cpu: CpuProfile) -> list[tuple[Precision, str]]:
    """Precisions worth building for `backend` on the CPU `cpu`, fastest last, each with why."""
    backend = BackendName(backend)
    int8_why = "int8 dot products in hardware (VNNI/AMX)" if cpu.int8_dot_products else \
        "no VNNI/AMX: int8 gains are smaller here"
    if backend is BackendName.onnxruntime:
        return [
            (Precision.fp32, "reference precision"),
            (Precision.int8, f"Q/DQ with u8 activations / s8 weights on the CPU EP; {int8_why}"),
        ]
    if backend is BackendName.openvino:
        capabilities = cpu.openvino_capabilities
        if capabilities is None:
            from accel_opt.backends.openvino.backend import capabilities as ov_capabilities

            capabilities = ov_capabilities()
        out = [(Precision.fp32, "reference precision (INFERENCE_PRECISION_HINT=f32)")]
        bf16 = precision_support(Precision.bf16, cpu.flags, capabilities)
        if bf16:
            out.append((Precision.bf16, "native bf16 (AMX-BF16/AVX512-BF16): no calibration, near-fp32 accuracy"))
        out.append((Precision.int8, f"the Q/DQ graph run as int8 by OpenVINO; {int8_why}"))
        return out
    if backend is BackendName.torch:
        return torch_candidate_precisions(cpu)
    return [
        (Precision.fp32, "reference precision"),
        (Precision.fp16, "tensor-core fp16"),
        (Precision.int8, "explicit Q/DQ (symmetric int8)"),
    ]


def torch_candidate_precisions(cpu: CpuProfile, cuda: bool | None = None,
                               torchao: bool | None = None) -> list[tuple[Precision, str]]:
    """The torch backend's candidates: on a GPU fp16 and bf16 (tensor cores); on a CPU bf16 where it is native
    (AMX-BF16/AVX512-BF16: Inductor's oneDNN kernels) and PT2E int8 where torchao provides it."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    out = [(Precision.fp32, "reference precision (TF32 off)")]
    if cuda:
        return out + [(Precision.fp16, "tensor-core fp16, float32 at the package's boundary"),
                      (Precision.bf16, "tensor-core bf16, float32 at the package's boundary")]
    if cpu.native_bf16:
        out.append((Precision.bf16, "native bf16 (AMX-BF16/AVX512-BF16) in Inductor's oneDNN kernels"))
    if torchao is None:
        torchao = importlib.util.find_spec("torchao") is not None
    if torchao:
        out.append((Precision.int8, "PT2E int8 (X86InductorQuantizer) in Inductor's oneDNN kernels"))
    return out


CUDA_PROVIDER = "CUDAExecutionProvider"


@dataclass(frozen=True)
class AcceleratorFacts:
    """What `--backend auto` needs to know about GPUs; injected in tests."""

    gpu_name: str | None  # CUDA device 0, None without one
    tensorrt_available: bool  # TensorRT imports (only tried where a GPU was found)
    tensorrt_reason: str  # why not, when it does not
    ort_providers: tuple[str, ...]  # onnxruntime.get_available_providers()


@dataclass(frozen=True)
class BackendChoice:
    backend: BackendName
    providers: tuple[str, ...] | None  # ONNX Runtime's execution providers in order; None for other backends
    reason: str


def accelerator_facts() -> AcceleratorFacts:
    """This machine's facts. TensorRT is imported only where libcuda reports a device."""
    from accel_opt.machine.gpu import cuda_devices

    try:
        import onnxruntime

        providers = tuple(onnxruntime.get_available_providers())
    except ImportError:
        providers = ()
    gpus = cuda_devices()
    if not gpus:
        return AcceleratorFacts(None, False, gpus.reason, providers)
    from accel_opt.backends.tensorrt.backend import TensorRtBackend

    availability = TensorRtBackend().available()
    return AcceleratorFacts(gpus.devices[0].name, bool(availability), availability.reason, providers)


def auto_backend_choice(
    cpu: CpuProfile, facts: AcceleratorFacts | None = None, openvino_importable: bool | None = None,
) -> BackendChoice:
    """`--backend auto` with GPUs considered: TensorRT on an NVIDIA GPU with TensorRT installed; else ONNX
    Runtime's CUDA EP where onnxruntime-gpu offers it on a GPU; else the CPU choice of `auto_backend`.

    onnxruntime-gpu lists the CUDA EP even without a GPU and then runs on the CPU (ORT #17394), so the
    EP counts only with a device present; create_session still checks the EP is active.
    """
    facts = accelerator_facts() if facts is None else facts
    if facts.gpu_name and facts.tensorrt_available:
        return BackendChoice(BackendName.tensorrt, None, f"NVIDIA GPU ({facts.gpu_name}) with TensorRT: native engines")
    if facts.gpu_name and CUDA_PROVIDER in facts.ort_providers:
        return BackendChoice(BackendName.onnxruntime, (CUDA_PROVIDER, "CPUExecutionProvider"),
                             f"NVIDIA GPU ({facts.gpu_name}) without TensorRT ({facts.tensorrt_reason}); "
                             "ONNX Runtime's CUDA execution provider")
    backend, why = auto_backend(cpu, openvino_importable)
    if facts.gpu_name:
        why = (f"NVIDIA GPU ({facts.gpu_name}) found, but TensorRT is unavailable ({facts.tensorrt_reason}) and "
               f"onnxruntime-gpu is not installed; CPU: {why}")
    providers = ("CPUExecutionProvider",) if backend is BackendName.onnxruntime else None
    return BackendChoice(backend, providers, why)
