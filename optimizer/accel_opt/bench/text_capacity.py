"""Memory per text length: what a batch of texts costs at each length bucket, and the batch that fits a budget.

A transformer's activations grow with batch x tokens (attention's scores with the square of the tokens), so one
batch size cannot be right for every length: a batch of 8 at 16 tokens costs a fraction of 8 at 256. Each length is
measured on a fresh runner at the deployed batch (the process's peak memory over two calls, the first compiling
where a backend compiles per shape), and the memory per row above the loaded model is taken as linear in the batch: the
recommended batch for a length is the largest whose estimated peak (the process before loading, plus per concurrent
session its model and its batch's rows) fits the budget.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from polygraphy.backend.base import BaseRunner
from pydantic import BaseModel, Field

from accel_opt.bench.memory import peak_rss_mib, reset_peak_rss_mib

MAX_RECOMMENDED_BATCH = 1024


class LengthBucket(BaseModel):
    length: int  # tokens per text
    batch_measured: int
    peak_memory_mib: float  # the process at this length x batch, one runner
    model_memory_mib: float  # what loading the runner added
    per_row_mib: float  # the memory one more text of this length adds (see length_capacity)
    before_mib: float = Field(default=0.0, exclude=True)  # the process before the runner loaded
    # the largest batch fitting the budget at the concurrency (0: none); None: no budget
    recommended_batch: int | None = None


def lengths_to_measure(max_length: int, buckets: list[int]) -> list[int]:
    """The bucket lengths up to max_length (and max_length), or halvings of max_length down to 16 tokens."""
    if buckets:
        return sorted({b for b in buckets if b <= max_length} | {max_length})
    lengths, length = [], max_length
    while length >= 16:
        lengths.append(length)
        length //= 2
    return sorted(lengths) or [max_length]


def length_capacity(make_runner: Callable[[], BaseRunner], inputs: dict[str, int], vocab_size: int, lengths: list[int],
                    batch: int, concurrency: int, budget_mib: float | None) -> list[LengthBucket]:
    """`inputs`: the token inputs, each with what it is filled with (-1: random token ids below `vocab_size`)."""
    rng = np.random.default_rng(0)
    rows = []
    for length in lengths:
        feed = {name: (rng.integers(0, vocab_size, (batch, length)) if fill < 0 else np.full((batch, length), fill))
                .astype(np.int64) for name, fill in inputs.items()}
        runner = make_runner()
        before = reset_peak_rss_mib()
        with runner:
            loaded = reset_peak_rss_mib()
            runner.infer(feed, check_inputs=False)  # a compile per shape happens here
            runner.infer(feed, check_inputs=False)
            peak = peak_rss_mib()
        rows.append(LengthBucket(length=length, batch_measured=batch, peak_memory_mib=round(peak, 1),
                                 model_memory_mib=round(max(loaded - before, 0.0), 1),
                                 per_row_mib=max(peak - loaded, 0.0) / batch, before_mib=before))
    longest = max(rows, key=lambda r: r.length)
    for row in rows:
        # Freed memory a short length reuses does not raise the peak: never estimate below the longest length's
        # memory per row scaled down linearly (attention grows faster than linearly, so this stays on the safe side).
        row.per_row_mib = round(max(row.per_row_mib, longest.per_row_mib * row.length / longest.length), 3)
        if budget_mib is not None:  # each concurrent session holds its model and its batch's activations
            room = (budget_mib - row.before_mib) / concurrency - row.model_memory_mib
            row.recommended_batch = int(max(0, min(MAX_RECOMMENDED_BATCH, room // row.per_row_mib))) \
                if row.per_row_mib > 0 else MAX_RECOMMENDED_BATCH
    return rows
