"""The TensorRT backend: what can be proven without a GPU here, and the real build where one exists.

Profiles, trtexec lines, the inspector precision check, plan headers, engine compatibility and the
backend choice are pure functions, tested with handwritten inputs in the real formats. The
availability path runs for real on this machine (no GPU). The child-process contract is tested with
stand-in children that exit the way the real one does (a crash, out of memory). Building and running
an engine needs a GPU with TensorRT; those tests skip with the reason without one.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from accel_opt.backends.select import AcceleratorFacts, auto_backend_choice
from accel_opt.backends.tensorrt import backend as trt_backend
from accel_opt.backends.tensorrt.build_config import ShapeRange, derive_profiles, profile_bounds, trtexec_command
from accel_opt.backends.tensorrt.inspector import engine_layers, graph_tensor_dtypes, tensor_dtype, wider_layers
from accel_opt.backends.tensorrt.plan import (
    PLAN_MAGIC,
    check_engine_compatible,
    plan_mismatch,
    read_plan_header,
    timing_cache_mismatch,
    timing_cache_name,
)
from accel_opt.errors import InputRejected, InternalError, ResourceExhausted, UsageError
from accel_opt.files import install_line
from accel_opt.graph.inspect import TensorSpec
from accel_opt.machine.cpu import CpuProfile
from accel_opt.machine.gpu import CudaDevice, CudaDevices
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.types import BackendName, Precision

DATA = Path(__file__).parents[2] / "data" / "trt_inspector"
IMAGE = TensorSpec(name="image", dtype="float32", shape=["batch", 3, 224, 224])
MASK = TensorSpec(name="mask", dtype="int64", shape=["batch", "seq"])
TABLE = TensorSpec(name="table", dtype="float32", shape=[16, 4])
TRT_READY = trt_backend.TensorRtBackend().available()


# --- optimization profiles -------------------------------------------------------------------------

def test_profile_defaults_to_the_deployed_shapes_and_leaves_static_inputs_out():
    profile = derive_profiles([IMAGE, TABLE], {"image": [8, 3, 224, 224]})
    assert profile == {"image": ShapeRange([8, 3, 224, 224], [8, 3, 224, 224], [8, 3, 224, 224])}


def test_profile_takes_min_opt_max():
    profile = derive_profiles([IMAGE, MASK], {"image": [8, 3, 224, 224], "mask": [8, 128]},
                              min_shapes={"image": [1, 3, 224, 224], "mask": [1, 16]},
                              max_shapes={"image": [32, 3, 224, 224], "mask": [32, 256]})
    assert profile["image"] == ShapeRange([1, 3, 224, 224], [8, 3, 224, 224], [32, 3, 224, 224])
    assert profile["mask"] == ShapeRange([1, 16], [8, 128], [32, 256])


@pytest.mark.parametrize("kwargs, message", [
    ({"shapes": {"images": [1, 3, 224, 224]}}, "unknown input 'images'; model inputs: image"),
    ({"shapes": {}}, "input 'image' has dynamic dims [0] and no shape"),
    ({"shapes": {"image": [1, 3, 224]}}, "opt shape of image: rank 3"),
    ({"shapes": {"image": [1, 4, 224, 224]}}, "dim 1 is fixed at 3 in the model, got 4"),
    ({"shapes": {"image": [0, 3, 224, 224]}}, "dim 0 is 0, must be >= 1"),
    ({"shapes": {"image": [8, 3, 224, 224]}, "max_shapes": {"image": [4, 3, 224, 224]}},
     "dim 0 needs min <= opt <= max, got 8, 8, 4"),
])
def test_profile_errors_name_the_input_and_dim(kwargs, message):
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]")) as info:
        derive_profiles([IMAGE], **kwargs)
    assert info.value.exit_code == 2


def test_profile_bounds_span_the_swept_batches_and_max_shapes():
    low, high = profile_bounds([IMAGE, MASK, TABLE], {"image": [8, 3, 224, 224], "mask": [8, 128], "table": [16, 4]},
                               batch_sizes=[1, 8, 16], max_shapes={"mask": [4, 512]})
    assert low == {"image": [1, 3, 224, 224], "mask": [1, 128]}  # only the batch axis goes down to 1
    assert high == {"image": [16, 3, 224, 224], "mask": [16, 512]}  # the sweep's batch, --max-shapes' sequence


# --- trtexec ---------------------------------------------------------------------------------------

PROFILE = {"image": ShapeRange([1, 3, 224, 224], [8, 3, 224, 224], [16, 3, 224, 224])}


def test_trtexec_for_tensorrt_10_opts_into_strong_typing_and_11s_timing_defaults():
    args = shlex.split(trtexec_command("model.onnx", "model.engine", PROFILE, 4096, 3, "timing.cache", 10))
    assert args[:3] == ["trtexec", "--onnx=model.onnx", "--saveEngine=model.engine"]
    for flag in ("--stronglyTyped", "--minShapes=image:1x3x224x224", "--optShapes=image:8x3x224x224",
                 "--maxShapes=image:16x3x224x224", "--memPoolSize=workspace:4096M", "--builderOptimizationLevel=3",
                 "--timingCacheFile=timing.cache", "--noTF32", "--useCudaGraph", "--useSpinWait", "--noDataTransfers"):
        assert flag in args
    assert not {"--fp16", "--bf16", "--int8", "--best"} & set(args)


def test_trtexec_for_tensorrt_11_drops_flags_that_are_its_defaults():
    args = shlex.split(trtexec_command("my model.onnx", "model.engine", {}, 1024, 5, "timing.cache", 11))
    assert "--onnx=my model.onnx" in args  # quoted for the shell
    assert not {"--stronglyTyped", "--useCudaGraph", "--useSpinWait", "--noDataTransfers", "--fp16"} & set(args)
    assert not any(a.startswith("--minShapes") for a in args)  # static shapes: no profile flags
    assert "--memPoolSize=workspace:1024M" in args and "--builderOptimizationLevel=5" in args


# --- inspector: layers that run wider than the graph asks ----------------------------------------

FP16_GRAPH = {"image": "float32", "image_fp16": "float16", "relu1_out": "float16", "pooled": "float16",
              "logits": "float32"}
INT8_GRAPH = {"x": "float32", "x_q": "int8", "x_dq": "float32", "y": "float32"}


def test_inspector_dtype_words():
    assert tensor_dtype({"Format/Datatype": "Row major linear FP32"}) == "float32"
    assert tensor_dtype({"Format/Datatype": "Channel major FP16 format where channel % 8 == 0"}) == "float16"
    assert tensor_dtype({"Format/Datatype": "Thirty-two wide channel vectorized row major Int8 format"}) == "int8"
    assert tensor_dtype({"Format/Datatype": "Row major linear BFloat16 format"}) == "bfloat16"
    assert tensor_dtype({"Format/Datatype": "Half"}) == "float16"  # Myelin (kgen) layers name the type alone
    assert tensor_dtype({"DataType": "Half", "Format": "Row major linear FP16 format (kLINEAR)"}) == "float16"
    assert tensor_dtype({"Format/Datatype": "Unknown format"}) is None


def test_an_fp16_engine_that_runs_as_the_graph_says_passes():
    assert wider_layers((DATA / "fp16_cnn.json").read_text(), FP16_GRAPH) == []


def test_a_layer_widened_to_fp32_fails_and_is_named():
    wider = wider_layers((DATA / "fp16_cnn_widened.json").read_text(), FP16_GRAPH)
    assert [w.layer for w in wider] == ["Reformatting CopyNode for Input Tensor 0 to conv1 + relu1", "conv1 + relu1"]
    assert "relu1_out runs float32, the graph asks float16" in wider[1].problem


def test_int8_engine_with_fused_qdq_passes_and_an_unfused_one_fails():
    assert wider_layers((DATA / "int8_gemm.json").read_text(), INT8_GRAPH, True, frozenset({"x_dq"})) == []
    wider = wider_layers((DATA / "int8_gemm_unfused.json").read_text(), INT8_GRAPH, True, frozenset({"x_dq"}))
    assert [w.layer for w in wider] == ["fc"] and "Q/DQ not fused" in wider[0].problem


def test_an_engine_without_int8_fails_a_quantized_graph():
    layers = json.loads((DATA / "fp16_cnn.json").read_text())
    assert [w.layer for w in wider_layers(layers, FP16_GRAPH, quantized=True)] == ["(engine)"]


def test_layer_names_only_cannot_be_checked():
    with pytest.raises(ValueError, match="DETAILED"):
        engine_layers('{"Layers": ["conv1 + relu1", "pool"], "Bindings": ["image", "logits"]}')


def test_graph_dtypes_come_from_the_onnx_graph(tmp_path):
    weight = helper.make_tensor("w", TensorProto.INT8, [4, 3], np.ones(12, dtype=np.int8).tolist())
    nodes = [
        helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16),
        helper.make_node("Cast", ["x16"], ["x32"], to=TensorProto.FLOAT),
        helper.make_node("QuantizeLinear", ["x32", "s", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xdq"]),
        helper.make_node("DequantizeLinear", ["w", "s", "z"], ["wdq"]),
        helper.make_node("MatMul", ["xdq", "wdq"], ["y"]),
    ]
    inits = [weight, helper.make_tensor("s", TensorProto.FLOAT, [], [0.1]),
             helper.make_tensor("z", TensorProto.INT8, [], [0])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], inits)
    path = tmp_path / "qdq.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    dtypes, dequantized, quantized = graph_tensor_dtypes(path)
    assert dtypes["x16"] == "float16" and dtypes["xq"] == "int8" and dtypes["w"] == "int8" and dtypes["y"] == "float32"
    assert dequantized == {"xdq", "wdq"} and quantized


# --- plan header and engine compatibility -----------------------------------------------------------

def plan(major=10, minor=16, patch=1, magic=b"ftrt") -> bytes:
    body = bytearray(64)
    body[:4], body[24], body[25], body[26] = magic, major, minor, patch
    return bytes(body)


def test_plan_header_reads_the_tag_and_the_version():
    assert int.from_bytes(b"ftrt", "little") == PLAN_MAGIC
    assert read_plan_header(plan()).tensorrt_version == (10, 16, 1)
    assert plan_mismatch(read_plan_header(plan()), {"tensorrt_version": "10.16.1.11"}) is None
    assert "header says TensorRT 11.4.0" in plan_mismatch(read_plan_header(plan(11, 4, 0)),
                                                          {"tensorrt_version": "10.16.1.11"})


@pytest.mark.parametrize("data", [plan(magic=b"\x08\x01\x12\x00"), b"ftrt"], ids=["onnx-bytes", "short"])
def test_what_is_not_a_plan_is_rejected(data):
    with pytest.raises(InputRejected, match="not a TensorRT plan"):
        read_plan_header(data)


H200 = {"tensorrt_version": "10.16.1.11", "gpu_name": "NVIDIA H200", "compute_capability": "9.0",
        "hardware_compatibility_level": "NONE", "cuda_driver_version": "12.8", "driver_version": "570.86"}


@pytest.mark.parametrize("here, reason", [
    (H200, None),
    ({**H200, "driver_version": "575.1", "cuda_driver_version": "12.9"}, None),  # drivers are recorded, not compared
    ({**H200, "tensorrt_version": "11.4.0.106"},
     "built with TensorRT 10.16.1.11, this machine has TensorRT 11.4.0.106"),
    ({**H200, "tensorrt_version": None}, "TensorRT is not installed here"),
    ({**H200, "gpu_name": "NVIDIA L4", "compute_capability": "8.9"}, "built for compute capability 9.0"),
    ({**H200, "gpu_name": "NVIDIA H100 80GB HBM3"}, "signed off on NVIDIA H200, this GPU is NVIDIA H100"),
    ({**H200, "gpu_name": None, "compute_capability": None}, "no CUDA GPU here"),
])
def test_engine_compatibility(here, reason):
    got = check_engine_compatible(H200, here)
    assert (got is None) if reason is None else (reason in got)


def test_hardware_compatible_engines_run_on_any_ampere_or_newer():
    built = {**H200, "hardware_compatibility_level": "AMPERE_PLUS"}
    assert check_engine_compatible(built, {**H200, "gpu_name": "NVIDIA A10", "compute_capability": "8.6"}) is None
    assert "AMPERE_PLUS" in check_engine_compatible(built, {**H200, "gpu_name": "Tesla T4",
                                                            "compute_capability": "7.5"})


def test_timing_cache_only_for_the_same_gpu_and_tensorrt():
    assert timing_cache_mismatch(H200, dict(H200)) is None
    assert "compute_capability" in timing_cache_mismatch(H200, {**H200, "compute_capability": "8.9"})
    assert "tensorrt_version" in timing_cache_mismatch(H200, {**H200, "tensorrt_version": "10.16.0.72"})
    assert timing_cache_name(H200) == "NVIDIA_H200-9.0-10.16.1.11.timing-cache"


# --- availability on this machine, for real ---------------------------------------------------------

def test_get_backend_refuses_tensorrt_in_one_line_without_importing_it():
    code = textwrap.dedent("""
        import sys
        from accel_opt.backends import get_backend
        from accel_opt.errors import Unsupported
        try:
            get_backend("tensorrt")
        except Unsupported as exc:
            print(exc.exit_code, "tensorrt" in sys.modules, exc, sep="|")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if TRT_READY:
        pytest.skip("TensorRT is usable on this machine")
    exit_code, imported, message = done.stdout.strip().split("|", 2)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    assert exit_code == "4" and imported == "False"
    assert "\n" not in message and install_line("tensorrt") in message
    assert message.startswith("backend tensorrt is unavailable here: ")


