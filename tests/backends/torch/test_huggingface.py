"""Hugging Face model folders as inputs: made here, offline, with `save_pretrained` (tiny random models, a WordPiece
tokenizer trained on Python's own documentation), then built with one command, as a user's folder would be."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch", reason="Hugging Face folders need the torch extra")
transformers = pytest.importorskip("transformers", reason="Hugging Face folders need transformers")

from accel_opt import runtime  # noqa: E402
from accel_opt.builder.pipeline import build  # noqa: E402
from accel_opt.builder.sources import recipe_for  # noqa: E402
from accel_opt.cli import main  # noqa: E402
from accel_opt.recipe.load import load_recipe  # noqa: E402
from accel_opt.runtime.local.job import run_job  # noqa: E402
from tests.conftest import FAST_BENCH  # noqa: E402

LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def _texts(count: int, skip: int = 0) -> list[str]:
    from pydoc_data.topics import topics

    lines = [" ".join(line.split()) for text in topics.values() for line in text.splitlines() if len(line.split()) > 4]
    return lines[skip: skip + count]


def _tokenizer(max_length: int):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(_texts(3000), trainers.WordPieceTrainer(
        vocab_size=400, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                                model_max_length=max_length)


def _bert_config(**extra):
    return transformers.BertConfig(vocab_size=400, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=64, **extra)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A text classifier (3 named labels, 64 positions), a sentence-transformers encoder (mean pooling, normalized,
    max_seq_length 48) and a ViT image classifier (4 labels, 32 px), each as save_pretrained writes it."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    tokenizer = _tokenizer(512)
    made = {"text": root / "text-classifier", "sentences": root / "sentence-encoder", "vit": root / "vit"}
    config = _bert_config(max_position_embeddings=64, num_labels=3, id2label=LABELS,
                          label2id={v: k for k, v in LABELS.items()})
    transformers.BertForSequenceClassification(config).save_pretrained(made["text"])
    tokenizer.save_pretrained(made["text"])
    transformers.BertModel(_bert_config(max_position_embeddings=128)).save_pretrained(made["sentences"])
    tokenizer.save_pretrained(made["sentences"])
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (made["sentences"] / "modules.json").write_text(json.dumps(modules))
    (made["sentences"] / "1_Pooling").mkdir()
    (made["sentences"] / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}))
    (made["sentences"] / "2_Normalize").mkdir()
    (made["sentences"]
     / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48, "do_lower_case": False}))
    vit = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2,
                                 intermediate_size=64, num_labels=4, id2label={i: f"kind-{i}" for i in range(4)})
    transformers.ViTForImageClassification(vit).save_pretrained(made["vit"])
    (made["vit"] / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "ViTImageProcessor", "do_resize": True, "size": {"height": 32, "width": 32},
        "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_rescale": True}))
    texts = root / "texts.txt"
    texts.write_text("\n".join(_texts(120, skip=3000)) + "\n")
    made["texts"] = texts
    return made


def _fp32(name: str):
    return load_recipe(name).with_overrides(precision="fp32", backend="onnxruntime", benchmark=FAST_BENCH)


def test_a_text_classifier_folder_builds_with_its_labels_tokenizer_and_length(folders, tmp_path, monkeypatch):
    recipe, notes = recipe_for(folders["text"], _fp32("text-classifier"), None, has_data=True)
    assert recipe.text.max_length == 64 and max(recipe.text.length_buckets) == 64  # the model's 64 positions
    assert recipe.postprocess.labels == list(LABELS.values()) and recipe.postprocess.topk == 3
    assert any("BertForSequenceClassification, text-classification" in note for note in notes)
    result = build(folders["text"], _fp32("text-classifier"), data_dir=folders["texts"], out_dir=tmp_path / "out")
    assert result.signed_off, result.failures
    folder = Path(result.artifact_dir)
    config = json.loads((folder / "resource_config.json").read_text())
    assert config["text"]["tokenizer"] == "tokenizer.json" and (folder / "tokenizer.json").is_file()
    assert [i["name"] for i in config["inputs"]] == ["input_ids", "attention_mask", "token_type_ids"]
    queries = tmp_path / "q.txt"
    queries.write_text("a sentence about classes\nanother one, about functions\n")
    out = tmp_path / "p.jsonl"
    run_job(runtime.load(folder), [queries], out)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["label"] for line in lines] == [LABELS[line["top1"]] for line in lines]
    assert all(len(line["topk_labels"]) == 3 for line in lines)
    # what it answers is the PyTorch model's answer
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folders["text"]))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(folders["text"])).eval()
    with torch.no_grad():
        logits = model(**tokenizer(queries.read_text().splitlines(), return_tensors="pt", padding=True)).logits
    assert [line["top1"] for line in lines] == logits.argmax(-1).tolist()
    compared = _cli("compare", folder, folder)  # no ONNX file of its own to compare against: the flag that gives one
    assert compared.exit_code == 2 and "exported inside the build: give --reference" in compared.stderr, compared.stderr
    monkeypatch.chdir(folder.parent)  # signoff.md's snippet, as written, tokenizes a text and runs it
    snippet = (folder / "signoff.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(snippet, "signoff.md", "exec"), namespace)  # noqa: S102 - the file this build wrote
    assert namespace["outputs"]["logits"].shape == (1, 3)


def test_the_python_api_takes_the_folders_task_recipe_as_it_runs_here(folders):
    recipe, notes = recipe_for(folders["text"], None, None, has_data=False)  # int8 needs texts to calibrate
    assert (recipe.name, recipe.precision.value, recipe.backend.value) == ("text-classifier", "fp32", "onnxruntime")
    assert any("needs --data to calibrate" in note for note in notes)
    recipe, notes = recipe_for(folders["text"], None, None, has_data=True)
    assert (recipe.precision.value, recipe.backend.value) == ("int8", "onnxruntime")


def test_a_sentence_transformers_folder_pools_as_sentence_transformers_does(folders, tmp_path):
    recipe, _ = recipe_for(folders["sentences"], _fp32("text-encoder"), None, has_data=True)
    assert recipe.text.max_length == 48  # sentence_bert_config's max_seq_length: less than the 128 positions
    result = build(folders["sentences"], recipe, data_dir=folders["texts"], out_dir=tmp_path / "out")
    assert result.signed_off, result.failures
    texts = _texts(6, skip=4000)
    queries = tmp_path / "q.txt"
    queries.write_text("\n".join(texts) + "\n")
    run_job(runtime.load(result.artifact_dir), [queries], tmp_path / "e.jsonl")
    ours = np.array([json.loads(line)["embedding"] for line in (tmp_path / "e.jsonl").read_text().splitlines()])
    sentence_transformers = pytest.importorskip("sentence_transformers")
    theirs = sentence_transformers.SentenceTransformer(str(folders["sentences"]), device="cpu").encode(texts)
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


def test_an_image_classifier_folder_takes_its_processors_preprocessing_and_names_its_classes(folders, photos, tmp_path):
    recipe, _ = recipe_for(folders["vit"], _fp32("image-classifier"), None, has_data=True)
    pre = recipe.preprocessing
    assert (pre.resize, pre.crop, pre.mean, pre.std) == (32, 32, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert recipe.shapes == {"pixel_values": [1, 3, 32, 32]} and recipe.postprocess.topk == 4
    assert all(k < 4 for metric in recipe.accuracy.task_metrics for k in metric.min_agreement)
    result = build(folders["vit"], recipe.with_overrides(**{"selection.target_batch_size": 4}), data_dir=photos,
                   out_dir=tmp_path / "out")
    assert result.signed_off, result.failures
    out = tmp_path / "p.jsonl"
    run_job(runtime.load(result.artifact_dir), [photos], out)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 12 and all(line["label"] == f"kind-{line['top1']}" for line in lines)


@pytest.mark.slow
def test_one_command_builds_a_folder_keeping_the_fastest_build_that_signs_off(folders, tmp_path):
    done = CliRunner().invoke(main, ["build", str(folders["text"]), "--data", str(folders["texts"]), "--out",
                                     str(tmp_path / "out"), "--json"])
    assert done.exit_code == 0, done.output
    assert "--precision auto --backend auto" in done.stderr
    assert json.loads(done.stdout)["selection"]["winner"] is not None


def _cli(*args):
    return CliRunner().invoke(main, [*map(str, args)])


def test_what_is_not_a_model_says_the_route_in_one_line(folders, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "model.pt").write_bytes(b"\x80\x02pickled")
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00")
    cases = [(tmp_path / "empty", 3, "a folder without config.json"),
             (tmp_path / "model.pt", 3, "FILE.py:FACTORY"),
             (tmp_path / "model.safetensors", 3, "give the Hugging Face folder")]
    for model, code, message in cases:
        done = _cli("build", model, "--precision", "int8", "--out", tmp_path / "out")
        assert done.exit_code == code and message in done.stderr and done.stderr.count("\n") == 1, done.stderr
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    done = _cli("build", no_weights, "--out", tmp_path / "out")
    assert done.exit_code == 3 and "without weights" in done.stderr, done.stderr


def test_an_architecture_or_task_that_cannot_be_built_is_exit_4_naming_it(folders, tiny_cnn_path, tmp_path):
    generator = tmp_path / "gpt"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16,
                                                         vocab_size=50)).save_pretrained(generator)
    done = _cli("build", generator, "--precision", "fp32", "--out", tmp_path / "out")
    assert done.exit_code == 4 and "GPT2LMHeadModel" in done.stderr and done.stderr.count("\n") == 1, done.stderr
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({"architectures": ["MyModel"],
                                                    "auto_map": {"AutoModel": "m.MyModel"}}))
    (remote / "model.safetensors").write_bytes(b"")
    done = _cli("build", remote, "--precision", "fp32", "--out", tmp_path / "out")
    assert done.exit_code == 4 and "never runs a folder's own Python" in done.stderr, done.stderr
    done = _cli("build", tiny_cnn_path, "--task", "text-classification", "--out", tmp_path / "out")
    assert done.exit_code == 2 and "--task is for Hugging Face model folders" in done.stderr, done.stderr


def test_export_takes_a_folder_and_says_its_own_exit_codes(folders, tmp_path):
    done = _cli("export", folders["vit"], "-o", tmp_path / "vit.onnx")
    assert done.exit_code == 0 and "verified against PyTorch" in done.stdout, done.output
    import onnx

    inputs = onnx.load(str(tmp_path / "vit.onnx")).graph.input
    assert [i.name for i in inputs] == ["pixel_values"]
    assert [d.dim_value for d in inputs[0].type.tensor_type.shape.dim][1:] == [3, 32, 32]
    helped = _cli("export", "--help").stdout
    assert "exported, and ONNX Runtime's outputs match PyTorch's" in helped and "signed off" not in helped


def test_an_onnx_model_beside_its_config_takes_the_folders_recipe_labels_and_length(folders, tmp_path):
    """Optimum's layout (model.onnx beside config.json and the tokenizer): the ONNX model is built, and what the
    config says fits the recipe as for the folder itself."""
    import shutil

    exported = tmp_path / "exported"
    exported.mkdir()
    done = _cli("export", folders["text"], "-o", exported / "model.onnx")
    assert done.exit_code == 0, done.output
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folders["text"] / name, exported / name)
    recipe, notes = recipe_for(exported / "model.onnx", None, None, has_data=True)
    assert recipe.name == "text-classifier" and recipe.text.max_length == 64
    assert recipe.postprocess.labels == list(LABELS.values())
    result = build(exported / "model.onnx", recipe.with_overrides(precision="fp32", benchmark=FAST_BENCH),
                   data_dir=folders["texts"], out_dir=tmp_path / "out")
    assert result.signed_off, result.failures


def test_a_pooling_accel_opt_does_not_do_is_exit_4_naming_it(folders, tmp_path):
    import shutil

    from accel_opt.backends.torch.huggingface import read_hf_folder
    from accel_opt.errors import Unsupported

    folder = Path(shutil.copytree(folders["sentences"], tmp_path / "last-token"))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True}))
    with pytest.raises(Unsupported,
                       match="pooling pooling_mode_lasttoken: accel-opt pools by mean, cls or max") as caught:
        _ = read_hf_folder(folder).pooling
    assert caught.value.exit_code == 4
