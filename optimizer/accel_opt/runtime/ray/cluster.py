"""The driver's connection to Ray: a local instance of its own, or a cluster's address, loopback kept loopback.

Two traps this module steps around (Ray 2.60):
- Ray rewrites a loopback address (127.0.0.1, localhost) to the machine's interface address before it
  connects, and advertises that address for every node; where that address is not reachable, a driver
  waits on "Failed to connect to GCS at <interface address>". With the environment variable
  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read when `ray` is imported, Ray's node address is 127.0.0.1 and a
  loopback address stays one: set for a local instance or a loopback --address (every node of a one-machine
  cluster needs it too, with node_ip_address="127.0.0.1").
- `ray.init()` with no address joins the cluster named in Ray's temp folder (`ray_current_cluster`), even a
  killed one, and hangs: a local instance is started with address="local" and a temp folder of its own.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from accel_opt.errors import ResourceExhausted, Unsupported, UsageError, first_line
from accel_opt.machine.cpu import available_cpus

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # node address 127.0.0.1; loopback not rewritten
LOCAL_OBJECT_STORE_MIB = 512  # paths in, JSON lines out: the default (30% of RAM, in /dev/shm) is far more than needed
CONNECT_TIMEOUT_S = 5.0


@dataclass
class RaySession:
    address: str  # "local" or the cluster's
    cpus: int  # in the cluster when the job starts
    start_seconds: float
    authentication: str = "unknown"  # Ray's mode as this driver sees it: "token" or "disabled"


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--address {address}: expected HOST:PORT of the cluster's head (the GCS), such as "
                         "10.0.0.5:6379")
    return host.strip("[]"), int(port)


def refuse_silent_address(address: str) -> None:
    """Unsupported (exit 4) at once when nothing listens at `address`, instead of Ray's long retries."""
    host, port = split_address(address)
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise Unsupported(f"--address {address}: no Ray cluster answers there ({exc.strerror or first_line(exc)}); "
                          "start one (`ray start --head`) or give its head's HOST:PORT") from None


def pin_loopback() -> None:
    """Keep Ray on 127.0.0.1 (see the module's note); must run before `ray` is first imported."""
    os.environ.update(LOOPBACK_ENV)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # imported already (a Python API user): the constant was read at import
        constants.ENABLE_RAY_CLUSTER = False


def authentication_mode() -> str:
    """Ray's authentication mode in this process: "token", "disabled", or "unknown" (a Ray without the API)."""
    try:
        from ray._raylet import AuthenticationMode, get_authentication_mode

        return "token" if get_authentication_mode() == AuthenticationMode.TOKEN else "disabled"
    except (ImportError, AttributeError):
        return "unknown"