def test_availability_reasons_follow_the_probe(monkeypatch):
    """The decision order, with the devices seen injected (no GPU is faked into a result)."""
    from accel_opt.machine import gpu as cuda_device

    monkeypatch.setattr(trt_backend, "cuda_devices", lambda: CudaDevices((), None, "no NVIDIA driver library"))
    reason = trt_backend.TensorRtBackend().available().reason
    assert reason.startswith("no NVIDIA driver library; TensorRT needs an NVIDIA GPU")
    if trt_backend.importlib.util.find_spec("tensorrt") is None:
        gpu = CudaDevices((CudaDevice(0, "NVIDIA L4", "8.9", 23034),), "12.8")
        monkeypatch.setattr(trt_backend, "cuda_devices", lambda: gpu)
        monkeypatch.setattr(cuda_device, "cuda_devices", lambda: gpu)
        assert trt_backend.TensorRtBackend().available().reason.startswith("tensorrt is not installed: pip install")
        assert trt_backend.TensorRtBackend().supports(Precision.bf16)  # L4 (8.9) has bf16 tensor cores
        old = CudaDevices((CudaDevice(0, "Tesla T4", "7.5", 15360),), "12.8")
        monkeypatch.setattr(trt_backend, "cuda_devices", lambda: old)
        monkeypatch.setattr(cuda_device, "cuda_devices", lambda: old)  # the precision check both GPU backends share
        assert "no bf16 tensor cores" in trt_backend.TensorRtBackend().supports(Precision.bf16).reason


