"""Text inputs: texts read from files (plain lines, JSON Lines, Parquet or CSV columns), tokenized with a Hugging Face
`tokenizers` file (the Rust tokenizer, batch-parallel, no download), grouped by length and padded per batch.

One text is one input, named `FILE:LINE` (1-based, .txt and .jsonl) or `FILE#ROW` (0-based, .parquet and .csv): the
name a prediction and a rejection carry, and the key of exactly-once and `--resume`. A text that cannot be answered
(not UTF-8, empty, a missing field, longer than `max_length` with truncation off) is an item with its reason, never
an exception: the job writes it to the errors file and goes on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from accel_opt.errors import InputRejected, UsageError, first_line
from accel_opt.recipe.deployed import EmbeddingOutput, TextStage

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet", ".csv")
LINE_SUFFIXES = (".txt", ".jsonl")  # one text per line; the others are tables read through pyarrow
TOKENIZER_FILE = "tokenizer.json"  # the name the tokenizer has in an artifact folder
PAD_MASK = 0  # attention masks and token type ids are padded with 0; token ids with the tokenizer's pad id


@dataclass(frozen=True)
class TextItem:
    id: str  # FILE:LINE or FILE#ROW; FILE alone when the whole file fails (a missing column)
    text: str | None
    error: str | None = None


def is_text_file(path: str | Path) -> bool:
    return Path(str(path)).suffix.lower() in TEXT_SUFFIXES


def read_texts(path: str, field: str) -> list[TextItem]:
    """Every text of one file, in file order, each with its id; unreadable ones carry their reason."""
    file = Path(path)
    if not file.is_file():
        return [TextItem(path, None, "not found" if not file.exists() else "not a regular file")]
    suffix = file.suffix.lower()
    if suffix in LINE_SUFFIXES:
        return _read_lines(path, file.read_bytes(), field if suffix == ".jsonl" else None)
    return _read_table(path, file, field)


def _read_lines(path: str, data: bytes, field: str | None) -> list[TextItem]:
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":  # the newline ending the last line does not start another input
        lines.pop()
    items = []
    for number, raw in enumerate(lines, start=1):
        name = f"{path}:{number}"
        try:
            line = raw.removesuffix(b"\r").decode("utf-8")
        except UnicodeDecodeError as exc:
            items.append(TextItem(name, None, f"not UTF-8 text (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})"))
            continue
        if field is not None:
            try:
                record = json.loads(line)
            except ValueError as exc:
                items.append(TextItem(name, None, f"not a JSON line ({first_line(exc)})"))
                continue
            if not isinstance(record, dict) or field not in record:
                items.append(TextItem(name, None, f"no field {field!r} in this JSON line"))
                continue
            line = record[field]
            if not isinstance(line, str):
                items.append(TextItem(name, None, f"field {field!r} is {type(line).__name__}, not a string"))
                continue
        items.append(_checked(name, line))
    return items


def _read_table(path: str, file: Path, column: str) -> list[TextItem]:
    try:
        import pyarrow.csv
        import pyarrow.parquet
    except ImportError:
        raise UsageError(f"{path}: Parquet and CSV inputs are read through pyarrow: pip install pyarrow") from None
    try:
        if file.suffix.lower() == ".parquet":
            names = pyarrow.parquet.read_schema(file).names
            table = pyarrow.parquet.read_table(file, columns=[column]) if column in names else None
        else:
            table = pyarrow.csv.read_csv(file, convert_options=pyarrow.csv.ConvertOptions(
                column_types={column: pyarrow.string()}))
            names = table.column_names
    except Exception as exc:  # noqa: BLE001 - pyarrow's own error types: the file is one rejected input
        return [TextItem(path, None, f"unreadable {file.suffix[1:]} file ({first_line(exc)})")]
    if table is None or column not in names:
        return [TextItem(path, None, f"no column {column!r} (columns: {', '.join(names)})")]
    values = table.column(column).to_pylist()
    return [_checked(f"{path}#{row}", value) if isinstance(value, str) else
            TextItem(f"{path}#{row}", None,
                     "no text (null)" if value is None else f"not a string ({type(value).__name__})")
            for row, value in enumerate(values)]


def _checked(name: str, text: str) -> TextItem:
    return TextItem(name, text) if text.strip() else TextItem(name, None, "empty text")


@dataclass(frozen=True)
class Padding:
    """How texts of several lengths share one batch: which texts go together (`plan`), and each input padded at the
    end with its value to the batch's longest text, rounded up to the next bucket length (`batch`). The job and the
    gate both batch through here, so the gate checks the batches the job runs."""

    values: dict[str, int]
    buckets: tuple[int, ...] = ()
    max_length: int = 0
    batch_tokens: int | None = None  # None: the deployed batch x max_length
    dynamic: bool = True  # False: the model takes exactly the deployed batch

    def batch(self, samples: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        return pad_batch(samples, self.values, self.buckets)

    def plan(self, lengths: list[int], batch_size: int) -> list[list[int]]:
        """Indices of texts grouped into batches in order of length (ties in input order). Dynamic batch: a batch
        grows while rows x padded length stays within the token budget, and always to `batch_size` rows. Static: groups
        of exactly `batch_size`, the last filled up by repeating its last text (its answers are dropped)."""
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        if not self.dynamic:
            groups = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
            if groups and len(groups[-1]) < batch_size:
                groups[-1] += [groups[-1][-1]] * (batch_size - len(groups[-1]))
            return groups
        budget = self.batch_tokens or batch_size * self.max_length
        groups, current = [], []
        for index in order:  # ascending: the text added is the batch's longest
            if current and len(current) >= batch_size and \
                    (len(current) + 1) * padded_length(lengths[index], list(self.buckets)) > budget:
                groups.append(current)
                current = []
            current.append(index)
        return groups + ([current] if current else [])

    def same_length(self, samples: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """`samples` all padded to the longest of them, one row each: feeds a benchmark can batch in any grouping."""
        padded = self.batch(samples)
        return [{name: array[i:i + 1] for name, array in padded.items()} for i in range(len(samples))]


def find_tokenizer(stage: TextStage, hint, model_path: Path, inputs) -> Path:
    """The text stage's tokenizer file: the recipe's path, else the factory's `tokenizer_file` hint (a path or a
    callable giving one), else tokenizer.json beside the model; checked against the model's inputs ([batch, tokens])."""
    candidates = [Path(stage.tokenizer)] if stage.tokenizer else [
        *([Path(hint() if callable(hint) else hint)] if hint else []), model_path.parent / TOKENIZER_FILE]
    path = next((c for c in candidates if c.is_file()), None)
    if path is None:
        raise UsageError(f"the recipe's text stage needs a tokenizer file; none at {', '.join(map(str, candidates))}: "
                         "give text.tokenizer in the recipe (or --tokenizer)")
    for spec in inputs:
        if len(spec.shape) != 2:
            raise UsageError(f"the text stage feeds [batch, tokens] inputs; {spec.name} has shape {spec.shape}")
    return path


