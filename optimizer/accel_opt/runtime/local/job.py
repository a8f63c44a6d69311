"""`accel-opt run`: the batch job over a built artifact, what a batch service runs.

A bounded pipeline: reader threads decode and preprocess inputs (Pillow releases the GIL while it
decodes and resizes) -> batches of the deployed size -> inference -> a writer that appends one JSON
line per input, in input order. At most `window` inputs are in flight, whatever their number, so
memory stays bounded. An unreadable or wrong-shaped input goes to `<out>.errors.jsonl` with its
reason and the others are still predicted. An input given twice is answered once, at its first place.
Inputs are listed by one rule for both engines (`inputs.list_inputs`: folders recursively, globs, URIs).
Every line is written whole and flushed per batch; a run that is killed leaves at most a partial last
line without its newline, which `--resume` drops before it skips the inputs already answered. What the
job promises about its files (one writer, one artifact per file, whole lines) is in `output.py`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from pydantic import BaseModel

from accel_opt.data import Sample
from accel_opt.errors import InputRejected
from accel_opt.machine.cpu import available_cpus
from accel_opt.preprocess.postprocess import topk_record
from accel_opt.runtime import Deployment
from accel_opt.runtime.answer import Reader, infer_batch
from accel_opt.runtime.inputs import job_inputs, unique_inputs
from accel_opt.runtime.local.device import predict_on_device, refuse_host_decoding, takes_device_path
from accel_opt.runtime.output import Outputs, Writer, input_key

__all__ = ["JobSummary", "errors_path", "run_job", "topk_record"]



class TextSummary(BaseModel):
    """A text job's tokens: what padding each batch to its own longest text computed, against padding to max_length."""

    tokens: int  # the texts' own tokens (special tokens included)
    padded_tokens: int  # computed: rows x their batch's padded length
    max_length_tokens: int  # had every text been padded to the text stage's max_length
    padding_fraction: float  # of the computed tokens, the share that was padding
    padding_saved_fraction: float  # of max_length padding's tokens, the share this job did not compute
    truncated: int  # texts cut to max_length

    @classmethod
    def of(cls, stats) -> TextSummary:
        return cls(tokens=stats.tokens, padded_tokens=stats.padded_tokens, max_length_tokens=stats.max_length_tokens,
                   padding_fraction=round(1 - stats.tokens / stats.padded_tokens, 4) if stats.padded_tokens else 0.0,
                   padding_saved_fraction=round(1 - stats.padded_tokens / stats.max_length_tokens, 4)
                   if stats.max_length_tokens else 0.0, truncated=stats.truncated)


class JobSummary(BaseModel):
    artifact: str
    predictions: str
    errors: str
    inputs: int  # given (after expanding folders), each distinct path once
    duplicates: int = 0  # paths given more than once: answered once, at their first place
    predicted: int  # by this run
    rejected: int  # by this run, listed in the errors file
    skipped: int  # already answered (--resume)
    workers: int  # reader threads
    batch_size: int  # rows per inference call
    seconds: float  # the whole job, artifact loading included
    inputs_per_s: float
    # Where the time went. read: decoding and preprocessing, summed over the reader threads; the rest is
    # the inference thread's own time: waiting for read inputs, compute (batching included), writing.
    stages_seconds: dict[str, float]
    bottleneck: str  # "reading" when inference waited longer for inputs than it computed, else the slowest stage
    path: str = "host"  # "host": Pillow and numpy; "device": the torch artifact's tensor path; "text": tokenized texts
    device: str = "cpu"  # where the artifact runs
    host_decoded: int = 0  # device path: inputs the host decoded instead (not JPEG, or the device decoder refused them)
    host_decoded_reasons: dict[str, int] = {}  # why, with how many each
    exit_code: int  # 0: every input predicted; 3: some rejected
    text: TextSummary | None = None  # text jobs: tokens and padding
    # Its build did not sign the folder off: it ran only because the caller allowed it (--allow-not-signed-off).
    not_signed_off: bool = False
    signature: str = "unsigned"  # who signed the folder (runtime.Deployment.signature)


def errors_path(predictions: Path) -> Path:
    """PREDICTIONS.jsonl -> PREDICTIONS.errors.jsonl"""
    return Outputs(Path(predictions)).errors


