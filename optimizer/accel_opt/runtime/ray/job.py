"""`accel-opt run --engine ray`: the batch job on Ray Data, one node or many, with the local engine's answers.

The driver lists the inputs, skips those the folder already answers (--resume), and streams the rest through
`accel_opt.runtime.distributed.predict` (an actor pool running the local engine's reader and records). It writes the
part files itself, from the answers as they arrive: each under a temporary name, synced, then published by
rename, so a published part is whole and a killed job leaves none half-written. Ray runs a batch at least
once (failed tasks are retried, dead actors restarted), so answers are kept by input key, the first one
winning; the job ends by reading the published parts back and checking that every listed input is answered
exactly once (a mismatch fails the job). Order across parts is not promised; `--sorted` writes one file in input order.

The folder (`OutFolder`): `part-<run>-<n>.jsonl|.parquet` (records), `rejected-<run>-<n>.jsonl`
({"input", "error"}), `predictions.outputs/` (artifacts without a postprocess: each input's arrays as .npz, sent
back by the actors in the answer rows and written here by the driver before the part naming them is published, so
they are where the summary says on any cluster, shared file system or not; the exactly-once check counts an
answer whose file is missing as not answered), `_SUMMARY.json` (written first, naming the artifact, so --resume
refuses another artifact's folder even after a kill; rewritten at the end with the counts), `.predictions.run.lock`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel

from accel_opt.errors import InternalError, ResourceExhausted, UsageError
from accel_opt.files import now_utc
from accel_opt.runtime import Deployment
from accel_opt.runtime.inputs import job_inputs, unique_inputs
from accel_opt.runtime.output import Outputs, input_key, read_record, refuse_other_artifact
from accel_opt.runtime.pinned import refuse_foreign_links
from accel_opt.runtime.ray.cluster import ray_session

log = logging.getLogger(__name__)

SUMMARY = "_SUMMARY.json"
SORTED = "predictions.sorted.jsonl"
ROWS_PER_PART = 5000  # a part is published when it holds this many answers...
SECONDS_PER_PART = 2.0  # ...or this long after its first one: about what a killed driver can lose
ROWS_PER_BLOCK_MAX = 4096


class RaySummary(BaseModel):
    """`_SUMMARY.json`: what answered the folder and how the last run went."""

    format: int = 1
    status: str  # running | complete (every input answered exactly once) | incomplete
    artifact: str
    artifact_identity: str  # the same identity as the local engine's PREDICTIONS.meta.json
    started_utc: str
    address: str  # "local", or the cluster's
    output_format: str  # jsonl | parquet
    inputs: int = 0  # listed, each distinct path once
    duplicates: int = 0  # paths listed more than once (answered once)
    predicted: int = 0  # in the folder, all runs together
    rejected: int = 0  # by this run (a resumed run tries earlier rejections again, like the local engine)
    skipped: int = 0  # already answered (--resume)
    retried_answers_dropped: int = 0  # second answers of one input (a batch Ray ran twice), dropped by key
    missing: int = 0  # listed but not answered: then the job fails
    actors: list[int] = []  # [min, max] of the pool
    cpus_per_actor: int = 1
    seconds: float = 0.0  # the whole job, artifact loading and Ray's start included
    ray_start_seconds: float = 0.0  # connecting to (or starting) Ray
    ray_authentication: str = "unknown"  # "token": Ray's token authentication guarded the cluster; "disabled": not
    first_answer_seconds: float = 0.0  # from submitting the job to its first answers: actors starting, models loading
    inputs_per_s: float = 0.0  # answered by this run / seconds
    steady_inputs_per_s: float = 0.0  # answers after the first batch / time from the first answers to the last
    check_seconds: float = 0.0  # reading the parts back and checking exactly-once
    parts: list[str] = []
    rejected_parts: list[str] = []
    sorted: str | None = None
    exit_code: int = 0
    # Its build did not sign the folder off: it ran only because the caller allowed it (--allow-not-signed-off).
    not_signed_off: bool = False
    signature: str = "unsigned"  # who signed the folder (runtime.Deployment.signature)


class OutFolder:
    """The job's output folder: its parts, their publication, and reading them back."""

    def __init__(self, folder: Path, output_format: str = "jsonl"):
        self.folder, self.output_format = folder, output_format
        self.outputs = Outputs(folder / "predictions.jsonl")  # its lock, and the folder pinned while it is held
        self.run_id = secrets.token_hex(4)  # parts of a resumed run never take an earlier run's names
        self.parts: list[str] = []
        self.rejected_parts: list[str] = []

    @property
    def summary(self) -> Path:
        return self.folder / SUMMARY

    @property
    def outputs_dir(self) -> Path:
        """Where records of artifacts without a postprocess point: the actors send the bytes, the driver writes them."""
        return self.outputs.outputs_dir

    def write_outputs(self, named: str, npz: bytes) -> None:
        if Path(named).parent.resolve() != self.outputs_dir.resolve():  # the actors were told this folder
            raise InternalError(f"an actor named outputs outside {self.outputs_dir}: {named}")
        self.outputs.write_output(str(self.outputs_dir / Path(named).name), npz)

    def refuse_bad_path(self) -> None:
        refuse_foreign_links(self.folder / SUMMARY)
        if self.folder.exists() and not self.folder.is_dir():
            raise UsageError(f"--out {self.folder} is a file: with --engine ray, --out names a folder (of part files)")

    def start(self, deployment: Deployment, address: str, resume: bool, overwrite: bool) -> set[str]:
        """Under the lock: check and clear the folder; record the artifact. Return the answered inputs' keys."""
        mine = self._files("part-") + self._files("rejected-") + self._files(".tmp-")
        if resume and overwrite:
            raise UsageError("--resume keeps the answered inputs and --overwrite drops them: give one")
        if (mine or self.summary.exists()) and not (resume or overwrite):
            raise UsageError(f"{self.folder} holds a job's answers: --resume to skip the inputs it answers, or "
                             "--overwrite")
        identity = deployment.identity
        answered: set[str] = set()
        if resume and (mine or self.summary.exists()):
            refuse_other_artifact(self.folder, self.summary, self._recorded(), identity, deployment.folder)
            answered = {input_key(path) for part in self._files("part-") for path, named in self.read_rows(part)
                        if named is None or Path(named).is_file()}  # an answer whose arrays are gone is redone
            self.parts = [p.name for p in self._files("part-")]
            drop = self._files("rejected-") + self._files(".tmp-")  # rejected inputs are tried again
        else:
            drop = mine + [p for p in (self.folder / SORTED,) if p.exists()]
            self.outputs.pinned.remove_tree(self.outputs_dir.name)  # an earlier job's .npz files go with its parts
        for path in drop:
            self.outputs.pinned.unlink(path.name)
        self.write_summary(RaySummary(status="running", artifact=str(deployment.folder.resolve()),
                                      signature=deployment.signature, artifact_identity=identity,
                                      started_utc=now_utc(), address=address, output_format=self.output_format))
        return answered

    def _recorded(self) -> RaySummary | None:
        return read_record(self.summary, RaySummary)

    def write_summary(self, summary: RaySummary) -> None:
        self.outputs.pinned.write_whole(SUMMARY, lambda f: f.write(summary.model_dump_json(indent=2).encode() + b"\n"))

    def _files(self, prefix: str) -> list[Path]:
        return sorted(p for p in self.folder.glob(f"{prefix}*") if p.is_file())

    def publish(self, records: list[str], rejections: list[str]) -> None:
        """Write a part under a temporary name, sync it, rename it into place (whole or absent)."""
        if records:
            name = f"part-{self.run_id}-{len(self.parts):05d}.{self.output_format}"
            self._publish(name, records, self.output_format)
            self.parts.append(name)
        if rejections:
            name = f"rejected-{self.run_id}-{len(self.rejected_parts):05d}.jsonl"
            self._publish(name, rejections, "jsonl")
            self.rejected_parts.append(name)

    def _publish(self, name: str, lines: list[str], output_format: str) -> None:
        def write(f) -> None:
            if output_format == "parquet":
                import pyarrow as pa
                import pyarrow.parquet as pq

                pq.write_table(pa.Table.from_pylist([json.loads(line) for line in lines]), f)
            else:
                f.write("".join(line + "\n" for line in lines).encode("utf-8"))

        self.outputs.pinned.write_whole(name, write, temporary=f".tmp-{name}")  # synced, renamed: whole or absent

    def read_keys(self, part: Path) -> list[str]:
        """The input key of every row of a published part file."""
        return [input_key(path) for path, _ in self.read_rows(part)]

    def read_rows(self, part: Path) -> list[tuple[str, str | None]]:
        """(input, the outputs file it names or None) for every row of a published part file."""
        if part.suffix == ".parquet":
            import pyarrow.parquet as pq

            names = pq.read_schema(part).names  # only the two columns read: a part holds every answer's fields
            table = pq.read_table(part, columns=[c for c in ("input", "outputs") if c in names])
            outputs = table.column("outputs").to_pylist() if "outputs" in names else [None] * table.num_rows
            return list(zip(table.column("input").to_pylist(), outputs))
        rows = [json.loads(line) for line in part.read_text().splitlines() if line]
        return [(row["input"], row.get("outputs")) for row in rows]

    def check(self, listed: list[str]) -> tuple[int, int, list[str], list[str]]:
        """Read every published part back: (predicted, rejected, listed inputs not answered, inputs answered twice).
        An answer whose outputs file is missing counts as not answered."""
        counts: dict[str, int] = {}
        predicted = rejected = 0
        for name in self.parts:
            for path, named in self.read_rows(self.folder / name):
                if named is not None and not Path(named).is_file():
                    continue  # its arrays are not where the record says: the input is not answered
                predicted += 1
                counts[input_key(path)] = counts.get(input_key(path), 0) + 1
        for name in self.rejected_parts:
            keys = self.read_keys(self.folder / name)
            rejected += len(keys)
            for key in keys:
                counts[key] = counts.get(key, 0) + 1
        missing = [p for p in listed if input_key(p) not in counts]
        doubled = sorted(k for k, n in counts.items() if n > 1)
        return predicted, rejected, missing, doubled

    def write_sorted(self, listed: list[str]) -> Path:
        """Every prediction in one JSONL file, in input order (rejections stay in their parts)."""
        by_key: dict[str, str] = {}
        for name in self.parts:
            path = self.folder / name
            if path.suffix == ".parquet":
                import pyarrow.parquet as pq

                lines = [json.dumps(row) for row in pq.read_table(path).to_pylist()]
            else:
                lines = path.read_text().splitlines()
            for line in lines:
                by_key.setdefault(input_key(json.loads(line)["input"]), line)
        ordered = [by_key[key] for key in map(input_key, listed) if key in by_key]
        self._publish(SORTED, ordered, "jsonl")
        return self.folder / SORTED