# --- the build child's exit-status contract ---------------------------------------------------------

def _stand_in_child(tmp_path, monkeypatch, body: str) -> dict:
    (tmp_path / "stand_in_child.py").write_text(textwrap.dedent(body))
    monkeypatch.setattr(trt_backend, "BUILD_MODULE", "stand_in_child")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "build"
    out.mkdir()
    return {"result": str(out / "result.json"), "out": out}


def test_a_crashing_build_is_an_internal_error_with_its_log_kept(tmp_path, monkeypatch):
    paths = _stand_in_child(tmp_path, monkeypatch, """
        import os, signal, sys
        print("building...", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    """)
    with pytest.raises(InternalError, match="SIGSEGV") as info:
        trt_backend._run_build({"result": paths["result"]}, paths["out"], trt_backend.TensorRtOptions(), {}, {})
    kept = str(info.value).rsplit("log: ", 1)[1]
    assert info.value.exit_code == 70 and "building..." in Path(kept).read_text()


def test_out_of_memory_names_the_shapes(tmp_path, monkeypatch):
    paths = _stand_in_child(tmp_path, monkeypatch, """
        import json, sys
        request = json.load(open(sys.argv[1]))
        message = "Error Code 2: OutOfMemory (Requested size was 8589934592 bytes.)"
        json.dump({"message": message}, open(request["result"], "w"))
        sys.exit(5)
    """)
    with pytest.raises(ResourceExhausted,
                       match=r"image max 16x3x224x224 with a 4096 MiB workspace on NVIDIA L4") as info:
        trt_backend._run_build({"result": paths["result"]}, paths["out"], trt_backend.TensorRtOptions(), PROFILE,
                               {"gpu_name": "NVIDIA L4", "gpu_memory_mib": 23034})
    assert info.value.exit_code == 5


