"""Ray Data: the same artifact, read and run exactly as `accel-opt run` does, on an actor pool of many machines.

For users who already have a Ray pipeline:

    from ray.data import ActorPoolStrategy
    from accel_opt.runtime.distributed import Predictor   # (accel_opt.runtime.ray.predictor)
    ds = ray.data.from_items([{"input": path} for path in paths])
    answers = ds.map_batches(Predictor, fn_constructor_kwargs={"artifact": "/models/resnet-int8",
                                                               "public_key": "/keys/builder.pub"},
                             compute=ActorPoolStrategy(min_size=1, max_size=8), num_cpus=1, batch_size=64)

or `predict(ds, artifact, public_key=...)`, which does the same with the pool sized so that losing a node cannot
stall it. Both take the trust arguments of `accel_opt.runtime.load` (public_key, certificate_chain, trust_unsigned,
and ACCEL_OPT_PUBLIC_KEY when no key is given): a folder holding native code loads only when signed or trusted; and
`allow_not_signed_off`: a folder its build did not sign off is refused (NotSignedOff, the verdict's exit code) unless
it is True.
Each actor loads the artifact once, in `__init__`, through `accel_opt.runtime.load` (manifest, hashes and
environment verified on that node; a node that cannot run it is an error naming the node, never a silent
recompile), with the backend's threads set to the actor's CPUs: Ray's `num_cpus` is only a scheduling label,
and ONNX Runtime's default pool takes every core of the node. Sessions are built in the actor, never pickled.

Rows in: `input` (a path or URI), or `path` and `bytes` (`ray.data.read_binary_files(include_paths=True)`); for an
artifact with a text stage, `input` (the text's id), `text` and `read_error` (why it could not be read, or "").
Rows out (`record_schema()`): `input`; `top1` (classifier artifacts); `record`, the JSON line the local engine
writes for that input; `outputs_npz`, for artifacts without a postprocess, the bytes of the .npz file `record`
names (nothing is written on the worker: `accel-opt run --engine ray` writes them on the driver, so every
output ends up where the summary says, with or without a shared file system); `error`, the reason an input was
rejected (then `record` is null). A bad input is a row with its reason, never an exception that fails the block.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from accel_opt.errors import AccelOptError, InputRejected, Unsupported, first_line
from accel_opt.files import install_line
from accel_opt.runtime.inputs import local_path

log = logging.getLogger(__name__)

RAY_INSTALL = install_line("ray")
ROWS_PER_CALL = 64  # inputs per actor call: amortizes Ray's per-task overhead (a few ms) over many inferences


def require_ray():
    """The `ray` module with Ray Data, or Unsupported (exit 4) naming the extra to install."""
    try:
        import ray
        import ray.data  # noqa: F401 - Ray Data is a separate extra of ray
    except ImportError as exc:
        raise Unsupported(f"--engine ray needs Ray Data ({first_line(exc)}): {RAY_INSTALL}") from None
    return ray


def record_schema():
    import pyarrow as pa

    return pa.schema([("input", pa.string()), ("top1", pa.int64()), ("record", pa.string()),
                      ("outputs_npz", pa.binary()),
                      ("error", pa.string())])


def node_name() -> str:
    """This process's Ray node as a person finds it: IP, host name and the start of its node id."""
    try:
        import ray

        if not ray.is_initialized():  # get_runtime_context() would start a local Ray just to name this host
            raise RuntimeError("outside Ray")
        node_id = ray.get_runtime_context().get_node_id()[:12]
        ip = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray: the host alone
        node_id, ip = "-", "-"
    return f"{ip} ({socket.gethostname()}, node {node_id})"


