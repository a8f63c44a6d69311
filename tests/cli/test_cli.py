"""The command a user and a CI pipeline type: exit codes, one-line errors, JSON, nothing half-written."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from accel_opt.cli import main
from accel_opt.files import install_line

from ..conftest import FAST_BENCH, matmul_model, save


@pytest.fixture()
def fast_recipe_file(tmp_path):
    path = tmp_path / "fast.yaml"
    bench = "\n".join(f"  {k}: {v}" for k, v in FAST_BENCH.items())
    path.write_text(f"name: fast\naccuracy:\n  synthetic_samples: 4\nbenchmark:\n{bench}\n")
    return path


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_build_json_for_ci(tiny_cnn_path, fast_recipe_file, tmp_path):
    result = _run("build", tiny_cnn_path, "--recipe", fast_recipe_file, "--out", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    for key in ("artifact_dir", "signed_off", "precision", "backend", "exit_code", "latency_p50_ms",
                "throughput_per_s"):
        assert key in payload
    assert payload["signed_off"] is True and payload["exit_code"] == 0 and payload["precision"] == "fp32"
    assert payload["headline"][0]["batch_size"] == 1
    assert (tmp_path / "out").joinpath(payload["artifact_dir"].split("/")[-1], "manifest.json").is_file()


def test_build_table_for_people(tiny_cnn_path, fast_recipe_file, tmp_path):
    result = _run("build", tiny_cnn_path, "--recipe", fast_recipe_file, "--out", tmp_path, "--shapes",
                  "image:2x3x32x32")
    assert result.exit_code == 0, result.stderr
    assert "SIGNED OFF" in result.stdout and "artifacts:" in result.stdout
    # off a terminal (this log): a line per stage that did its work, as it ends, on stdout before the result; no
    # live line's control codes; stderr holds nothing but a failed build's error line
    stages = [line.split()[:2] for line in result.stdout.splitlines()[:7]]
    assert stages == [[name, "ok"] for name in ("load", "cleanup", "compile", "accuracy", "benchmark",
                                                "verdict", "reports")]
    assert "\x1b" not in result.stdout and result.stderr == ""
    quiet = _run("build", tiny_cnn_path, "--recipe", fast_recipe_file, "--out", tmp_path, "--shapes", "image:2x3x32x32",
                 "--quiet")
    assert quiet.exit_code == 0 and quiet.stderr == "" and quiet.stdout.startswith("verdict: signed off")
    assert len(quiet.stdout.splitlines()) == 1, quiet.stdout


def _bad_models(tmp_path):
    (tmp_path / "empty.onnx").write_bytes(b"")
    (tmp_path / "noise.onnx").write_bytes(np.random.default_rng(0).bytes(2048))
    (tmp_path / "lfs.onnx").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 1\n")
    return {"missing": tmp_path / "none.onnx", "directory": tmp_path, "empty": tmp_path / "empty.onnx",
            "noise": tmp_path / "noise.onnx", "lfs": tmp_path / "lfs.onnx"}


@pytest.mark.parametrize("case", ["missing", "directory", "empty", "noise", "lfs"])
def test_bad_model_exit_3_one_line_nothing_written(tmp_path, fast_recipe_file, case):
    model = _bad_models(tmp_path)[case]
    out = tmp_path / "out"
    result = _run("build", model, "--recipe", fast_recipe_file, "--out", out)
    assert result.exit_code == 3
    assert result.stderr.startswith("accel-opt: error:") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr
    assert not out.exists() or not any(out.rglob("manifest.json"))


@pytest.mark.parametrize(
    "extra, code, message",
    [
        (["--shapes", "nope:1x4"], 2, "unknown input 'nope'"),
        (["--shapes", "x:1x4x4"], 2, "rank 3 given"),
        (["--shapes", "x:1xfour"], 2, "must be integers"),
        (["--precision", "bf16"], 4, "no bfloat16 kernels"),
        (["--precision", "int8"], 2, "needs --data"),
        (["--recipe", "no-such-recipe"], 2, "recipe not found"),
        (["--precision", "fp64"], 2, "Invalid value"),
    ],
)
def test_usage_and_unsupported_errors(tmp_path, extra, code, message):
    model = save(matmul_model(), tmp_path / "m.onnx")
    result = _run("build", model, "--out", tmp_path / "out", *extra)
    assert result.exit_code == code, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("manifest.json"))


def test_bad_data_folder_exit_3(tmp_path, fast_recipe_file):
    model = save(matmul_model(), tmp_path / "m.onnx")
    data = tmp_path / "data"
    data.mkdir()
    np.savez(data / "a.npz", x=np.zeros((1, 4), np.float16))
    result = _run("build", model, "--recipe", fast_recipe_file, "--data", data, "--out", tmp_path / "out", "--json")
    assert result.exit_code == 3
    assert "dtype float16" in result.stderr
    assert json.loads(result.stdout) == {"exit_code": 3, "signed_off": False,
                                         "error": result.stderr.split("error: ", 1)[1].strip(), "artifact_dir": None}


def test_bad_recipe_exit_2(tmp_path):
    model = save(matmul_model(), tmp_path / "m.onnx")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("benchmark:\n  warmup: 3\n")
    result = _run("build", model, "--recipe", recipe)
    assert result.exit_code == 2 and "benchmark.warmup" in result.stderr


def _tensorrt_here() -> bool:
    from accel_opt.backends.tensorrt.backend import TensorRtBackend

    return bool(TensorRtBackend().available())


def test_help_lists_exit_codes():
    result = _run("build", "--help")
    assert result.exit_code == 0 and "70 internal error" in result.stdout
    assert "7  built and correct, but no measured benefit" in result.stdout
    assert "runs FILE.py, so build only factories you trust" in " ".join(result.stdout.split())


@pytest.mark.skipif(_tensorrt_here(), reason="TensorRT and a GPU are present: the build would run")
def test_tensorrt_backend_without_gpu_is_one_line_exit_4(tmp_path):
    model = save(matmul_model(), tmp_path / "m.onnx")
    result = _run("build", model, "--backend", "tensorrt", "--out", tmp_path / "out")
    assert result.exit_code == 4 and "backend tensorrt is unavailable here" in result.stderr
    assert install_line("tensorrt") in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_json_says_what_the_verdict_rests_on(tiny_cnn_path, fast_recipe_file, tmp_path):
    result = _run("build", tiny_cnn_path, "--recipe", fast_recipe_file, "--out", tmp_path / "out", "--json")
    payload = json.loads(result.stdout)
    assert payload["data"] == {"source": "synthetic", "path": None, "synthetic": True, "samples": 8,
                               "evaluation_samples": 4, "calibration_samples": 0, "steering_samples": 4,
                               "eval_path": None,
                               "held_out_max": None}
    assert payload["verdict"]["outcome"] == "signed off"
    assert payload["samples_needed"] is None and payload["data_samples_needed"] is None
    assert "batch 8" in payload["evaluated"] and "model.onnx" in payload["evaluated"]
    manifest = json.loads((tmp_path / "out" / payload["artifact_dir"].split("/")[-1] / "manifest.json").read_text())
    assert manifest["data"]["synthetic"] is True and manifest["data"]["evaluation_samples"] == 4


def test_require_data_refuses_synthetic_sign_offs(tiny_cnn_path, tmp_path):
    result = _run("build", tiny_cnn_path, "--require-data", "--out", tmp_path / "out", "--json")
    assert result.exit_code == 2 and "--require-data" in result.stderr
    assert not (tmp_path / "out").exists()


def test_batch_axes_flag_is_parsed_and_checked(tmp_path):
    model = save(matmul_model(), tmp_path / "m.onnx")
    result = _run("build", model, "--batch-axes", "x:7", "--out", tmp_path / "out")
    assert result.exit_code == 2 and "--batch-axes x:7: the input has rank 2" in result.stderr
    result = _run("build", model, "--batch-axes", "x=0", "--out", tmp_path / "out")
    assert result.exit_code == 2 and "expected NAME:AXIS" in result.stderr


def test_junit_has_one_case_per_gate_check(tiny_cnn_path, fast_recipe_file, tmp_path):
    from xml.etree import ElementTree as ET

    junit = tmp_path / "reports" / "junit.xml"
    result = _run("build", tiny_cnn_path, "--recipe", fast_recipe_file, "--out", tmp_path / "out", "--junit", junit)
    assert result.exit_code == 0
    (suite,) = ET.parse(junit).getroot().findall("testsuite")
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert {"logits: error", "logits: per-sample", "logits: cosine", "logits: gain", "logits: finite"} <= set(cases)
    assert suite.get("failures") == "0" and suite.get("tests") == str(len(cases))
    assert all(c.find("failure") is None for c in cases.values())

    tight = tmp_path / "tight.yaml"  # fp32 optimized kernels against the unoptimized reference: not bit-exact
    tight.write_text(fast_recipe_file.read_text().replace("accuracy:\n",
                                                          "accuracy:\n  tolerances:\n    fp32: {atol: 0, rtol: 0}\n"))
    failed = _run("build", tiny_cnn_path, "--recipe", tight, "--out", tmp_path / "out", "--junit", junit)
    assert failed.exit_code == 1
    failing = [c for c in ET.parse(junit).getroot().iter("testcase") if c.find("failure") is not None]
    assert [c.get("name") for c in failing] == ["logits: absolute"]
    assert "beyond atol=0/rtol=0" in failing[0].find("failure").get("message")

    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"")
    errored = _run("build", broken, "--out", tmp_path / "out", "--junit", junit)
    assert errored.exit_code == 3
    (case,) = ET.parse(junit).getroot().iter("testcase")
    assert "model file is empty" in case.find("error").get("message")