def test_the_real_child_without_tensorrt_reports_a_crash(tmp_path):
    request = {"result": str(tmp_path / "result.json")}
    (tmp_path / "request.json").write_text(json.dumps(request))
    done = subprocess.run([sys.executable, "-m", trt_backend.BUILD_MODULE, str(tmp_path / "request.json")],
                          capture_output=True, text=True, timeout=120)
    if TRT_READY:
        pytest.skip("TensorRT is usable on this machine")
    assert done.returncode == 70 and "Error" in json.loads((tmp_path / "result.json").read_text())["message"]


def test_the_oom_pattern_matches_tensorrt_wording():
    from accel_opt.backends.tensorrt.build import OUT_OF_MEMORY

    for line in ("[defaultAllocator.cpp::allocate::20] Error Code 1: Cuda Runtime (out of memory)",
                 "Error Code 2: OutOfMemory (Requested size was 17179869184 bytes.)",
                 "Requested amount of GPU memory (8589934592 bytes) could not be allocated."):
        assert OUT_OF_MEMORY.search(line)
    assert not OUT_OF_MEMORY.search("Error Code 4: Internal Error (Could not find any implementation for node conv1)")


# --- --backend auto ---------------------------------------------------------------------------------

CPU = {"cpu": CpuProfile.of_class("avx2"), "openvino_importable": False}


