"""ONNX Runtime's CUDA and TensorRT EPs: strict provider checks, availability reasons, the TensorRT EP's
caches, and the I/O-binding runner's stage timing.

On a machine without a GPU (and with the CPU onnxruntime) the strict checks run for real: asking for
the CUDA EP must end in one line with exit 4, never in a CPU session. The I/O-binding runner runs for
real on device "cpu" (ORT binds host memory through the same API). Tests that need a GPU EP are
skipped with the reason this machine gives.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from accel_opt.backends import get_backend
from accel_opt.backends.base import CastInputsRunner, CompiledModel
from accel_opt.backends.gpu_timing import STAGE_KEYS, StageClock, last_stage_ms, median_stage_ms
from accel_opt.backends.onnxruntime import gpu as ort_gpu
from accel_opt.backends.onnxruntime.backend import OnnxRuntimeBackend, create_session, open_session
from accel_opt.backends.onnxruntime.gpu import (
    CPU_PROVIDER,
    CUDA_PROVIDER,
    TENSORRT_PROVIDER,
    TrtEpCache,
    provider_availability,
    provider_entries,
    trt_cache_mismatch,
    trt_ep_options,
)
from accel_opt.backends.onnxruntime.iobinding import OrtIoBindingRunner, SessionFactory
from accel_opt.backends.tensorrt.build_config import ShapeRange
from accel_opt.errors import Unsupported
from accel_opt.files import install_line
from accel_opt.machine import gpu as cuda_device
from accel_opt.machine.gpu import CudaDevice, CudaDevices
from accel_opt.recipe.schema import Recipe
from accel_opt.recipe.types import Precision
from tests.conftest import matmul_model, save

ROOT = Path(__file__).resolve().parents[3]
INSTALL_HINT = f"pip uninstall -y onnxruntime && {install_line('gpu')}"
NO_GPU = CudaDevices((), None, "no NVIDIA GPU: no /dev/nvidia* device and no nvidia-smi (no NVIDIA driver)")
H200 = CudaDevices((CudaDevice(0, "NVIDIA H200", "9.0", 143771),), "12.8")
CPU_BUILD = ["AzureExecutionProvider", CPU_PROVIDER]
GPU_BUILD = [TENSORRT_PROVIDER, CUDA_PROVIDER, CPU_PROVIDER]

CUDA_HERE = provider_availability(CUDA_PROVIDER)
TRT_HERE = provider_availability(TENSORRT_PROVIDER)
needs_cuda_ep = pytest.mark.skipif(not CUDA_HERE, reason=f"needs ONNX Runtime's CUDA EP on a GPU: {CUDA_HERE.reason}")
needs_trt_ep = pytest.mark.skipif(not TRT_HERE, reason=f"needs ONNX Runtime's TensorRT EP on a GPU: {TRT_HERE.reason}")
without_cuda_ep = pytest.mark.skipif(bool(CUDA_HERE), reason="the CUDA EP runs here: nothing to refuse")


@pytest.fixture()
def mlp(tmp_path) -> Path:
    return save(matmul_model(("batch", 4), 3), tmp_path / "mlp.onnx")


def _feed(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((batch, 4)).astype(np.float32)}


# --- strict provider checks, for real on this machine's onnxruntime ---------------------------------

@without_cuda_ep
@pytest.mark.parametrize("provider", [CUDA_PROVIDER, TENSORRT_PROVIDER])
def test_asking_for_a_gpu_ep_here_is_one_line_exit_4_not_a_cpu_session(mlp, provider):
    with pytest.raises(Unsupported) as caught:
        create_session(mlp, [provider, CPU_PROVIDER], threads=1)
    message = str(caught.value)
    assert caught.value.exit_code == 4 and "\n" not in message
    assert message.startswith(f"ONNX Runtime's {provider} is unavailable here: ")
    import onnxruntime

    if provider not in onnxruntime.get_available_providers():  # the CPU build: say how to get the GPU one
        assert INSTALL_HINT in message


@without_cuda_ep
@pytest.mark.parametrize("allow_cpu_nodes", [False, True])
def test_the_session_checks_hold_where_availability_is_fooled(mlp, allow_cpu_nodes):
    """open_session is what runs after the availability check; onnxruntime-gpu without working CUDA gets
    this far. Strict (disable_cpu_ep_fallback) or not, the outcome is a refusal, not a CPU session."""
    with pytest.raises(Unsupported,
                       match=f"fell back to {CPU_PROVIDER} although {CUDA_PROVIDER} was requested") as caught:
        open_session(mlp, CUDA_PROVIDER, threads=1, allow_cpu_nodes=allow_cpu_nodes)
    assert caught.value.exit_code == 4 and "\n" not in str(caught.value)


@without_cuda_ep
def test_a_cuda_backend_is_refused_by_get_backend_compile_and_runner(mlp, tmp_path):
    with pytest.raises(Unsupported, match=r"^backend onnxruntime is unavailable here: CUDAExecutionProvider needs"):
        get_backend("onnxruntime", providers=[CUDA_PROVIDER, CPU_PROVIDER])
    with pytest.raises(Unsupported, match="CUDAExecutionProvider"):
        OnnxRuntimeBackend([CUDA_PROVIDER]).compile(mlp, Precision.fp32, Recipe(), tmp_path)
    # A GPU artifact loaded here (the runtime rebuilds the backend with its defaults) is refused, not run on the CPU.
    gpu_build = CompiledModel(backend="onnxruntime", path=mlp, precision=Precision.fp32, device="cuda:0",
                              providers=[CUDA_PROVIDER, CPU_PROVIDER], threads=1, build_seconds=0.0,
                              settings={"execution_provider": CUDA_PROVIDER})
    with pytest.raises(Unsupported, match="was built for ONNX Runtime's CUDAExecutionProvider"):
        OnnxRuntimeBackend().runner(gpu_build)


def test_the_cli_refusal_is_one_line_and_exit_4(mlp):
    """What a user sees: the process exits 4 with one line on stderr, whatever the default logger prints."""
    code = ("import sys\nfrom accel_opt.backends import get_backend\nfrom accel_opt.errors import AccelOptError\n"
            "try:\n    get_backend('onnxruntime', providers=['CUDAExecutionProvider'])\n"
            "except AccelOptError as e:\n    print(e, file=sys.stderr); sys.exit(e.exit_code)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "error::UserWarning"})
    if CUDA_HERE:
        assert done.returncode == 0, done.stderr
    else:
        assert done.returncode == 4 and done.stderr.count("\n") == 1, done.stderr


def test_cpu_sessions_are_unchanged(mlp):
    session = create_session(mlp, [CPU_PROVIDER], threads=1)
    assert session.get_providers()[0] == CPU_PROVIDER
    backend = OnnxRuntimeBackend()
    assert backend.available() and not backend.compiles_for_shapes
    compiled = backend.compile(mlp, Precision.fp32, Recipe(), mlp.parent / "work")
    assert compiled.device == "cpu" and "execution_provider" not in compiled.settings and not compiled.extra_files


# --- availability reasons (the GPUs seen and the build's provider list injected; nothing is run) --------

@pytest.mark.parametrize(("gpus", "available", "ok", "says", "hint"), [
    (NO_GPU, CPU_BUILD, False, "needs an NVIDIA GPU: no NVIDIA GPU", True),
    (H200, CPU_BUILD, False, "is not in this onnxruntime build (1.32.0", True),
    # onnxruntime-gpu lists CUDA without a GPU (ORT #17394): the devices seen decide, not the list.
    (NO_GPU, GPU_BUILD, False, "needs an NVIDIA GPU: no NVIDIA GPU", False),
    (H200, GPU_BUILD, True, "", False),
])
def test_availability_asks_for_a_device_before_trusting_the_provider_list(gpus, available, ok, says, hint):
    for provider in (CUDA_PROVIDER, TENSORRT_PROVIDER):
        result = provider_availability(provider, gpus=gpus, available=available, version="1.32.0")
        assert bool(result) is ok and says in result.reason and (INSTALL_HINT in result.reason) is hint
        assert "\n" not in result.reason


def test_unknown_providers_are_named():
    reason = provider_availability("OpenVINOExecutionProvider", gpus=H200, available=GPU_BUILD, version="1.32").reason
    assert "'OpenVINOExecutionProvider' is not supported" in reason and CUDA_PROVIDER in reason


def test_precision_support_per_provider(monkeypatch):
    assert not OnnxRuntimeBackend().supports(Precision.bf16)
    assert "int8" in OnnxRuntimeBackend([CUDA_PROVIDER]).supports(Precision.int8).reason
    t4 = CudaDevices((CudaDevice(0, "Tesla T4", "7.5", 15360),), "12.8")
    monkeypatch.setattr(ort_gpu, "cuda_devices", lambda: t4)
    monkeypatch.setattr(cuda_device, "cuda_devices", lambda: t4)  # the precision check both GPU backends share
    trt = OnnxRuntimeBackend([TENSORRT_PROVIDER])
    assert trt.supports(Precision.int8) and trt.supports(Precision.fp16)
    assert "no bf16 tensor cores" in trt.supports(Precision.bf16).reason
    assert trt.compiles_for_shapes  # the TensorRT EP's profile comes from the deployment's shapes


# --- provider lists and TensorRT EP options ---------------------------------------------------------

def test_strict_provider_lists_never_list_the_cpu_ep():
    assert provider_entries(CUDA_PROVIDER) == [(CUDA_PROVIDER, {"device_id": "0", "use_tf32": "0"})]
    names = [name for name, _ in provider_entries(TENSORRT_PROVIDER, {"device_id": "0"})]
    assert names == [TENSORRT_PROVIDER, CUDA_PROVIDER]  # nodes TensorRT does not take run on CUDA, not the CPU
    assert [n for n, _ in provider_entries(CUDA_PROVIDER, allow_cpu_nodes=True)] == [CUDA_PROVIDER, CPU_PROVIDER]


@pytest.mark.parametrize("flag", ["trt_fp16_enable", "trt_int8_enable", "trt_bf16_enable"])
def test_precision_flags_are_refused(flag):
    with pytest.raises(ValueError, match="the ONNX graph carries the precision"):
        provider_entries(TENSORRT_PROVIDER, {flag: "True"})


def test_trt_ep_options_put_both_caches_where_the_build_says(tmp_path):
    profile = {"x": ShapeRange([1, 4], [8, 4], [16, 4]), "mask": ShapeRange([1, 7], [8, 7], [16, 7])}
    options = trt_ep_options(tmp_path / "e", tmp_path / "t", profile, workspace_mib=2048, optimization_level=4)
    assert options["trt_engine_cache_enable"] == options["trt_timing_cache_enable"] == "True"
    assert options["trt_engine_cache_path"] == str(tmp_path
                                                   / "e") and options["trt_timing_cache_path"] == str(tmp_path / "t")
    assert options["trt_profile_min_shapes"] == "x:1x4,mask:1x7"
    assert options["trt_profile_opt_shapes"] == "x:8x4,mask:8x7"
    assert options["trt_profile_max_shapes"] == "x:16x4,mask:16x7"
    assert options["trt_max_workspace_size"] == str(2048 * 2**20) and options["trt_builder_optimization_level"] == "4"
    assert not set(options) & {"trt_fp16_enable", "trt_int8_enable", "trt_bf16_enable"}


def test_trt_ep_setup_derives_the_profile_from_the_deployment(mlp, tmp_path):
    recipe = Recipe(benchmark={"batch_sizes": [1, 8]})
    options, (engines, timing), facts = ort_gpu.trt_ep_setup(mlp, Precision.fp16, recipe, tmp_path, {"x": [2, 4]})
    assert options["trt_profile_min_shapes"] == "x:1x4" and options["trt_profile_opt_shapes"] == "x:2x4"
    assert options["trt_profile_max_shapes"] == "x:8x4"
    assert engines.is_dir() and timing.is_dir() and not any(engines.iterdir())
    assert facts["layer_precisions"].startswith("not inspected")


def test_an_engine_cache_runs_only_on_the_gpu_that_built_it():
    built = {"gpu_name": "NVIDIA H200", "compute_capability": "9.0"}
    assert trt_cache_mismatch(built, dict(built)) is None
    assert "rebuild here" in trt_cache_mismatch(built, {"gpu_name": "NVIDIA L4", "compute_capability": "8.9"})
    assert "no GPU" in trt_cache_mismatch(built, {"gpu_name": None, "compute_capability": None})


def test_the_ep_writes_into_a_private_copy_never_into_the_artifact(tmp_path):
    """The TensorRT EP rewrites engine and profile files when shapes leave the profile; the artifact's are hashed."""
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    engine, profile, timing = (artifact / n for n in ("ort-trt_1_0_sm90.engine", "ort-trt_1_0_sm90.profile",
                                                      "TensorrtExecutionProvider_cache_sm90.timing"))
    for path, data in ((engine, b"plan"), (profile, b"ranges"), (timing, b"tactics")):
        path.write_bytes(data)
    seen = {}

    def create(dirs):
        engine_dir, timing_dir = dirs
        seen.update(engine=sorted(p.name for p in engine_dir.iterdir()),
                    timing=sorted(p.name for p in timing_dir.iterdir()),
                    root=engine_dir.parent)
        (engine_dir / engine.name).write_bytes(b"rebuilt for a larger batch")  # what the EP may do
        return "session"

    factory = SessionFactory(create, TrtEpCache([engine, profile], [timing]))
    assert factory() == "session"
    assert seen["engine"] == [engine.name, profile.name] and seen["timing"] == [timing.name]
    assert engine.read_bytes() == b"plan"  # the artifact's file is untouched
    factory.close()
    assert not seen["root"].exists()


