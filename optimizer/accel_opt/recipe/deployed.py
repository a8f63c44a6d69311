"""What an artifact folder records and `accel-opt run` reads back: image preprocessing, the text stage, and the
answers written per input (postprocess). Read at run time; every other recipe key is used by the build only."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from accel_opt.recipe.types import _Strict


class Preprocessing(_Strict):
    """How image files in --data become tensors (ImageNet-style by default)."""

    input: str | None = None  # default: the model's first input
    resize: int = Field(default=256, ge=1)  # shorter side, pixels
    crop: int = Field(default=224, ge=1)  # center crop, pixels
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    dtype: Literal["float32", "float16", "uint8"] = "float32"
    # Normalize and lay out inside the model: it takes the host's uint8 HWC crops (4x fewer bytes to move,
    # the arithmetic on the backend); decoding, resizing and cropping stay on the host. The gate checks the
    # fused model on those crops against the reference on the host pipeline's floats.
    fused: bool = False
    # JPEG decoding at 1/2, 1/4 or 1/8 scale in the DCT domain (Pillow's draft mode) when the image is at
    # least that much larger than `resize`: several times less decoding work. The pixels differ from a full
    # decode, so the gate runs the candidate on draft-decoded inputs against the reference on full decodes.
    draft_decode: bool = False

    def host_part(self) -> Preprocessing:
        """What the host still does: decode, resize, crop, as uint8 HWC when the rest is fused."""
        return self.model_copy(update={"dtype": "uint8", "layout": "NHWC", "fused": False}) if self.fused else self


class TextStage(_Strict):
    """How text inputs become token tensors: a Hugging Face `tokenizers` file (tokenizer.json), truncation and
    which tokenizer output feeds which model input. The artifact folder carries the tokenizer file."""

    # tokenizer.json; null: the factory's `tokenizer_file` hint, else tokenizer.json next to the model.
    tokenizer: str | None = None
    max_length: int = Field(default=128, ge=1)  # tokens, special tokens included
    # Off: a text longer than max_length is rejected (into the errors file) instead of cut.
    truncation: bool = True
    truncation_side: Literal["right", "left"] = "right"
    field: str = "text"  # the JSON Lines field, or the Parquet/CSV column, holding the text
    # model input -> tokenizer output (ids, attention_mask, type_ids); inputs the model lacks are left out.
    inputs: dict[str, Literal["ids", "attention_mask", "type_ids"]] = Field(default_factory=lambda: {
        "input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"})
    # A batch is padded to its longest text, rounded up to the next of these lengths when given: fewer distinct
    # shapes for backends that compile per shape. Empty: pad to the longest text exactly.
    length_buckets: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)
    # Texts the job reads ahead and sorts by length before batching: more similar lengths in a batch, still
    # answered in input order, memory bounded by this many texts (their token ids, a few KiB each).
    sort_window: int = Field(default=2048, ge=1)
    # A batch takes texts in length order while rows x padded length stays within this many tokens (and always at
    # least the deployed batch): short texts run in large batches, long ones in the deployed batch. null: the
    # deployed batch x max_length, the shape the capacity run measured. Static-batch models keep their batch.
    batch_tokens: int | None = Field(default=None, ge=1)


class EmbeddingOutput(_Strict):
    """An embedding per input: `output` (default: the first) pooled over the tokens (`mean` over the attention mask,
    `cls`: the first token, `none`: the model pools itself), L2-normalized unless `normalize` is false."""

    output: str | None = None
    pooling: Literal["none", "mean", "cls"] = "none"
    normalize: bool = True
    file: Literal["npy", "parquet"] = "npy"  # also written at the end of a job: PREDICTIONS.embeddings.npy|.parquet


class Postprocess(_Strict):
    """What `accel-opt run` writes per input. `topk`: a classifier's `top1` and `topk` [[class, score], ...]
    from `output` (default: the first), scores softmax-ed unless `softmax` is false; with `labels`, also `label` (the
    top-1 class's name) and `topk_labels`. `embedding`: the input's
    vector (see EmbeddingOutput). Without a postprocess section every output is saved to one .npz per input."""

    topk: int | None = Field(default=None, ge=1)
    output: str | None = None
    softmax: bool = True
    # class names by index (a Hugging Face folder's id2label): written beside the indexes
    labels: list[str] | None = None
    embedding: EmbeddingOutput | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> Postprocess:
        if (self.topk is None) == (self.embedding is None):
            raise ValueError("give one of topk (a classifier) or embedding")
        return self
