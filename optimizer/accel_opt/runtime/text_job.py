"""`accel-opt run` over text: texts read from files, tokenized in windows, batched by length, answered in input order.

Padding every text to the longest allowed length spends most of a corpus of short texts' compute on padding. The job
reads `text.sort_window` texts ahead, tokenizes them in one call (the Rust tokenizer runs the batch in parallel),
sorts them by token count, and runs batches that grow to the token budget (`Padding.plan`), each padded only to its
own longest text (or the next `text.length_buckets` length where the backend compiles per shape). The answers are written back in input order, one write per window, so memory
stays bounded by the window and the output reads as if no sorting happened. The gate checked exactly this: the
candidate on padded batches against the reference on each text alone.

`answer_texts` is the one answering function of both engines (the local job and the Ray actors).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from accel_opt.artifact.folder import write_bytes
from accel_opt.errors import InputRejected, first_line
from accel_opt.preprocess.text import (
    TextEncoder,
    TextItem,
    embeddings,
    token_count,
)
from accel_opt.runtime import Deployment
from accel_opt.runtime.output import Outputs, Writer, embedding_record


@dataclass
class TextStats:
    """What the text stages cost and saved, summed over a job."""

    tokens: int = 0  # the texts' own tokens
    padded_tokens: int = 0  # tokens computed: rows x padded length of their batch
    max_length_tokens: int = 0  # what padding every text to max_length would have computed
    truncated: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {"tokenize": 0.0, "compute": 0.0})

    def add(self, other: TextStats) -> None:
        self.tokens += other.tokens
        self.padded_tokens += other.padded_tokens
        self.max_length_tokens += other.max_length_tokens
        self.truncated += other.truncated
        for stage, seconds in other.seconds.items():
            self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds


def answer_texts(runner, deployment: Deployment, writer: Writer, items: list[TextItem]
                 ) -> tuple[list[tuple[dict[str, Any], bytes | None] | str], TextStats]:
    """Per item, in order: (its answer's fields, the .npz bytes its record names or None), or the reason it is
    rejected. Batches as `Padding.plan` groups them by length, each padded to its own longest text."""
    encoder, stage, config = deployment.text_encoder, deployment.config.text, deployment.config
    stats = TextStats()
    answers: list[Any] = [item.error or "" for item in items]
    readable = [i for i, item in enumerate(items) if item.error is None]
    start = time.perf_counter()
    encoded = encoder.encode([items[i].text for i in readable])
    stats.seconds["tokenize"] += time.perf_counter() - start
    feeds: list[tuple[int, dict[str, np.ndarray], bool]] = []
    for i, (feed, reason, truncated) in zip(readable, encoded):
        if feed is None:
            answers[i] = reason
        else:
            feeds.append((i, feed, truncated))
    batch_size = deployment.batch_size if config.output_batch_axes else 1
    padding = deployment.padding
    start = time.perf_counter()
    for group in padding.plan([token_count(feed) for _, feed, _ in feeds], batch_size):
        rows = [feeds[g][1] for g in group]
        members = [feeds[g] for g in dict.fromkeys(group)]  # a static batch's filler rows are answered once
        feed = padding.batch(rows)
        try:
            outputs = runner.infer(feed, check_inputs=False)
        except Exception as exc:  # noqa: BLE001 - the runtimes' own errors: these texts are rejected, the job goes on
            for i, _, _ in members:
                answers[i] = f"inference failed ({first_line(exc)})"
            continue
        length = feed[next(iter(feed))].shape[1]
        ids = [items[i].id for i, _, _ in members]
        for row, answer in enumerate(_row_answers(deployment, writer, encoder, outputs, feed, length, members, ids)):
            i, own, truncated = members[row]
            tokens = token_count(own)
            answers[i] = ({"tokens": tokens, **({"truncated": True} if truncated else {}), **answer[0]}, answer[1])
            stats.tokens += tokens
            stats.truncated += truncated
        stats.padded_tokens += len(rows) * length
        stats.max_length_tokens += len(rows) * stage.max_length
    stats.seconds["compute"] += time.perf_counter() - start
    return answers, stats


def _row_answers(deployment: Deployment, writer: Writer, encoder: TextEncoder, outputs: dict[str, np.ndarray],
                 feed: dict[str, np.ndarray], length: int, members: list,
                 ids: list[str]) -> list[tuple[dict[str, Any], bytes | None]]:
    """Each member row's answer: its embedding (pooled over the batch with the batch's mask), its top-k, or its outputs
    (cut to its own tokens where an output has the batch's token axis)."""
    config = deployment.config
    post = config.postprocess
    first_output = config.outputs[0].name
    if post is not None and post.embedding is not None:
        name = post.embedding.output or first_output
        mask = feed.get(encoder.mask_input) if encoder.mask_input else None
        vectors = embeddings(outputs[name], mask, post.embedding)
        return [(embedding_record(vectors[row]), None) for row in range(len(members))]
    answers = []
    for row, (_, own, _) in enumerate(members):
        per_row = {}
        for name, array in outputs.items():
            part = np.asarray(array)[row:row + 1]
            if part.ndim >= 2 and part.shape[1] == length:  # a per-token output: this text's tokens only
                part = part[:, :token_count(own)]
            per_row[name] = part
        answers.append(writer.answer(ids[row], per_row))
    return answers


def predict_texts(deployment: Deployment, items: list[TextItem], outputs: Outputs,
                  on_progress: Callable[[int, int], None] | None) -> tuple[tuple[int, int], dict[str, float], TextStats]:
    """The local job over `items`: ((predicted, rejected), stage seconds, text stats)."""
    config = deployment.config
    window = max(config.text.sort_window, deployment.batch_size)
    writer = Writer(outputs, config.postprocess, config.outputs[0].name)
    predicted = rejected = 0
    stats = TextStats()
    written = 0.0
    with writer, deployment.runner() as runner:
        for start in range(0, len(items), window):
            chunk = items[start:start + window]
            answers, chunk_stats = answer_texts(runner, deployment, writer, chunk)
            stats.add(chunk_stats)
            begin = time.perf_counter()
            ids, records = [], []
            for item, answer in zip(chunk, answers):
                if isinstance(answer, str):
                    writer.reject(item.id, answer)
                    rejected += 1
                    continue
                record, npz = answer
                if npz is not None:  # the .npz first, then the line naming it
                    outputs.outputs_dir.mkdir(exist_ok=True)
                    write_bytes(Path(record["outputs"]), npz)
                ids.append(item.id)
                records.append(record)
            predicted += writer.predict_records(ids, records)
            written += time.perf_counter() - begin
            if on_progress:
                on_progress(predicted + rejected, len(items))
    stages = {**{k: round(v, 4) for k, v in stats.seconds.items()}, "write": written}
    return (predicted, rejected), stages, stats


def write_embeddings_file(outputs: Outputs, post) -> Path | None:
    """Every embedding the predictions file holds (all runs of it, resumed ones too), in its order, as one file:
    PREDICTIONS.embeddings.npy (float32 [n, dim]; row i is the i-th answered line) or .parquet (input, embedding).
    Written under a temporary name and renamed: whole or absent."""
    if post is None or post.embedding is None:
        return None
    ids, vectors = [], []
    with open(outputs.predictions, encoding="utf-8") as lines:
        for line in lines:
            record = json.loads(line)
            ids.append(record["input"])
            vectors.append(np.asarray(record["embedding"], dtype=np.float32))
    suffix = post.embedding.file
    target = outputs.predictions.with_name(f"{outputs.predictions.stem}.embeddings.{suffix}")
    temporary = target.with_name(f".{target.name}.tmp")
    matrix = np.stack(vectors) if vectors else np.zeros((0, 0), np.float32)
    if suffix == "npy":
        with open(temporary, "wb") as f:
            np.save(f, matrix)
    else:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise InputRejected("postprocess.embedding.file parquet needs pyarrow: pip install pyarrow") from None
        dim = matrix.shape[1] if matrix.size else 0
        column = pa.FixedSizeListArray.from_arrays(pa.array(matrix.ravel(), pa.float32()), dim)
        pq.write_table(pa.table({"input": ids, "embedding": column}), temporary)
    temporary.replace(target)
    return target