def test_auto_prefers_tensorrt_then_ort_cuda_then_the_cpu():
    trt = auto_backend_choice(facts=AcceleratorFacts("NVIDIA L4", True, "", ("CPUExecutionProvider",)), **CPU)
    assert trt.backend is BackendName.tensorrt and "NVIDIA L4" in trt.reason
    ort_gpu = auto_backend_choice(facts=AcceleratorFacts("NVIDIA L4", False, "tensorrt is not installed",
                                                   ("CUDAExecutionProvider", "CPUExecutionProvider")), **CPU)
    assert ort_gpu.backend is BackendName.onnxruntime and ort_gpu.providers[0] == "CUDAExecutionProvider"
    cpu = auto_backend_choice(facts=AcceleratorFacts("NVIDIA L4", False, "tensorrt is not installed",
                                               ("CPUExecutionProvider",)), **CPU)
    assert cpu.backend is BackendName.onnxruntime and cpu.providers == ("CPUExecutionProvider",)
    assert "NVIDIA GPU (NVIDIA L4) found" in cpu.reason and "ONNX Runtime" in cpu.reason


def test_auto_ignores_a_cuda_ep_without_a_gpu():
    """onnxruntime-gpu lists CUDAExecutionProvider without CUDA and then silently runs on the CPU."""
    choice = auto_backend_choice(facts=AcceleratorFacts(None, False, "no GPU",
                                                        ("CUDAExecutionProvider", "CPUExecutionProvider")),
                                 **CPU)
    assert choice.backend is BackendName.onnxruntime and choice.providers == ("CPUExecutionProvider",)


# --- on a GPU with TensorRT -------------------------------------------------------------------------

gpu = pytest.mark.skipif(not TRT_READY, reason=f"needs an NVIDIA GPU with TensorRT: {TRT_READY.reason}")


def _mlp(path: Path) -> Path:
    rng = np.random.default_rng(0)
    w1, w2 = rng.standard_normal((64,
                                  128)).astype(np.float32) / 8, rng.standard_normal((128, 10)).astype(np.float32) / 8
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w2"], ["y"])], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])],
        [onnx.numpy_helper.from_array(w1, "w1"), onnx.numpy_helper.from_array(w2, "w2")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.gpu
@gpu
def test_build_and_run_an_engine(tmp_path):
    import onnxruntime as ort

    model = _mlp(tmp_path / "mlp.onnx")
    recipe = Recipe(backend=BackendName.tensorrt, benchmark={"batch_sizes": [1, 4]})
    backend = trt_backend.TensorRtBackend()
    compiled = backend.compile(model, Precision.fp32, recipe, tmp_path / "work", shapes={"x": [4, 64]})
    settings = compiled.settings
    assert settings["profile"]["x"] == {"min": [1, 64], "opt": [4, 64], "max": [4, 64]}
    assert settings["tf32"] is False and settings["plan_header_check"] in ("version", "magic", "none")
    assert {p.name for p in compiled.extra_files} == {"model.engine", "engine-layers.json", "trtexec.txt",
                                                      "timing.cache"}
    feed = {"x": np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)}
    with backend.runner(compiled) as runner:
        got = runner.infer(feed)["y"]
    backend.synchronize()
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert check_engine_compatible(settings, trt_backend.here_facts()) is None
