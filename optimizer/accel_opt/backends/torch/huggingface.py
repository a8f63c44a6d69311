"""A Hugging Face model folder as an input: `accel-opt build ./folder` (config.json, weights in safetensors or
pytorch_model.bin, and its tokenizer or image-processor files, as `save_pretrained` writes them).

Why this route, and no exporter written here per architecture: Optimum's exporter (optimum-onnx) is the maintained
one, but its 0.1.0 requires transformers < 4.58, while this project resolves transformers 5.x (sentence-transformers
6 needs it). What transformers 5 and torch 2 offer instead is their own: transformers' Auto class for the task builds
the model from the folder (local files only, never the folder's own Python: `trust_remote_code` stays off), and the
build exports it with torch.export like any factory, checks the export against PyTorch on the samples, and judges
every candidate against the PyTorch module. What is read from the folder, and where it goes:
- the task: `--task`, else the config's architecture (`...ForSequenceClassification`: text-classification,
  `...ForImageClassification`: image-classification, an encoder without a head: feature-extraction);
- `id2label`: the label names `run` writes beside the class indexes;
- the longest input: the position embeddings, the tokenizer's `model_max_length` and sentence-transformers'
  `max_seq_length`, whichever is least, caps the text stage's `max_length`;
- the tokenizer (`tokenizer.json`, made from the slow tokenizer's files where a folder has only those), which the
  artifact carries; the image processor's resize, crop and normalization, which become the recipe's preprocessing;
- sentence-transformers' pooling (`1_Pooling/config.json`) and normalization (`modules.json`), done inside the
  exported module, as `SentenceTransformer.encode` does.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel_opt.backends.torch.factory import ModuleFactory
from accel_opt.backends.torch.runner import require_torch
from accel_opt.errors import InputRejected, Unsupported, UsageError, first_line
from accel_opt.files import install_line, sha256_file, user_cache_dir

log = logging.getLogger(__name__)

TASKS = {  # task -> (transformers' Auto class, the bundled recipe that builds it)
    "text-classification": ("AutoModelForSequenceClassification", "text-classifier"),
    "feature-extraction": ("AutoModel", "text-encoder"),
    "image-classification": ("AutoModelForImageClassification", "image-classifier"),
}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
HEADLESS = re.compile(r"[A-Za-z0-9]+(?<!LMHead)(?<!Head)Model")  # BertModel, not GPT2LMHeadModel: hidden states pooled
UNBOUNDED_LENGTH = 100_000  # tokenizers without a limit record model_max_length as 1e30


def is_hf_folder(path: str | Path) -> bool:
    """A folder holding config.json: a Hugging Face model folder (anything else there is checked when it is read)."""
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


@dataclass(frozen=True)
class HfFolder:
    path: Path
    config: dict[str, Any]
    task: str

    @property
    def architecture(self) -> str:
        return (self.config.get("architectures") or [self.config.get("model_type", "unknown")])[0]

    @property
    def recipe_name(self) -> str:
        return TASKS[self.task][1]

    @property
    def is_text(self) -> bool:
        return self.task != "image-classification"

    @property
    def labels(self) -> list[str] | None:
        """id2label in class order; None for a model without a head or with only transformers' LABEL_i defaults."""
        names = self.config.get("id2label") or {}
        if self.task == "feature-extraction" or not names:
            return None
        labels = [str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(len(names))]
        return None if labels == [f"LABEL_{i}" for i in range(len(labels))] else labels

    @property
    def num_labels(self) -> int:
        return len(self.config.get("id2label") or {}) or int(self.config.get("num_labels", 2))

    @property
    def max_length(self) -> int | None:
        """The most tokens the model takes: the least of what its config, tokenizer and sentence-transformers say."""
        limits = []
        if positions := self.config.get("max_position_embeddings"):
            # RoBERTa-style models number positions from padding_idx + 1: two of their positions are never used
            offset = 2 if "roberta" in str(self.config.get("model_type",
                                                           "")) or self.config.get("model_type") == "camembert" else 0
            limits.append(int(positions) - offset)
        tokenizer_config = _json(self.path / "tokenizer_config.json") or {}
        if isinstance(length := tokenizer_config.get("model_max_length"),
                      int | float) and 0 < length < UNBOUNDED_LENGTH:
            limits.append(int(length))
        if isinstance(length := (_json(self.path / "sentence_bert_config.json") or {}).get("max_seq_length"), int):
            limits.append(length)
        return min(limits) if limits else None

    @property
    def text_inputs(self) -> list[str]:
        """The token inputs the exported module takes, in its forward's order. token_type_ids only for models with
        more than one segment type (BERT, ALBERT, ELECTRA); RoBERTa (one type) and DistilBERT (none) leave it out."""
        return ["input_ids",
                "attention_mask"] + (["token_type_ids"] if self.config.get("type_vocab_size", 0) > 1 else [])

    @property
    def pooling(self) -> tuple[str, bool]:
        """(mean | cls | max, normalize) of a feature extractor: sentence-transformers' modules, else mean pooling."""
        modules = _json(self.path / "modules.json") or []
        normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules if isinstance(m, dict))
        pooling_path = next((m.get("path") for m in modules if isinstance(m, dict)
                             and str(m.get("type", "")).endswith("Pooling")), None)
        pooling = _json(self.path / pooling_path / "config.json") if isinstance(pooling_path, str) else None
        if not pooling:
            return "mean", normalize
        for mode in ("cls", "max", "mean"):
            if pooling.get(f"pooling_mode_{mode}_token" if mode == "cls" else f"pooling_mode_{mode}_tokens"):
                return mode, normalize
        chosen = sorted(key for key, on in pooling.items() if key.startswith("pooling_mode") and on is True)
        raise Unsupported(f"{self.path}: sentence-transformers pooling {', '.join(chosen) or 'none'}: accel-opt pools "
                          "by "
                          "mean, cls or max tokens")

    def image_preprocessing(self) -> dict[str, Any]:
        """The image processor's settings as the recipe's preprocessing: resize the shorter side, centre-crop,
        normalize. A processor that resizes to a fixed height x width (ViT) is taken as a square crop of that size: the
        fp32 reference and every candidate see the same pixels, so the gate judges like with like."""
        processor = _json(self.path / "preprocessor_config.json") or {}
        size, crop_size = processor.get("size") or 224, processor.get("crop_size") or {}
        side = size if isinstance(size, int) else size.get("shortest_edge") or size.get("height") or 224
        crop = (crop_size if isinstance(crop_size, int) else crop_size.get("height")) or side
        # ConvNeXt-style processors resize to side / crop_pct, then crop `side`; the others crop_size out of `side`
        resize = round(side / processor["crop_pct"]) if processor.get("crop_pct") and not crop_size else side
        pre: dict[str, Any] = {"resize": int(max(resize, crop)), "crop": int(crop)}
        if processor.get("do_normalize", True):
            pre["mean"] = list(processor.get("image_mean") or (0.485, 0.456, 0.406))
            pre["std"] = list(processor.get("image_std") or (0.229, 0.224, 0.225))
        else:
            pre["mean"], pre["std"] = [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]
        if processor.get("do_rescale", True) is False:  # pixel values stay 0..255: undo the pipeline's /255
            pre["std"] = [s / 255.0 for s in pre["std"]]
            pre["mean"] = [m * 255.0 for m in pre["mean"]]
        return pre

    def tokenizer_file(self) -> Path:
        """tokenizer.json: the folder's own, else one saved from the slow tokenizer's files by transformers (in this
        user's cache, keyed by those files' hashes)."""
        own = self.path / "tokenizer.json"
        if own.is_file():
            return own
        sources = sorted(p for p in self.path.iterdir() if p.is_file() and p.suffix in (".txt", ".json", ".model"))
        key = sha256_file(self.path / "config.json")[:8] + "".join(sha256_file(p)[:8] for p in sources)
        cached = user_cache_dir("hf-tokenizers", key, "tokenizer.json")
        if not cached.is_file():
            transformers = _transformers()
            try:
                tokenizer = transformers.AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
                backend = tokenizer.backend_tokenizer
            except Exception as exc:  # noqa: BLE001 - no tokenizer files, or one transformers cannot convert
                raise InputRejected(f"{self.path}: no tokenizer.json, and transformers cannot make one from the "
                                    "folder's "
                                    f"tokenizer files ({first_line(exc)}); give --tokenizer FILE") from None
            cached.parent.mkdir(parents=True, exist_ok=True)
            backend.save(str(cached))
        return cached