def test_cache_files_are_collected_flat(tmp_path):
    (tmp_path / "e").mkdir()
    (tmp_path / "t").mkdir()
    for name in ("ort-trt_9_0_sm90.engine", "ort-trt_9_0_sm90.profile", "notes.txt"):
        (tmp_path / "e" / name).write_bytes(b"x")
    (tmp_path / "t" / "TensorrtExecutionProvider_cache_sm90.timing").write_bytes(b"x")
    cache = TrtEpCache.collect(tmp_path / "e", tmp_path / "t")
    assert [p.name for p in cache.files] == ["ort-trt_9_0_sm90.engine", "ort-trt_9_0_sm90.profile",
                                             "TensorrtExecutionProvider_cache_sm90.timing"]


# --- the I/O-binding runner: real ORT I/O binding, on "cpu" here and on "cuda" where a GPU EP runs ---

def _session_on(device: str, model: Path):
    if device == "cpu":
        return create_session(model, [CPU_PROVIDER], threads=1)
    return create_session(model, [CUDA_PROVIDER], threads=1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda_ep])])
def test_iobinding_runner_returns_what_session_run_returns_and_times_three_stages(mlp, device):
    reference = create_session(mlp, [CPU_PROVIDER], threads=1)
    runner = OrtIoBindingRunner(lambda: _session_on(device, mlp), name="io", device=device)
    with runner:
        meta = runner.get_input_metadata(use_numpy_dtypes=False)
        assert list(meta) == ["x"]
        for batch in (1, 3, 1):  # the dynamic batch axis: new device buffers each call
            feed = _feed(batch, seed=batch)
            got = runner.infer(feed)
            want = reference.run(None, feed)[0]
            assert list(got) == ["y"] and got["y"].dtype == np.float32 and isinstance(got["y"], np.ndarray)
            np.testing.assert_allclose(got["y"], want, rtol=1e-5, atol=1e-5)
            stages = runner.last_stage_ms
            assert tuple(stages) == STAGE_KEYS and all(v >= 0 for v in stages.values()) and stages["compute_ms"] > 0
            # The whole call, stages included (inference_time is what infer() cost the caller).
            assert runner.last_inference_time() * 1e3 >= sum(stages.values()) * 0.999