class TextEncoder:
    """Texts -> one feed dict per text (batch 1, its own length), as the model's inputs take them."""

    def __init__(self, tokenizer_path: str | Path, stage: TextStage, input_dtypes: dict[str, str]):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UsageError("text inputs are tokenized with Hugging Face tokenizers: pip install tokenizers") from None
        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # noqa: BLE001 - the Rust library's own exception
            raise InputRejected(f"{tokenizer_path}: not a tokenizers file ({first_line(exc)})") from None
        self.stage = stage
        padding = self.tokenizer.padding
        self.pad_id = int(padding["pad_id"]) if padding else int(self.tokenizer.token_to_id("[PAD]") or 0)
        self.tokenizer.no_padding()  # batches are padded by the job, to their own longest text
        if stage.truncation:
            self.tokenizer.enable_truncation(stage.max_length, direction=stage.truncation_side)
        else:
            self.tokenizer.no_truncation()
        unknown = sorted(set(input_dtypes) - set(stage.inputs))
        if unknown:
            raise UsageError(f"model input {unknown[0]!r} is not a tokenizer output: map it in text.inputs "
                             f"(model input: ids, attention_mask or type_ids)")
        self.inputs = {name: (stage.inputs[name], np.dtype(dtype)) for name, dtype in input_dtypes.items()}
        self.padding = Padding({name: self.pad_id if field == "ids" else PAD_MASK for name,
                                (field, _) in self.inputs.items()},
                               tuple(stage.length_buckets), stage.max_length, stage.batch_tokens)

    def describe(self) -> str:
        stage = self.stage
        return (f"Text stage: {stage.max_length} tokens at most, "
                f"{'truncated' if stage.truncation else 'longer texts rejected'}; batches padded to their longest text"
                + (f", rounded up to {list(stage.length_buckets)}" if stage.length_buckets else "") + ".")

    @property
    def mask_input(self) -> str | None:
        return next((name for name, (field, _) in self.inputs.items() if field == "attention_mask"), None)

    def encode(self, texts: list[str]) -> list[tuple[dict[str, np.ndarray] | None, str | None, bool]]:
        """Per text: (its feed dict, None, whether truncation cut it) or (None, the reason it cannot be answered)."""
        out: list[tuple[dict[str, np.ndarray] | None, str | None, bool]] = []
        for enc in self.tokenizer.encode_batch(texts):
            if not self.stage.truncation and len(enc.ids) > self.stage.max_length:
                out.append((None, f"{len(enc.ids)} tokens, more than max_length {self.stage.max_length} "
                                  "(truncation is off)", False))
                continue
            feed = {name: np.asarray([getattr(enc, field)], dtype=dtype) for name,
                    (field, dtype) in self.inputs.items()}
            out.append((feed, None, bool(enc.overflowing)))
        return out