def run_ray_job(
    deployment: Deployment,
    inputs: Iterable[str | os.PathLike],
    out_dir: str | os.PathLike,
    address: str | None = None,
    actors: tuple[int, int] | None = None,
    cpus_per_actor: int = 1,
    resume: bool = False,
    overwrite: bool = False,
    output_format: str = "jsonl",
    sort: bool = False,
    timeout_s: float | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    started: float | None = None,
    verbose: bool = False,
) -> RaySummary:
    """Predict every input on Ray and publish the answers in `out_dir`. Exit codes through the errors raised:
    2 a bad --out or flags, 4 Ray missing or the cluster not answering, 5 past `timeout_s` (the published parts
    stay: --resume continues), 70 an input lost or answered twice."""
    started = started or time.perf_counter()
    folder = OutFolder(Path(out_dir), output_format)
    folder.refuse_bad_path()
    given, texts = job_inputs(deployment.config, deployment.folder.name, inputs, exclude=Path(out_dir))
    todo = unique_inputs(given)
    with folder.outputs.exclusive():
        answered = folder.start(deployment, address or "local", resume, overwrite)  # refusals before Ray starts
        remaining = [p for p in todo if input_key(p) not in answered]
        try:
            with ray_session(address, verbose=verbose) as session:
                pool = actors or (1, max(1, session.cpus // cpus_per_actor))
                run = _stream(deployment, remaining, folder, pool, cpus_per_actor, timeout_s, started,
                              on_progress, texts)
        except BaseException:  # the folder says the job did not finish (a SIGKILL leaves "running")
            folder.write_summary(folder._recorded().model_copy(update={"status": "incomplete", "parts": folder.parts,
                                                                       "rejected_parts": folder.rejected_parts}))
            raise
        summary = _finish(folder, deployment, todo, given, answered, run, pool, cpus_per_actor, session, started, sort)
    return summary


def _stream(deployment, remaining, folder, pool, cpus_per_actor, timeout_s, started, on_progress, texts=None) -> dict:
    """Run the pool over `remaining` (with `texts`, their TextItems by key), publishing parts as answers arrive; the
    run's timings and counts."""
    import pyarrow as pa
    import ray.data

    from accel_opt.runtime.ray.predictor import ROWS_PER_CALL, predict

    stats = {"dropped": 0, "answered": 0, "first": None, "first_rows": 0, "last": None,
             "submitted": time.perf_counter(),
             "remaining": len(remaining)}
    if not remaining:
        return stats
    per_block = min(ROWS_PER_BLOCK_MAX, max(ROWS_PER_CALL, -(-len(remaining) // (pool[1] * 4))))
    table = pa.table({"input": remaining})
    if texts:
        items = [texts[input_key(p)] for p in remaining]
        # "" for none: Ray's numpy batches turn an all-null string column into NaNs
        table = pa.table({"input": remaining, "text": [i.text or "" for i in items],
                          "read_error": [i.error or "" for i in items]})
    blocks = [table.slice(start, per_block) for start in range(0, len(remaining), per_block)]
    answers = predict(ray.data.from_arrow(blocks), deployment.folder.resolve(), actors=pool,
                      cpus_per_actor=cpus_per_actor,
                      outputs_dir=str(folder.folder.resolve()), identity=deployment.identity,
                      allow_not_signed_off=deployment.allow_not_signed_off,
                      **deployment.trust.as_arguments())
    seen: set[str] = set()
    records: list[str] = []
    rejections: list[str] = []
    part_started = None
    iterator = iter(answers.iter_batches(batch_size=None, batch_format="pyarrow"))
    try:
        with _Deadline(started + timeout_s - time.perf_counter() if timeout_s else None) as deadline:
            for item in iterator:
                with deadline.busy():  # an answer is taken whole: the deadline waits for the batch in hand
                    now = time.perf_counter()
                    if stats["first"] is None:  # the steady rate counts what arrives after the first answers
                        stats["first"], stats["first_rows"] = now, item.num_rows
                    stats["last"] = now
                    part_started = part_started or now
                    columns = (item.column(c).to_pylist() for c in ("input", "record", "outputs_npz", "error"))
                    for path, record, npz, error in zip(*columns):
                        key = input_key(path)
                        if key in seen:  # a batch Ray ran twice: the first answer stands
                            stats["dropped"] += 1
                            continue
                        seen.add(key)
                        if record is not None:
                            if npz is not None:  # written here, on the driver, before the part naming it is published
                                folder.write_outputs(json.loads(record)["outputs"], npz)
                            records.append(record)
                        else:
                            rejections.append(json.dumps({"input": path, "error": error}))
                    stats["answered"] = len(seen)
                    if len(records) + len(rejections) >= ROWS_PER_PART or now - part_started >= SECONDS_PER_PART:
                        folder.publish(records, rejections)
                        records, rejections, part_started = [], [], None
                    if on_progress:
                        on_progress(len(seen), len(remaining))
    except _TimedOut:
        folder.publish(records, rejections)
        raise ResourceExhausted(f"--timeout-s {timeout_s:g} reached with {stats['answered']} of {len(remaining)} "
                                "inputs "
                                f"answered (published in {folder.folder}): --resume continues") from None
    except BaseException:
        folder.publish(records, rejections)
        raise
    finally:
        # Ray Data's iterator stopped here, in this thread, while Ray is still up: a reader left running past
        # ray.shutdown() makes Ray's core worker end the whole process with exit code 1, whatever ours was.
        close = getattr(iterator, "close", None)
        if close is not None:
            close()
    folder.publish(records, rejections)
    return stats


class _TimedOut(Exception):
    pass


class _Deadline:
    """--timeout-s, enforced by SIGALRM in the driver's main thread, where Ray Data's iterator waits: the wait is
    interrupted, never left running in another thread. `busy()` defers the deadline while an answer is handled, so
    every answer taken is published whole. Off the main thread (a Python API caller's thread) no alarm is set."""

    def __init__(self, seconds: float | None):
        self.seconds = None if seconds is None else max(seconds, 0.001)
        self.expired = self._busy = False
        self._previous = None

    def __enter__(self) -> _Deadline:
        if self.seconds is not None:
            if threading.current_thread() is threading.main_thread():
                self._previous = signal.signal(signal.SIGALRM, self._fire)
                signal.setitimer(signal.ITIMER_REAL, self.seconds)
            else:
                log.warning("--timeout-s is enforced in the main thread only: not here")
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous)

    def _fire(self, *_) -> None:
        self.expired = True
        if not self._busy:
            raise _TimedOut

    @contextmanager
    def busy(self) -> Iterator[None]:
        self._busy = True
        try:
            yield
        finally:
            self._busy = False
        if self.expired:
            raise _TimedOut


def _finish(folder, deployment, todo, given, answered, run, pool, cpus_per_actor, session, started, sort) -> RaySummary:
    """The exactly-once check over the published parts, then the summary (a mismatch: exit 70)."""
    check_started = time.perf_counter()
    predicted, rejected, missing, doubled = folder.check(todo)
    check_seconds = time.perf_counter() - check_started
    seconds = time.perf_counter() - started
    first, last = run["first"], run["last"]
    steady = ((run["answered"] - run["first_rows"]) / (last - first)) if first and last and last > first else 0.0
    summary = RaySummary(
        status="complete" if not missing and not doubled else "incomplete", artifact=str(deployment.folder.resolve()),
        signature=deployment.signature, not_signed_off=deployment.not_signed_off,
        artifact_identity=deployment.identity, started_utc=folder._recorded().started_utc, address=session.address,
        output_format=folder.output_format, inputs=len(todo), duplicates=len(given) - len(todo), predicted=predicted,
        rejected=rejected, skipped=len(todo) - run["remaining"],
        retried_answers_dropped=run["dropped"], missing=len(missing), actors=list(pool), cpus_per_actor=cpus_per_actor,
        seconds=round(seconds, 3), ray_start_seconds=round(session.start_seconds, 3),
        ray_authentication=session.authentication,
        first_answer_seconds=round((first - run["submitted"]) if first else 0.0, 3),
        inputs_per_s=round(run["answered"] / seconds, 2) if seconds > 0 else 0.0, steady_inputs_per_s=round(steady, 2),
        check_seconds=round(check_seconds, 4), parts=folder.parts, rejected_parts=folder.rejected_parts,
        exit_code=3 if rejected else 0,
    )
    if missing or doubled:
        summary.exit_code = InternalError.exit_code
        folder.write_summary(summary)
        what = (f"{len(missing)} inputs not answered (first: {missing[0]})" if missing else
                f"{len(doubled)} inputs answered twice (first: {doubled[0]})")
        raise InternalError(f"exactly-once check failed in {folder.folder}: {what}; --resume answers the missing ones")
    if sort:
        summary.sorted = str(folder.write_sorted(todo))
    folder.write_summary(summary)
    return summary
