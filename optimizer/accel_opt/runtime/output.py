"""What `accel-opt run` writes, and what it promises about it.

- One writer: the job holds an exclusive lock (flock on `.<name>.run.lock` beside the predictions, holding its
  pid) over the predictions, errors and sidecar files and the outputs folder for its whole life; a second job
  on the same files is refused at once. The kernel drops the lock when its process dies, even by SIGKILL.
- One artifact per file: `PREDICTIONS.meta.json` names the artifact (sha256 of its manifest.json) that
  answered; `--resume` with another artifact, or over a file without it, is refused.
- Inputs are never outputs: no file the job writes may be an input or sit in an input folder.
- Whole lines only: a failed write (full disk, I/O error) is cut back to the end of the last whole line
  before the error goes on, so every line of the file parses, whatever stopped the job.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError

from accel_opt.errors import InputRejected, UsageError, no_space_error
from accel_opt.files import now_utc
from accel_opt.preprocess.postprocess import embedding_record, topk_record
from accel_opt.recipe.deployed import Postprocess
from accel_opt.runtime.pinned import PinnedFolder, planted_link, refuse_foreign_links

log = logging.getLogger(__name__)

SHORT_HASH = 12  # hex digits of an identity shown to a person
OUTPUT_STEM_BYTES = 160  # of an input's name in its outputs file's name


def input_key(path: str) -> str:
    """Two spellings of one path (`a.jpg`, `./a.jpg`) are one input."""
    return os.path.normpath(path)


class PredictionsMeta(BaseModel):
    """`PREDICTIONS.meta.json`: which artifact wrote the predictions beside it."""

    format: int = 1
    artifact_identity: str  # sha256 of the artifact's manifest.json
    artifact: str  # its folder when the job started
    started_utc: str


@dataclass
class Outputs:
    """The files of one job, all named after its predictions file; written, while exclusive() holds the lock, through
    the predictions' folder pinned open (PinnedFolder)."""

    predictions: Path
    _pinned: PinnedFolder | None = field(default=None, repr=False, compare=False)
    _outputs_folder: PinnedFolder | None = field(default=None, repr=False, compare=False)  # opened on the first .npz

    @property
    def pinned(self) -> PinnedFolder:
        if self._pinned is None:
            raise RuntimeError("the job's files are written only while Outputs.exclusive() holds them")
        return self._pinned

    @property
    def errors(self) -> Path:  # PREDICTIONS.jsonl -> PREDICTIONS.errors.jsonl
        p = self.predictions
        return p.with_name(f"{p.stem}.errors{p.suffix or '.jsonl'}")

    @property
    def meta(self) -> Path:
        return self.predictions.with_name(f"{self.predictions.stem}.meta.json")

    @property
    def outputs_dir(self) -> Path:
        return self.predictions.with_name(f"{self.predictions.stem}.outputs")

    @property
    def lock(self) -> Path:
        # Named after the stem without .errors/.meta: a job whose predictions are another job's errors or
        # sidecar file (p.errors.jsonl) takes the same lock as that job (p.jsonl).
        stem = self.predictions.stem
        while stem.endswith((".errors", ".meta")):
            stem = stem.rsplit(".", 1)[0]
        return self.predictions.with_name(f".{stem}.run.lock")

    def refuse_bad_paths(self, inputs: Iterable[str | Path], resume: bool, overwrite: bool) -> None:
        """UsageError for a predictions path that is a folder, for contradictory flags, and when a file the
        job writes is an input, or anywhere below an input folder (read recursively), or when an input lies in the
        outputs folder. Checked before anything is created or truncated."""
        refuse_foreign_links(self.predictions)
        if self.predictions.is_dir() or self.errors.is_dir():
            raise UsageError(f"--out {self.predictions} is a folder: give the predictions file, such as "
                             f"{self.predictions / 'predictions.jsonl'}")
        if resume and overwrite:
            raise UsageError("--resume keeps the answered lines and --overwrite drops them: give one")
        written = [self.predictions, self.errors, self.meta, self.lock, self.outputs_dir]
        for path in written:  # a planted link: refused before anything is created (the opens refuse it too, later)
            if path.is_symlink():
                raise planted_link(path)
        resolved = {path: path.resolve() for path in written}
        outputs_dir = resolved[self.outputs_dir]
        for item in inputs:
            given = Path(item)
            source = given.resolve()
            for path, target in resolved.items():
                if given.is_dir() and target.is_relative_to(source):  # folders are read recursively
                    where = f"inside the input folder {item}" if target != source else f"the input folder {item}"
                    raise UsageError(f"--out {self.predictions}: the job would write {path} {where}: put the "
                                     "predictions outside the inputs")
                if target == source or (given.exists() and path.exists() and os.path.samefile(given, path)):
                    raise UsageError(f"--out {self.predictions}: the job would write {path}, which is the input "
                                     f"{item}: "
                                     "put the predictions outside the inputs")
            if source.is_relative_to(outputs_dir):
                raise UsageError(f"--out {self.predictions}: the input {item} is in the job's outputs folder "
                                 f"{self.outputs_dir}: "
                                 "put the predictions elsewhere")

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[PinnedFolder]:
        """Hold the job's lock, and its folder pinned, while the block runs; UsageError at once, naming the holder's
        pid, if held."""
        try:
            self.predictions.parent.mkdir(parents=True, exist_ok=True)
            self._pinned = PinnedFolder.of(self.predictions.parent)
        except OSError as exc:
            raise _cannot_write(self.predictions, exc) from None
        try:
            fd = self.pinned.open(self.lock.name, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            self._unpin()
            raise _cannot_write(self.predictions, exc) from None
        except BaseException:
            self._unpin()
            raise
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                raise UsageError(f"--out {self.predictions}: another accel-opt run (pid {_holder(fd)}) is writing it; "
                                 "wait for it to finish or choose another --out") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield self.pinned
        finally:
            os.close(fd)  # releases the lock; the file stays (removing it would let two jobs lock two files)
            self._unpin()

    def _unpin(self) -> None:
        for folder in (self._outputs_folder, self._pinned):
            if folder is not None:
                folder.close()
        self._pinned = self._outputs_folder = None

    def write_output(self, named: str, npz: bytes) -> None:
        """An answer's .npz, in the outputs folder, whole (before the line naming it is written)."""
        target = Path(named)
        if target.parent != self.outputs_dir:
            raise RuntimeError(f"an answer named outputs outside {self.outputs_dir}: {named}")
        if self._outputs_folder is None:
            self._outputs_folder = self.pinned.folder(self.outputs_dir.name)
        # One per answer, on the job's hot path: each file synced (as before), the folder's rename not (a second sync
        # per answer)
        self._outputs_folder.write_whole(target.name, lambda f: f.write(npz), sync_folder=False)

    def start(self, artifact: Path, identity: str, resume: bool, overwrite: bool) -> set[str]:
        """Start this job's files (under the lock): keep the answered lines of the same artifact (--resume),
        else empty the predictions; empty the errors; record the artifact. Return the answered inputs' keys."""
        predictions, folder = self.predictions, self.pinned
        if folder.exists(predictions.name) and not (resume or overwrite):
            raise UsageError(f"{predictions} exists: --resume to skip the inputs it answers, or --overwrite")
        try:
            answered = self._resume(artifact, identity) if resume and folder.exists(predictions.name) else set()
            if self.outputs_dir.is_symlink():
                raise planted_link(self.outputs_dir)  # never emptied or written through
            truncate = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            if not answered:
                os.close(folder.open(predictions.name, truncate))  # emptied before the sidecar names the new artifact
                folder.remove_tree(self.outputs_dir.name)  # an earlier job's .npz files go with its lines
            # this job's rejections; answered inputs are not read again
            os.close(folder.open(self.errors.name, truncate))
            meta = PredictionsMeta(artifact_identity=identity, artifact=str(artifact.resolve()), started_utc=now_utc())
            folder.write_whole(self.meta.name, lambda f: f.write(meta.model_dump_json(indent=2).encode() + b"\n"))
        except OSError as exc:
            raise _cannot_write(predictions, exc) from None
        return answered

    def _resume(self, artifact: Path, identity: str) -> set[str]:
        with os.fdopen(self.pinned.open(self.predictions.name, os.O_RDONLY), "rb") as f:
            data = f.read()
        whole = data[: data.rfind(b"\n") + 1]
        answered = _answered_inputs(self.predictions, whole)
        if answered:
            refuse_other_artifact(self.predictions, self.meta, read_record(self.meta, PredictionsMeta),
                                  identity, artifact)
        if len(whole) != len(data):  # only once the file is known to be ours and this artifact's
            fd = self.pinned.open(self.predictions.name, os.O_WRONLY)
            try:
                os.ftruncate(fd, len(whole))
            finally:
                os.close(fd)
        return answered



def read_record(path: Path, model: type[BaseModel]):
    """The record of which artifact answered (a sidecar or a summary), None when there is none; unreadable: exit 3."""
    if not path.is_file():
        return None
    try:
        return model.model_validate_json(path.read_text())
    except (ValidationError, ValueError) as exc:
        raise InputRejected(f"{path}: unreadable ({str(exc).splitlines()[0]}): start over with --overwrite") from None


def refuse_other_artifact(answers: Path, record_path: Path, recorded, identity: str, artifact: Path) -> None:
    """The one resume rule of both engines: answers resume only under the artifact that wrote them (exit 2 otherwise,
    naming both), and answers with no record of their artifact do not resume at all."""
    if recorded is None:
        raise UsageError(f"--resume: {answers} has no {record_path.name}, so which artifact answered it is unknown "
                         "(written by an older accel-opt?): start over with --overwrite")
    if recorded.artifact_identity != identity:
        raise UsageError(f"--resume: {answers} holds answers of {recorded.artifact_identity[:SHORT_HASH]} "
                         f"({Path(recorded.artifact).name}), not of {identity[:SHORT_HASH]} ({artifact.name}): "
                         "start over with --overwrite, or choose another --out")


def _answered_inputs(predictions: Path, whole: bytes) -> set[str]:
    try:
        lines = whole.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise InputRejected(f"{predictions}: not a predictions file of accel-opt run (not UTF-8 text)") from None
    answered = set()
    for line in lines:
        try:
            answered.add(input_key(json.loads(line)["input"]))
        except (ValueError, KeyError, TypeError):
            raise InputRejected(f"{predictions}: not a predictions file of accel-opt run "
                                f"(line {line[:60]!r})") from None
    return answered


def _holder(fd: int) -> str:
    """The pid the lock's holder wrote (it writes it right after locking: wait a moment for it)."""
    for _ in range(20):
        if pid := os.pread(fd, 32, 0).decode("ascii", "replace").strip():
            return pid
        time.sleep(0.01)
    return "unknown"


def _cannot_write(predictions: Path, exc: OSError) -> Exception:
    return no_space_error(exc, predictions.parent) or UsageError(f"--out {predictions}: cannot write there "
                                                                 f"({exc.strerror or exc})")


class LineFile:
    """An append-only file of whole lines. After each complete write its length is the end of a whole line;
    a write that fails (or is interrupted) is cut back to it before the error goes on."""

    def __init__(self, folder: PinnedFolder, path: Path):
        self.path = path
        self._fd = folder.open(path.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self.whole_bytes = os.fstat(self._fd).st_size

    def append(self, text: str) -> None:
        encoded = text.encode("utf-8")
        data = memoryview(encoded)
        try:
            while data:  # one system call per batch, unless the file system takes only part of it
                data = data[os.write(self._fd, data):]
        except BaseException:
            self._cut_back()
            raise
        self.whole_bytes += len(encoded)

    def close(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # a pipe or a character device cannot be synced
                raise
        finally:
            os.close(self._fd)

    def _cut_back(self) -> None:
        try:
            os.ftruncate(self._fd, self.whole_bytes)
        except OSError as exc:  # not a regular file (a pipe): nothing to cut
            log.warning("could not cut %s back to its last whole line: %s", self.path, exc)


class Writer:
    """Appends whole JSON lines: predictions in input order, rejections with their reason."""

    def __init__(self, outputs: Outputs, post: Postprocess | None, first_output: str):
        self.outputs, self.post, self.first_output = outputs, post, first_output

    def __enter__(self) -> Writer:
        self._out = LineFile(self.outputs.pinned, self.outputs.predictions)
        self._err = LineFile(self.outputs.pinned, self.outputs.errors)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._out.close()
        finally:
            self._err.close()

    def reject(self, path: str, reason: str) -> None:
        self._err.append(json.dumps({"input": path, "error": reason}) + "\n")

    def predict(self, paths: list[str], outputs: list[dict[str, np.ndarray]]) -> int:
        lines = [json.dumps({"input": path, **self.record(path, out)}) + "\n" for path, out in zip(paths, outputs)]
        self._out.append("".join(lines))  # one write per batch, each line whole
        return len(lines)

    def predict_records(self, paths: list[str], records: list[dict[str, Any]]) -> int:
        """Lines of answers already made (a device computed a classifier's top-k): one write per batch."""
        self._out.append("".join(json.dumps({"input": path, **record}) + "\n" for path, record in zip(paths, records)))
        return len(records)

    def record(self, path: str, outputs: dict[str, np.ndarray]) -> dict[str, Any]:
        """The answer's JSON fields, its outputs' .npz written first (before the line naming it) where it has one."""
        record, npz = self.answer(path, outputs)
        if npz is not None:
            self.outputs.write_output(record["outputs"], npz)
        return record

    def answer(self, path: str, outputs: dict[str, np.ndarray]) -> tuple[dict[str, Any], bytes | None]:
        """(the answer's JSON fields, None) for a postprocess; else ({"outputs": the .npz file's path}, its bytes):
        every output saved beside the predictions, one .npz per input, named after the input. Nothing is written
        here, so a Ray actor can hand the bytes to the driver, which writes them where the record says."""
        # one input's output rows: pooled as the recipe says
        if self.post is not None and self.post.embedding is not None:
            from accel_opt.preprocess.text import embeddings

            output = np.asarray(outputs[self.post.embedding.output or self.first_output])
            return embedding_record(embeddings(output, None, self.post.embedding)[0]), None
        if self.post is not None:
            return topk_record(self.post, outputs, self.first_output), None
        buffer = io.BytesIO()
        np.savez(buffer, **outputs)
        # The hash of the whole path keeps names unique; the stem is cut so the name, and the temporary name it is
        # written under (.NAME.XXXXXXXX.tmp), stay within the 255 bytes a file name may take.
        stem = Path(path).stem.encode()[:OUTPUT_STEM_BYTES].decode("utf-8", "ignore")
        target = self.outputs.outputs_dir / f"{hashlib.sha256(path.encode()).hexdigest()[:12]}-{stem}.npz"
        return {"outputs": str(target)}, buffer.getvalue()