def token_count(sample: dict[str, np.ndarray]) -> int:
    return int(next(iter(sample.values())).shape[1])


def padded_length(longest: int, buckets: list[int]) -> int:
    """The batch's length: its longest text, rounded up to the next bucket when there are buckets."""
    return next((b for b in sorted(buckets) if b >= longest), longest)


def pad_batch(samples: list[dict[str, np.ndarray]], pad_values: dict[str, int],
              buckets: tuple[int, ...] = ()) -> dict[str, np.ndarray]:
    """One feed of `samples` (each [1, length]) padded at the end to the batch's length, stacked on axis 0."""
    length = padded_length(max(token_count(s) for s in samples), list(buckets))
    return {name: np.concatenate([np.pad(s[name], ((0, 0), (0, length - s[name].shape[1])), constant_values=pad)
                                  for s in samples]) for name, pad in pad_values.items()}


def embeddings(output: np.ndarray, mask: np.ndarray | None, post: EmbeddingOutput) -> np.ndarray:
    """[batch, dim] float32 vectors from a batch's output: pooled over the tokens as `post` says, L2-normalized."""
    array = np.asarray(output, dtype=np.float32)
    if post.pooling == "mean":
        if array.ndim != 3 or mask is None:
            raise UsageError(f"postprocess.embedding.pooling mean needs a [batch, tokens, dim] output and an attention "
                             f"mask input; the output has shape {list(array.shape)}")
        weights = mask.astype(np.float32)[:, :, None]
        array = (array * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
    elif post.pooling == "cls":
        array = array[:, 0]
    array = array.reshape(array.shape[0], -1)
    if post.normalize:
        array = array / np.maximum(np.linalg.norm(array, axis=1, keepdims=True), 1e-12)
    return array
