"""`accel-opt run` over text: texts read from files, tokenized in windows, batched by length, answered in input order.

Padding every text to the longest allowed length spends most of a corpus of short texts' compute on padding. The job
reads `text.sort_window` texts ahead, tokenizes them in one call (the Rust tokenizer runs the batch in parallel),
sorts them by token count, and runs batches that grow to the token budget (`Padding.plan`), each padded only to its
own longest text (or the next `text.length_buckets` length where the backend compiles per shape). The answers are
written back in input order, one write per window, so memory stays bounded by the window and the output reads as if no
sorting happened. The gate checked exactly this: the candidate on padded batches against the reference on each text
alone.

Batches are answered by runtime.answer.answer_texts, the one answering function of both engines (this job and the Ray
actors)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from accel_opt.errors import InputRejected
from accel_opt.preprocess.text import (
    TextItem,
)
from accel_opt.runtime import Deployment
from accel_opt.runtime.answer import TextStats, answer_texts
from accel_opt.runtime.output import Outputs, Writer


def predict_texts(deployment: Deployment, items: list[TextItem], outputs: Outputs,
                  on_progress: Callable[[int, int],
                                        None] | None) -> tuple[tuple[int, int], dict[str, float], TextStats]:
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
                    outputs.write_output(record["outputs"], npz)
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
    with os.fdopen(outputs.pinned.open(outputs.predictions.name, os.O_RDONLY), encoding="utf-8") as lines:
        for line in lines:
            record = json.loads(line)
            ids.append(record["input"])
            vectors.append(np.asarray(record["embedding"], dtype=np.float32))
    suffix = post.embedding.file
    target = outputs.predictions.with_name(f"{outputs.predictions.stem}.embeddings.{suffix}")
    matrix = np.stack(vectors) if vectors else np.zeros((0, 0), np.float32)
    if suffix == "npy":
        outputs.pinned.write_whole(target.name, lambda f: np.save(f, matrix))
    else:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise InputRejected("postprocess.embedding.file parquet needs pyarrow: pip install pyarrow") from None
        dim = matrix.shape[1] if matrix.size else 0
        column = pa.FixedSizeListArray.from_arrays(pa.array(matrix.ravel(), pa.float32()), dim)
        table = pa.table({"input": ids, "embedding": column})
        outputs.pinned.write_whole(target.name, lambda f: pq.write_table(table, f))
    return target
