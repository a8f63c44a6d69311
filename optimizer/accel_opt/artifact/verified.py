"""Load what was verified: a private copy of an artifact folder's files, and the shape every folder must have.

A folder can change between its check and its load: a shared model store another user writes to, a file swapped
after `verify` (or while a runner starts). So `runtime.load` copies every file of the folder into a folder only this
user can open, then verifies the signature, the hashes and the config on that copy and loads from it: nothing is
read from the original folder again. The copy is removed when its Deployment is; one whose process was killed
(Ray stops its workers with SIGKILL, at shutdown and when a node goes) is removed by the next load on the machine.

Shape: every entry of a folder is a regular file with a plain name; sub-folders, symbolic links, devices, pipes and
sockets are refused (exit 3), signed or not, so no loader follows a path out of the folder.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import weakref
from pathlib import Path

from accel_opt.artifact.folder import MANIFEST, SIGNATURE
from accel_opt.errors import InputRejected, ResourceExhausted, no_space_error
from accel_opt.files import ensure_free_space

COPY_PREFIX = "accel-opt-verified-"
MAX_MANIFEST_BYTES = 64 << 20  # a manifest lists names and hashes: a real one of thousands of files takes KiB


def plain_name(name: str) -> bool:
    """A file name that stays inside the folder: no separator, not '.', '..' or hidden-empty, no NUL."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")


def entry_problems(folder: Path) -> list[str]:
    """One line per entry of `folder` that is not a regular file (links are not followed)."""
    problems = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_symlink():
                problems.append(f"{entry.name}: a symbolic link (an artifact holds regular files only)")
            elif entry.is_dir(follow_symlinks=False):
                problems.append(f"{entry.name}/: a sub-folder (an artifact holds regular files only)")
            elif not entry.is_file(follow_symlinks=False):
                problems.append(f"{entry.name}: not a regular file (a device, pipe or socket)")
    return sorted(problems)


class PrivateCopy:
    """Owns a private copy's folder: removed when the last object holding this goes (a Deployment, its compiled
    model and every runner made from it), or at exit, or by `remove()`."""

    def __init__(self, path: Path):
        self.path = path
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(path), True)

    def remove(self) -> None:
        self._finalizer()


def _pid_namespace() -> int:
    """The PID namespace's id: containers sharing /tmp number their processes apart (0 where it cannot be read)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def copies_root() -> Path:
    """This user's folder of private copies in the temporary folder (mode 0700, owned by this user, not a link): the
    stale-copy sweep reads it alone, not the whole temporary folder (200,000 entries planted there cost 2 s per
    load). One that is not this user's own (made by another user first) is not used: the copy goes in the
    temporary folder itself."""
    temp = Path(tempfile.gettempdir())
    root = temp / f"accel-opt-copies-{os.getuid()}"
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return temp
    info = os.lstat(root)
    private = stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077
    return root if private else temp


def sweep_orphaned_copies(root: Path | None = None) -> list[Path]:
    """Remove this user's private copies whose process is gone (killed: it could not remove its own), in this PID
    namespace only; returns what was removed. A copy is named COPY_PREFIX + namespace-pid-random."""
    root = Path(root or copies_root())
    removed = []
    for entry in root.glob(f"{COPY_PREFIX}{_pid_namespace()}-*-*"):
        pid = entry.name[len(COPY_PREFIX):].split("-")[1]
        try:
            info = entry.lstat()
        except OSError:
            continue
        if info.st_uid == os.getuid() and stat.S_ISDIR(info.st_mode) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process holds the PID now
        return True
    return True


def private_copy(folder: Path) -> PrivateCopy:
    """A fresh folder (mode 0700) holding a copy of every file of `folder`, each opened without following links:
    an entry that is not a regular file is refused (exit 3). What the copy holds is then checked like any folder.

    Before anything is copied, the listing is checked against the manifest (read bounded): a file it does not list
    is refused (exit 3), and the files' sizes must fit the temporary folder (exit 5), so a folder cannot make a load
    write gigabytes (a sparse 3 GB file in a 712 KB folder did). Without a readable manifest only it is copied: the
    check on the copy then says what is wrong."""
    root = copies_root()
    sweep_orphaned_copies(root)
    names = _names_to_copy(folder)
    ensure_free_space(root, sum(os.lstat(folder / name).st_size for name in names))
    copy = Path(tempfile.mkdtemp(prefix=f"{COPY_PREFIX}{_pid_namespace()}-{os.getpid()}-", dir=root))
    try:
        for name in names:
            with os.fdopen(_open_regular(folder / name), "rb") as source, open(copy / name, "xb") as target:
                shutil.copyfileobj(source, target, 1 << 20)
    except BaseException as exc:
        shutil.rmtree(copy, ignore_errors=True)
        full = no_space_error(exc, tempfile.gettempdir())
        if full is not None:  # the copy is in the temporary folder, not --out
            raise ResourceExhausted(f"cannot copy {folder} to verify it: {full}".replace("choose another --out",
                                                                                       "set TMPDIR")) from None
        if isinstance(exc, InputRejected):
            raise InputRejected(f"{folder}: artifact altered or incomplete: {exc}") from None
        raise
    return PrivateCopy(copy)


def _names_to_copy(folder: Path) -> list[str]:
    """The entries of `folder` a private copy takes: every file its manifest lists, the manifest and a signature; a
    file the manifest does not list is refused as the check on the copy would refuse it (same line)."""
    present = sorted(os.listdir(folder))
    if MANIFEST not in present:
        return present  # nothing to copy beyond what the check refuses by name
    import json

    with os.fdopen(_open_regular(folder / MANIFEST), "rb") as f:
        text = f.read(MAX_MANIFEST_BYTES + 1)
    if len(text) > MAX_MANIFEST_BYTES:
        raise InputRejected(f"{folder}: {MANIFEST} is unreadable: over {MAX_MANIFEST_BYTES >> 20} MiB")
    try:
        listed = json.loads(text)["artifacts"]
        listed = set(listed) if isinstance(listed, dict) else None
    except (ValueError, KeyError, TypeError):
        listed = None
    if listed is None:  # unreadable: the check on the copy says why
        return [name for name in present if name in (MANIFEST, SIGNATURE)]
    for name in present:
        regular = stat.S_ISREG(os.lstat(folder / name).st_mode)  # links, folders, pipes: refused as such when copied
        if regular and name not in listed and name not in (MANIFEST, SIGNATURE):
            raise InputRejected(f"{folder}: artifact altered or incomplete: {name}: not part of the artifact (not in "
                                "the manifest)")
    return present


def _open_regular(path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # NONBLOCK: a FIFO does not hang the open
    except OSError as exc:
        if os.path.islink(path):
            raise InputRejected(f"{path.name}: a symbolic link (an artifact holds regular files only)") from None
        raise InputRejected(f"{path.name}: cannot be read ({exc.strerror or exc})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise InputRejected(f"{path.name}/: a sub-folder (an artifact holds regular files only)")
        raise InputRejected(f"{path.name}: not a regular file (a device, pipe or socket)")
    os.set_blocking(fd, True)
    return fd