def test_iobinding_runner_reports_compute_only_when_asked(mlp):
    runner = OrtIoBindingRunner(lambda: _session_on("cpu", mlp), device="cpu", compute_only=True)
    with runner:
        runner.infer(_feed(2))
        assert runner.last_inference_time() == pytest.approx(runner.last_stage_ms["compute_ms"] / 1e3)


def test_stage_times_are_read_through_the_cast_wrapper(mlp):
    inner = OrtIoBindingRunner(lambda: _session_on("cpu", mlp), device="cpu")
    wrapped = CastInputsRunner(inner, {"x": "float32"})
    with wrapped:
        wrapped.infer(_feed(2), check_inputs=False)
        assert last_stage_ms(wrapped) == inner.last_stage_ms and tuple(last_stage_ms(wrapped)) == STAGE_KEYS
    assert last_stage_ms(object()) is None


def test_iobinding_runner_closes_its_session_factory(mlp):
    closed = []

    class Factory:
        def __call__(self):
            return _session_on("cpu", mlp)

        def close(self):
            closed.append(True)

    with OrtIoBindingRunner(Factory(), device="cpu") as runner:
        runner.infer(_feed(1))
    assert closed == [True]


# --- StageClock ----------------------------------------------------------------------------------

def test_stage_clock_reads_after_each_synchronization_and_in_order():
    syncs = []
    clock = StageClock.host(sync=lambda: syncs.append(1))
    clock.start()
    for stage in ("h2d", "compute", "d2h"):
        clock.lap(stage)
    stages = clock.finish()
    assert tuple(stages) == STAGE_KEYS and len(syncs) == 4  # start and every lap waited for queued work first
    clock.start()
    with pytest.raises(ValueError, match="out of order"):
        clock.lap("compute")
    clock.start()
    clock.lap("h2d")
    with pytest.raises(ValueError, match="every call must lap"):
        clock.finish()