class Predictor:
    """A Ray Data callable class: loads `artifact` once per actor and answers batches of inputs."""

    def __init__(self, artifact: str | os.PathLike, threads: int | None = None, recheck: bool = True,
                 outputs_dir: str | None = None, identity: str | None = None, public_key: str | None = None,
                 certificate_chain: tuple[str, ...] = (), trust_unsigned: bool = False,
                 allow_not_signed_off: bool = False):
        from accel_opt import runtime
        from accel_opt.runtime.answer import Reader
        from accel_opt.runtime.output import Outputs, Writer
        from accel_opt.runtime.probe import signed_off_here

        where = node_name()
        try:  # an artifact this node cannot run is an error naming the node (exit codes of runtime.load)
            self.deployment = runtime.load(artifact, threads=threads, public_key=public_key,
                                           certificate_chain=certificate_chain, trust_unsigned=trust_unsigned,
                                           allow_not_signed_off=allow_not_signed_off)
            if identity is not None and self.deployment.identity != identity:  # another build at the same path
                raise InputRejected(f"{artifact} is build {self.deployment.identity[:12]} here, the job runs "
                                    f"{identity[:12]}")
            line = signed_off_here(self.deployment, recheck_allowed=recheck)
        except AccelOptError as exc:  # the same error, its exit code kept, naming the node
            exc.args = (f"on node {where}: {exc}",)
            raise exc from None
        if line:
            log.warning("on node %s: %s", where, line)
        config = self.deployment.config
        self.threads = threads or config.threads
        self.reader = Reader(self.deployment)
        self.batch_size = config.batch_size if config.output_batch_axes else 1
        # Records exactly as the local engine writes them; for an artifact without a postprocess the record names
        # `outputs_dir`/predictions.outputs/<id>.npz, whose bytes travel back in the row for the driver to write.
        outputs_of = Path(outputs_dir or Path(tempfile.gettempdir()) / "accel-opt-outputs") / "predictions.jsonl"
        self.writer = Writer(Outputs(outputs_of), config.postprocess, config.outputs[0].name)
        self.pool = ThreadPoolExecutor(max(1, self.threads), thread_name_prefix="accel-opt-read")
        self.runner = self.deployment.runner()
        self.runner.activate()  # the session is built here, in the actor: never pickled
        self.scratch: str | None = None  # remote inputs' local copies: made on the first, removed with the actor
        log.info("on node %s: loaded %s with %d threads", where, self.deployment.describe(), self.threads)

    def __call__(self, batch: dict[str, np.ndarray]):
        import pyarrow as pa

        if "text" in batch:  # a text artifact's rows: the driver read the texts
            return self._answer_texts(batch)
        if "input" in batch:
            paths, blobs = [str(p) for p in batch["input"]], None
        else:  # read_binary_files(include_paths=True)
            paths, blobs = [str(p) for p in batch["path"]], list(batch["bytes"])
        reads = list(self.pool.map(self._read, paths, blobs or [None] * len(paths)))
        answers: list[Any] = [error for _, error in reads]
        good = [(i, sample) for i, (sample, error) in enumerate(reads) if error is None]
        for start in range(0, len(good), self.batch_size):
            chunk = good[start:start + self.batch_size]
            for (i, _), answer in zip(chunk, self._infer([(paths[i], s) for i, s in chunk])):
                answers[i] = answer
        return pa.table(_rows(paths, answers), schema=record_schema())

    def _answer_texts(self, batch: dict[str, np.ndarray]):
        """Rows of `input`, `text` and `read_error`, answered by the local engine's text function."""
        import pyarrow as pa

        from accel_opt.preprocess.text import TextItem
        from accel_opt.runtime.answer import answer_texts

        ids = [str(p) for p in batch["input"]]
        items = [TextItem(i, None if e else str(t), str(e) or None) for i, t,
                 e in zip(ids, batch["text"], batch["read_error"])]
        answers, _ = answer_texts(self.runner, self.deployment, self.writer, items)
        return pa.table(_rows(ids, answers), schema=record_schema())

    def _read(self, path: str, blob: bytes | None) -> tuple[Any, str | None]:
        """(feed dict, None) or (None, the reason): the local engine's reader, on this node's copy of the input."""
        copy = None
        try:
            file = local_path(path) if blob is None else None
            if file is None:  # bytes given, or another file system: a local copy keeps every check the same
                file = copy = self._local_copy(path, blob)
            return self.reader.read(file), None
        except InputRejected as exc:
            return None, str(exc)
        except Exception as exc:  # noqa: BLE001 - a row with its reason, never a failed block
            return None, f"unreadable ({first_line(exc)})"
        finally:
            if copy is not None:
                Path(copy).unlink(missing_ok=True)

    def _local_copy(self, uri: str, blob: bytes | None) -> str:
        if blob is None:
            import pyarrow.fs

            try:
                fs, inner = pyarrow.fs.FileSystem.from_uri(uri)
                with fs.open_input_stream(inner) as stream:
                    blob = stream.read()
            except FileNotFoundError:
                raise InputRejected("not found") from None
        if self.scratch is None:
            self.scratch = tempfile.mkdtemp(prefix="accel-opt-ray-")
            weakref.finalize(self, shutil.rmtree, self.scratch, ignore_errors=True)  # also at the worker's exit
        with tempfile.NamedTemporaryFile(dir=self.scratch, suffix=Path(uri).suffix, delete=False) as f:
            f.write(blob)
        return f.name

    def _infer(self, batch: list[tuple[str, dict]]) -> list[tuple[dict[str, Any], bytes | None] | str]:
        """Each input's (record, .npz bytes or None), or the reason it failed; a failed batch is retried input by input.
        """
        from accel_opt.runtime.answer import infer_batch

        try:
            outputs = infer_batch(self.runner, self.deployment, batch, self.batch_size)
            # The local engine's own record (top-k, or the outputs' .npz), not a second format.
            return [self.writer.answer(path, out) for (path, _), out in zip(batch, outputs)]
        except Exception as exc:  # noqa: BLE001
            if len(batch) == 1:
                return [f"inference failed ({first_line(exc)})"]
            return [answer for item in batch for answer in self._infer([item])]


