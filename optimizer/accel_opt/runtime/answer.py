"""How both engines of `accel-opt run` (runtime/local and runtime/ray) answer: an input path read into the feed dict
the deployment takes, or rejected (`Reader`); a batch of feed dicts run at the deployed batch and cut back into
per-input outputs (`infer_batch`); a batch of texts tokenized, batched by length and answered (`answer_texts`).
One code for both, so a cluster job answers exactly what the local job answers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from accel_opt.data import Sample, check_sample, concat_samples, read_npz, split_output
from accel_opt.errors import InputRejected, UsageError, first_line
from accel_opt.preprocess.images import preprocess_image, read_image
from accel_opt.preprocess.postprocess import embedding_record
from accel_opt.preprocess.text import TextEncoder, TextItem, embeddings, token_count
from accel_opt.runtime import Deployment
from accel_opt.runtime.inputs import NPZ, local_path
from accel_opt.runtime.output import Writer


class Reader:
    """Turns one input path into a feed dict the deployment takes (one batch row), or rejects it."""

    def __init__(self, deployment: Deployment):
        self.config = deployment.config
        self.specs = list(self.config.inputs)
        self.seconds: list[float] = []  # per input read (list.append is atomic across threads)

    def read(self, path: str) -> Sample:
        start = time.perf_counter()
        try:
            return self._read(path)
        finally:
            self.seconds.append(time.perf_counter() - start)

    def _read(self, path: str) -> Sample:
        file = Path(local_path(path) or path)
        if not file.is_file():
            raise InputRejected("not found" if not file.exists() else "not a regular file")
        if file.suffix != NPZ and self.config.preprocessing is None:
            raise InputRejected(f"not a .npz feed dict ({file.suffix or 'no suffix'}): the artifact takes .npz feed "
                                "dicts")
        sample = self._npz(file) if file.suffix == NPZ else self._image(file)
        for spec in self.specs:
            want = list(spec.shape_used)
            if spec.batch_axis is not None and self.config.output_batch_axes:
                want[spec.batch_axis] = 1  # one row per input; the job batches them
            if list(sample[spec.name].shape) != want:
                raise InputRejected(f"{spec.name} has shape {list(sample[spec.name].shape)}, the artifact takes {want}")
        return sample

    def _npz(self, file: Path) -> Sample:
        sample = read_npz(file, self.specs)  # names, dtypes, ranks and sizes checked from the headers first
        check_sample(sample, self.specs)
        return sample

    def _image(self, file: Path) -> Sample:
        pre = self.config.preprocessing
        if len(self.specs) != 1 and pre.input is None:
            raise UsageError("the artifact has several inputs; its preprocessing names none for images")
        spec = next(s for s in self.specs if s.name == (pre.input or self.specs[0].name))
        # The build's preprocessing exactly (draft decoding only when the recipe chose it: the gate checked
        # the candidate on draft-decoded inputs then).
        return {spec.name: preprocess_image(read_image(file, pre), pre.host_part())}


def infer_batch(runner, deployment: Deployment, batch: list[tuple[str, Sample]],
                batch_size: int) -> list[dict[str, np.ndarray]]:
    """Per-input outputs of one batch: padded to the deployed batch (static compiles take exactly that
    many rows), run once, cut back along the output axes the build's gate found."""
    config = deployment.config
    samples = [sample for _, sample in batch]
    if batch_size == 1:
        return [dict(runner.infer(s, check_inputs=False)) for s in samples]
    padded = samples + [samples[-1]] * (batch_size - len(samples))
    try:
        feed = concat_samples(padded, config.batch_axes)
    except ValueError:  # an unbatched input (a sample rate) differs within the batch: one by one
        return [dict(runner.infer(s, check_inputs=False)) for s in samples]
    outputs = runner.infer(feed, check_inputs=False)
    per_input: list[dict[str, np.ndarray]] = [{} for _ in samples]
    for name, array in outputs.items():
        parts = split_output(np.asarray(array), config.output_batch_axes.get(name, 0), [1] * batch_size)
        for out, part in zip(per_input, parts):
            out[name] = part
    return per_input


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