def test_the_stage_table_takes_per_stage_medians():
    calls = [{"h2d_ms": 1.0, "compute_ms": 5.0, "d2h_ms": 0.5}, {"h2d_ms": 3.0, "compute_ms": 4.0, "d2h_ms": 0.7},
             {"h2d_ms": 2.0, "compute_ms": 9.0, "d2h_ms": 0.6}, {}]
    assert median_stage_ms(calls) == {"h2d_ms": 2.0, "compute_ms": 5.0, "d2h_ms": 0.6}
    with pytest.raises(ValueError):
        median_stage_ms([{}])


# --- on a GPU with onnxruntime-gpu ----------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda_ep
def test_cuda_ep_build_runs_every_node_on_cuda(mlp, tmp_path):
    backend = OnnxRuntimeBackend([CUDA_PROVIDER])
    compiled = backend.compile(mlp, Precision.fp32, Recipe(), tmp_path / "work")
    assert compiled.device == "cuda:0" and compiled.providers[0] == CUDA_PROVIDER
    assert compiled.settings["cpu_ep_fallback"] == "disabled" and compiled.settings["provider_options"][CUDA_PROVIDER][
        "use_tf32"] == "0"
    counts = compiled.settings["nodes_by_provider"]
    assert counts is None or set(counts) == {CUDA_PROVIDER}
    feed = _feed(4)
    with backend.runner(compiled) as runner:
        got = runner.infer(feed)["y"]
        assert isinstance(runner, OrtIoBindingRunner) and tuple(runner.last_stage_ms) == STAGE_KEYS
    want = create_session(mlp, [CPU_PROVIDER], threads=1).run(None, feed)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@needs_cuda_ep