def _rows(ids: list[str], answers: list) -> dict[str, list[Any]]:
    """`record_schema()` columns from each input's answer: (record fields, .npz bytes or None), or its error."""
    rows: dict[str, list[Any]] = {"input": ids,
                                  **{c: [None] * len(ids) for c in ("top1", "record", "outputs_npz", "error")}}
    for i, answer in enumerate(answers):
        if isinstance(answer, str):
            rows["error"][i] = answer
        else:
            record, rows["outputs_npz"][i] = answer
            rows["record"][i] = json.dumps({"input": ids[i], **record})
            rows["top1"][i] = record.get("top1")
    return rows


def actor_pool(actors: tuple[int, int]):
    """An autoscaling pool of `actors` = (min, max). A fixed-size pool that loses a node can wait forever for
    the dead actor's slot (ray #62746); with min below max the pool goes on with the actors it has."""
    from ray.data import ActorPoolStrategy

    low, high = actors
    return ActorPoolStrategy(min_size=low, max_size=high)


def predict(dataset, artifact: str | os.PathLike, actors: tuple[int, int] = (1, 2), cpus_per_actor: int = 1,
            rows_per_call: int = ROWS_PER_CALL, recheck: bool = True, outputs_dir: str | None = None,
            identity: str | None = None, public_key: str | os.PathLike | None = None,
            certificate_chain: tuple[str | os.PathLike, ...] = (), trust_unsigned: bool = False,
            allow_not_signed_off: bool = False):
    """`dataset` (rows with `input`, or `path` and `bytes`) answered by `artifact`: a Dataset of `record_schema()`
    rows, one per input row, in no promised order. Trust as `runtime.load` takes it, checked here first (a usage
    error or an untrusted folder fails before any actor starts) and then by every actor that loads the folder; a
    folder its build did not sign off is refused by every actor unless `allow_not_signed_off`."""
    from accel_opt.artifact.signing import TrustPolicy

    trust = TrustPolicy.of(public_key, certificate_chain, trust_unsigned).as_arguments()
    require_ray()
    from ray.data import DataContext

    if DataContext.get_current().max_errored_blocks != 0:  # Ray would drop whole blocks of answers without a word
        log.warning("DataContext.max_errored_blocks is %d: failed blocks' inputs will be missing from the answers",
                    DataContext.get_current().max_errored_blocks)
    return dataset.map_batches(
        Predictor, fn_constructor_kwargs={"artifact": str(artifact), "threads": cpus_per_actor, "recheck": recheck,
                                          "outputs_dir": outputs_dir, "identity": identity,
                                          "allow_not_signed_off": allow_not_signed_off, **trust},
        compute=actor_pool(actors), num_cpus=cpus_per_actor, batch_size=rows_per_call, batch_format="numpy",
    )
