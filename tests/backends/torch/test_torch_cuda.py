"""The PyTorch runner on the CPU and on CUDA: the same h2d/compute/d2h stage keys as the CPU benchmark,
autocast fp16/bf16, torch.compile, and a one-line Unsupported (exit 4) where torch has no CUDA.

CPU tests run for real here; CUDA tests are skipped with the reason torch gives.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from accel_opt.backends.gpu_timing import STAGE_KEYS, last_stage_ms  # noqa: E402
from accel_opt.backends.torch.runner import TorchRunner  # noqa: E402
from accel_opt.errors import Unsupported, UsageError  # noqa: E402
from accel_opt.graph.inspect import TensorSpec  # noqa: E402

CUDA = torch.cuda.is_available()
WHY_NOT = "a CPU-only build" if torch.version.cuda is None else "no device"
needs_cuda = pytest.mark.skipif(not CUDA, reason=f"needs a CUDA GPU visible to torch {torch.__version__} ({WHY_NOT})")
INPUTS = [TensorSpec(name="x", dtype="float32", shape=["batch", 64])]


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).eval()


def _feed(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((batch, 64)).astype(np.float32)}


def _eager(model: torch.nn.Module, feed: dict[str, np.ndarray]) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.from_numpy(feed["x"])).numpy()


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# --- on the CPU ------------------------------------------------------------------------------------

def test_cpu_runner_times_the_same_stages_as_the_benchmark_table():
    model = _mlp()
    runner = TorchRunner(model, INPUTS, ["logits"], threads=1)
    before = torch.get_num_threads()
    with runner:
        for batch in (1, 4):
            feed = _feed(batch, seed=batch)
            got = runner.infer(feed)["logits"]
            np.testing.assert_array_equal(got, _eager(model, feed))
            stages = runner.last_stage_ms
            assert tuple(stages) == STAGE_KEYS and stages["compute_ms"] > 0 and min(stages.values()) >= 0
            assert runner.last_inference_time() * 1e3 >= sum(stages.values()) * 0.999
            assert last_stage_ms(runner) == stages
        assert runner.peak_memory_mib is None  # CUDA memory only
    assert torch.get_num_threads() == before


def test_compute_only_timing_when_asked():
    with TorchRunner(_mlp(), INPUTS, ["logits"], threads=1, compute_only=True) as runner:
        runner.infer(_feed(2))
        assert runner.last_inference_time() == pytest.approx(runner.last_stage_ms["compute_ms"] / 1e3)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cpu_autocast_runs_reduced_precision_and_returns_float32(precision):
    model, feed = _mlp(), _feed(8)
    reference = _eager(model, feed)
    with TorchRunner(model, INPUTS, ["logits"], threads=1, precision=precision) as runner:
        got = runner.infer(feed)["logits"]
    assert got.dtype == np.float32
    assert not np.array_equal(got, reference)  # the matmuls ran in the reduced type, not in fp32
    assert _cosine(got, reference) > 0.999


def test_torch_compile_gives_the_eager_outputs():
    model, feed = _mlp(), _feed(3)
    with TorchRunner(model, INPUTS, ["logits"], threads=1, compile=True, compile_backend="eager") as runner:
        got = runner.infer(feed)["logits"]
        assert tuple(runner.last_stage_ms) == STAGE_KEYS
    np.testing.assert_allclose(got, _eager(model, feed), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"device": "gpu"}, "device must be 'cpu' or 'cuda"),
    ({"precision": "int8"}, "precision must be one of fp32, fp16, bf16"),
])
def test_bad_devices_and_precisions_are_usage_errors(kwargs, message):
    with pytest.raises(UsageError, match=message):
        TorchRunner(_mlp(), INPUTS, ["logits"], **kwargs)


@pytest.mark.skipif(CUDA, reason="torch sees a CUDA GPU here: nothing to refuse")
def test_cuda_without_cuda_is_one_line_exit_4_naming_what_is_missing():
    runner = TorchRunner(_mlp(), INPUTS, ["logits"], device="cuda")
    with pytest.raises(Unsupported) as caught:
        runner.activate()
    message = str(caught.value)
    assert caught.value.exit_code == 4 and "\n" not in message and not runner.is_active
    assert "torch.cuda.is_available() is False" in message and torch.__version__ in message
    if torch.version.cuda is None:
        assert "a CPU-only build" in message
    assert "install a CUDA build of torch" in message


# --- on a CUDA GPU --------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
def test_cuda_fp32_matches_the_cpu_with_tf32_off_and_times_with_events():
    model, feed = _mlp(), _feed(16)
    reference = _eager(model, feed)
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    runner = TorchRunner(_mlp(), INPUTS, ["logits"], device="cuda")
    with runner:
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        for batch in (16, 2, 16):  # pinned buffers re-made when the shape changes
            feed = _feed(batch, seed=batch)
            got = runner.infer(feed)["logits"]
            np.testing.assert_allclose(got, _eager(model, feed), rtol=1e-4, atol=1e-5)
            stages = runner.last_stage_ms
            assert tuple(stages) == STAGE_KEYS and stages["compute_ms"] > 0 and stages["h2d_ms"] > 0
        assert runner.peak_memory_mib is not None and runner.peak_memory_mib > 0
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == flags
    assert reference.shape == (16, 10)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_autocast_is_close_to_fp32(precision):
    model, feed = _mlp(), _feed(32)
    with TorchRunner(model, INPUTS, ["logits"], device="cuda", precision=precision) as runner:
        got = runner.infer(feed)["logits"]
        assert tuple(runner.last_stage_ms) == STAGE_KEYS
    assert got.dtype == np.float32 and _cosine(got, _eager(_mlp(), feed)) > 0.999
    assert next(model.parameters()).device.type == "cpu"  # the caller's module is handed back where it was


@pytest.mark.gpu
@needs_cuda
def test_cuda_torch_compile_matches_eager():
    model, feed = _mlp(), _feed(8)
    with TorchRunner(model, INPUTS, ["logits"], device="cuda", compile=True) as runner:
        runner.infer(feed)  # compiles
        got = runner.infer(feed)["logits"]
    np.testing.assert_allclose(got, _eager(_mlp(), feed), rtol=1e-3, atol=1e-4)