@contextmanager
def ray_session(address: str | None, verbose: bool = False, num_cpus: int | None = None) -> Iterator[RaySession]:
    """Connected to Ray for the block: `address` None (or "local") starts a local instance, shut down after."""
    from accel_opt.runtime.ray.predictor import require_ray

    local = address in (None, "local")
    if not local:
        refuse_silent_address(address)
    if local or split_address(address)[0] in LOOPBACK_HOSTS:
        pin_loopback()
    if sys.modules.get("ray") is None:  # read at import: a straggling Ray call must not start a new Ray at exit
        os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    if not verbose:  # Ray's C++ core worker logs warnings to the driver's stderr, above the job's own summary line
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    ray = require_ray()
    if ray.is_initialized():  # the caller's own session (Python API): used as it is, left running
        yield RaySession(address=ray.get_runtime_context().gcs_address, cpus=int(ray.cluster_resources().get("CPU", 0)),
                         start_seconds=0.0)
        return
    # Short: Ray's socket paths are limited. Ray makes its temp folder and the sockets/, logs/ and runtime_resources/
    # in it world-writable (0777): inside this 0700 folder of this user's, no other user can reach them.
    temp_dir = tempfile.mkdtemp(prefix="aoray-", dir="/tmp") if local else None
    if local:
        options_temp = os.path.join(temp_dir, "r")
    options = {"log_to_driver": verbose, "logging_level": logging.INFO if verbose else logging.ERROR}
    if local:
        # Token authentication: without it anyone who reaches the cluster's ports runs code in it. Ray (>= 2.59, the
        # version required) turns it on for the local cluster ray.init starts, refreshing its cached config; setting
        # RAY_AUTH_MODE here, after `import ray` read the config, would leave this driver without its token while the
        # cluster demands one ("Failed to start GCS"). An explicit RAY_AUTH_MODE=disabled is the user's choice; the
        # summary says which mode ran.
        options.update(address="local", num_cpus=num_cpus or available_cpus(), include_dashboard=False,
                       object_store_memory=LOCAL_OBJECT_STORE_MIB << 20, _temp_dir=options_temp,
                       _node_ip_address="127.0.0.1")
    else:
        options.update(address=address)
    started = time.perf_counter()
    try:
        with _stderr_kept_back(not verbose):
            ray.init(**options)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)
        raise Unsupported(f"Ray at {address or 'local'} did not start or answer: {first_line(exc)}") from None
    try:
        start_seconds = time.perf_counter() - started
        _configure_data(verbose)
        cpus = int(ray.cluster_resources().get("CPU", 0))
        if cpus < 1:
            raise ResourceExhausted(f"the Ray cluster at {address} has no CPUs to run actors on")
        log.info("Ray %s: %d CPUs, started in %.1f s", address or "local", cpus, start_seconds)
        yield RaySession(address=address or "local", cpus=cpus, start_seconds=start_seconds,
                         authentication=authentication_mode())
    finally:
        ray.shutdown()
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)


@contextmanager
def _stderr_kept_back(enabled: bool) -> Iterator[None]:
    """Ray's C++ layer writes to file descriptor 2 at start-up ("Set ray log level from environment variable ...",
    whatever the level), above the job's own lines. Kept back while Ray starts, and replayed if the start fails."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _configure_data(verbose: bool) -> None:
    """Nothing dropped, nothing retried behind our back, no progress bars in the job's stderr."""
    from ray.data import DataContext

    context = DataContext.get_current()
    context.max_errored_blocks = 0  # > 0 would drop whole blocks of answers without a word
    context.actor_task_retry_on_errors = False  # our code turns every per-input error into a row
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.INFO if verbose else logging.CRITICAL)  # our line says what failed


def as_accel_opt_error(exc: BaseException) -> BaseException:
    """Our own typed error inside Ray's wrappers (a failed actor's constructor, a task's exception), so its
    line and exit code reach the user; else `exc` itself (an internal error)."""
    from accel_opt.errors import AccelOptError

    seen: set[int] = set()
    stack = [exc]
    wrapped = None  # Ray's RayTaskError(InputRejected): an instance of both, its text a traceback
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, AccelOptError):
            if type(current).__module__.startswith("accel_opt"):
                return current
            wrapped = wrapped or current
        stack += [current.__cause__, current.__context__, getattr(current, "cause", None),
                  getattr(current, "creation_task_error", None)]
    if wrapped is not None:
        ours = next(c for c in type(wrapped).__mro__ if issubclass(c, AccelOptError)
                    and c.__module__.startswith("accel_opt"))
        return ours(first_line(wrapped, limit=600))
    # An actor whose constructor raised keeps only the text of the traceback (ActorDiedError): its last line
    # "accel_opt.errors.InputRejected: on node ...: ..." names our error.
    import accel_opt.errors as errors

    for line in reversed(str(exc).splitlines()):
        name, _, message = line.strip().partition(": ")
        error_class = getattr(errors, name.removeprefix("accel_opt.errors."),
                              None) if name.startswith("accel_opt.errors.") else None
        if isinstance(error_class, type) and issubclass(error_class, AccelOptError):
            return error_class(message)
    return exc