def run_job(
    deployment: Deployment,
    inputs: Iterable[str | Path],
    predictions: str | Path,
    resume: bool = False,
    overwrite: bool = False,
    workers: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    started: float | None = None,
    strict_device: bool = False,
) -> JobSummary:
    """Predict every input with `deployment`; `on_progress(done, total)` after each batch. Refuses (exit 2)
    another job writing the same files, `--resume` over another artifact's answers, and an --out among the inputs.
    `strict_device`: a torch artifact's images must all be decoded on its device (see predict_on_device)."""
    started = started or time.perf_counter()
    inputs = list(inputs)
    outputs = Outputs(Path(predictions))
    config = deployment.config
    started_reading = time.perf_counter()
    given, texts = job_inputs(config, deployment.folder.name, inputs, remote=False)  # texts: each text is an input
    read_seconds = time.perf_counter() - started_reading
    outputs.refuse_bad_paths(inputs, resume, overwrite)
    if strict_device:
        refuse_host_decoding(deployment)
    text_stats = None
    with outputs.exclusive():
        answered = outputs.start(deployment.folder, deployment.identity, resume, overwrite)
        todo = unique_inputs(given)
        remaining = [p for p in todo if input_key(p) not in answered]
        host_decoded, job_path = {}, "host"
        if config.text is not None:
            from accel_opt.runtime.local.text import predict_texts, write_embeddings_file

            counts, stages, text_stats = predict_texts(deployment, [texts[input_key(p)] for p in remaining],
                                                       outputs, on_progress)
            stages = {"read": read_seconds, "wait_for_inputs": 0.0, **stages}
            workers, batch_size, job_path = 1, deployment.batch_size, "text"
            write_embeddings_file(outputs, config.postprocess)
        elif takes_device_path(deployment):
            done = predict_on_device(deployment, remaining, outputs, workers, on_progress, strict_device)
            counts, stages, workers, batch_size = (done.predicted,
                                                   done.rejected), done.stages, done.workers, done.batch_size
            host_decoded, job_path = done.host_decoded, "device"
        else:
            counts, stages, workers, batch_size = _predict(deployment, remaining, outputs, workers, on_progress)
    predicted, rejected = counts
    seconds = time.perf_counter() - started
    busiest = max((s for s in stages if s not in ("read", "wait_for_inputs")), key=stages.get)
    return JobSummary(
        artifact=str(deployment.folder), signature=deployment.signature, not_signed_off=deployment.not_signed_off,
        predictions=str(outputs.predictions),
        errors=str(outputs.errors), inputs=len(todo),
        duplicates=len(given) - len(todo), predicted=predicted, rejected=rejected, skipped=len(todo) - len(remaining),
        workers=workers, batch_size=batch_size, seconds=seconds,
        inputs_per_s=(predicted + rejected) / seconds if seconds > 0 else 0.0,
        stages_seconds={k: round(v, 4) for k, v in stages.items()},
        bottleneck="reading" if stages["wait_for_inputs"] > stages[busiest] else busiest, path=job_path,
        device=config.device, host_decoded=sum(host_decoded.values()), host_decoded_reasons=host_decoded,
        exit_code=3 if rejected else 0,
        text=None if text_stats is None else TextSummary.of(text_stats),
    )


def _predict(deployment: Deployment, remaining: list[str], outputs: Outputs, workers: int | None,
             on_progress: Callable[[int, int], None] | None) -> tuple[tuple[int, int], dict[str, float], int, int]:
    """The pipeline over `remaining`: ((predicted, rejected), stage seconds, reader threads, batch size)."""
    config = deployment.config
    reader = Reader(deployment)
    writer = Writer(outputs, config.postprocess, config.outputs[0].name)
    batch_size = config.batch_size if config.output_batch_axes else 1
    workers = workers or max(1, available_cpus())
    window = 4 * workers + batch_size  # inputs decoded ahead of inference
    predicted = rejected = 0
    waited = computed = written = 0.0
    clock = time.perf_counter
    with ThreadPoolExecutor(workers, thread_name_prefix="accel-opt-read") as pool, writer:
        pending: deque[tuple[str, Future]] = deque()
        queue = iter(remaining)

        def refill() -> None:
            for path in queue:
                pending.append((path, pool.submit(reader.read, path)))
                if len(pending) >= window:
                    return

        refill()  # the first inputs decode while the model loads
        with deployment.runner() as runner:
            batch: list[tuple[str, Sample]] = []
            while pending:
                path, future = pending.popleft()
                refill()
                start = clock()
                try:
                    batch.append((path, future.result()))
                except InputRejected as exc:
                    writer.reject(path, str(exc))
                    rejected += 1
                waited += clock() - start
                if len(batch) == batch_size or (not pending and batch):
                    start = clock()
                    results = infer_batch(runner, deployment, batch, batch_size)
                    done = clock()
                    predicted += writer.predict([p for p, _ in batch], results)
                    computed, written = computed + done - start, written + clock() - done
                    batch = []
                    if on_progress:
                        on_progress(predicted + rejected, len(remaining))
    stages = {"read": sum(reader.seconds), "wait_for_inputs": waited, "compute": computed, "write": written}
    return (predicted, rejected), stages, workers, batch_size