def read_hf_folder(path: str | Path, task: str | None = None, weights: bool = True) -> HfFolder:
    """The folder's config and task; refusals name the route: no weights (unless not `weights`: an exported ONNX
    model's folder) or an unreadable config (exit 3), a task or architecture this cannot build (exit 4)."""
    folder = Path(path)
    config = _json(folder / "config.json")
    if not isinstance(config, dict):
        raise InputRejected(f"{folder}/config.json: not a JSON object (a Hugging Face model folder's config)")
    if weights and not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise InputRejected(f"{folder}: a Hugging Face folder without weights (expected "
                            f"{' or '.join(WEIGHT_FILES[::2])})")
    if config.get("auto_map") and weights:
        raise Unsupported(f"{folder}: the model's code is in the folder (auto_map); accel-opt never runs a folder's "
                          "own "
                          "Python: export it to ONNX yourself, or give a factory FILE.py:FACTORY")
    if task is not None and task not in TASKS:
        raise UsageError(f"--task {task}: accel-opt builds {', '.join(TASKS)}")
    architecture = (config.get("architectures") or [""])[0]
    inferred = ("text-classification" if architecture.endswith("ForSequenceClassification") else
                "image-classification" if architecture.endswith("ForImageClassification") else
                "feature-extraction" if HEADLESS.fullmatch(architecture) or not architecture else None)
    if (task or inferred) is None:
        raise Unsupported(f"{folder}: {architecture} is not a task accel-opt builds from a Hugging Face folder "
                          f"({', '.join(TASKS)}); give --task to build it as one of them")
    return HfFolder(folder, config, task or inferred)