def test_cuda_ep_refuses_a_model_with_cpu_only_nodes_unless_allowed(tmp_path):
    """ai.onnx.ml ops have CPU kernels only: strict, the build names them; allowed, they are recorded."""
    from onnx import TensorProto, helper

    from tests.conftest import make_model

    model = save(make_model([helper.make_node("Relu", ["x"], ["h"]),
                             helper.make_node("Binarizer", ["h"], ["y"], domain="ai.onnx.ml", threshold=0.5)],
                            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
                            domains=["ai.onnx.ml"]), tmp_path / "binarizer.onnx")
    with pytest.raises(Unsupported, match=r"does not take every node: .*Binarizer.* would run on the CPU EP"):
        create_session(model, [CUDA_PROVIDER], threads=1)
    session = create_session(model, [CUDA_PROVIDER], threads=1, allow_cpu_nodes=True)
    counts = ort_gpu.nodes_by_provider(session)
    assert session.get_providers()[0] == CUDA_PROVIDER and (counts is None or counts.get(CPU_PROVIDER) == 1)


@pytest.mark.gpu
@needs_trt_ep
def test_trt_ep_build_keeps_its_caches_as_artifact_files(mlp, tmp_path):
    backend = OnnxRuntimeBackend([TENSORRT_PROVIDER])
    compiled = backend.compile(mlp, Precision.fp32, Recipe(benchmark={"batch_sizes": [1, 4]}), tmp_path / "work",
                               shapes={"x": [4, 4]})
    names = {p.name for p in compiled.extra_files}
    recorded = compiled.settings["trt_engine_cache"]
    assert any(n.endswith(".engine") for n in recorded["engine_files"]) and names == {*recorded["engine_files"],
                                                                                      *recorded["timing_files"]}
    before = {p: p.read_bytes() for p in compiled.extra_files}
    feed = _feed(4)
    with backend.runner(compiled) as runner:
        got = runner.infer(feed)["y"]
        runner.infer(_feed(2))  # inside the profile: no rebuild needed
    assert {p: p.read_bytes() for p in compiled.extra_files} == before  # the EP wrote into its private copy
    want = create_session(mlp, [CPU_PROVIDER], threads=1).run(None, feed)[0]
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