def hf_factory(hf: HfFolder) -> ModuleFactory:
    """A ModuleFactory over the folder: the task's module, with the export hints and tokenizer a build reads."""

    def factory() -> Any:
        return _module(hf)

    if hf.is_text:
        factory.input_dtypes = {name: "int64" for name in hf.text_inputs}
        factory.dynamic = {name: {1: "sequence"} for name in hf.text_inputs}
        factory.tokenizer_file = hf.tokenizer_file
    factory.output_names = ["sentence_embedding" if hf.task == "feature-extraction" else "logits"]
    factory.label = f"{hf.architecture} ({hf.task}, {hf.path.name})"  # named when it cannot be exported
    return ModuleFactory(str(hf.path), factory)


def _module(hf: HfFolder) -> Any:
    torch = require_torch()
    transformers = _transformers()
    auto_class = getattr(transformers, TASKS[hf.task][0])
    try:
        model = auto_class.from_pretrained(str(hf.path), local_files_only=True, trust_remote_code=False,
                                           torch_dtype=torch.float32)
    except (ValueError, KeyError) as exc:  # a model_type or architecture this transformers does not know
        raise Unsupported(f"{hf.path}: transformers {transformers.__version__} cannot build {hf.architecture} for "
                          f"{hf.task} ({first_line(exc)})") from None
    except OSError as exc:
        raise InputRejected(f"{hf.path}: the weights do not load ({first_line(exc)})") from None
    text_logits, image_logits, sentence_embedding = _task_modules()
    if hf.task == "image-classification":
        return image_logits(model).eval()
    if hf.task == "text-classification":
        return text_logits(model, hf.text_inputs).eval()
    return sentence_embedding(model, hf.text_inputs, *hf.pooling).eval()


def _transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: nothing is looked up online
    try:
        import transformers
        from transformers.utils import logging as transformers_logging
    except ImportError:
        install = install_line("huggingface", "torch==2.13.0")
        raise Unsupported(f"a Hugging Face folder needs transformers: {install}") from None
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    return transformers


def _json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputRejected(f"{path}: not readable JSON ({first_line(exc)})") from None


@functools.cache
def _task_modules() -> tuple[type, type, type]:
    """The modules a folder's model is wrapped in, for export (classes made once, after torch is imported: torch is an
    optional extra)."""
    torch = require_torch()

    class TextLogits(torch.nn.Module):
        """forward(input_ids, attention_mask[, token_type_ids]) -> logits."""

        def __init__(self, model: Any, names: list[str]) -> None:
            super().__init__()
            self.model, self.names = model, names

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any = None) -> Any:
            return self.model(**_tokens(self.names, input_ids, attention_mask, token_type_ids)).logits

    class ImageLogits(torch.nn.Module):
        """forward(pixel_values) -> logits."""

        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model = model

        def forward(self, pixel_values: Any) -> Any:
            return self.model(pixel_values=pixel_values).logits

    class SentenceEmbedding(torch.nn.Module):
        """forward(input_ids, attention_mask[, token_type_ids]) -> the pooled (and normalized) sentence embedding."""

        def __init__(self, model: Any, names: list[str], pooling: str, normalize: bool) -> None:
            super().__init__()
            self.model, self.names, self.pooling, self.normalize = model, names, pooling, normalize

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any = None) -> Any:
            hidden = self.model(**_tokens(self.names, input_ids, attention_mask, token_type_ids)).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            elif self.pooling == "max":  # padding never wins the max
                pooled = (hidden - (1 - mask) * 1e9).amax(dim=1)
            else:
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2.0, dim=1) if self.normalize else pooled

    return TextLogits, ImageLogits, SentenceEmbedding


def _tokens(names: list[str], *tensors: Any) -> dict[str, Any]:
    return {name: tensor for name, tensor in zip(names, tensors) if tensor is not None}
