"""The folder a job writes into, held open so that no symbolic link on the way is followed.

A link planted in a shared folder on the way to `--out` (`shared/sub -> victim/`) would take the job's lock,
predictions and outputs somewhere else. Before anything is written, each folder on the way is checked
(refuse_foreign_links: another user's link is refused; this user's and the system's are followed, Linux's
protected_symlinks rule); then the folder is opened once, component by component without following a link
(PinnedFolder), and every file is opened relative to that descriptor, its own name never through a link. A folder
swapped for a link after the checks is then refused, never written through: there is no window between check and
open.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accel_opt.errors import UsageError


def planted_link(path: Path) -> UsageError:
    return UsageError(f"{path} is a symbolic link: accel-opt run never writes through one (remove it, or choose "
                      "another --out)")


def refuse_foreign_links(path: Path) -> None:
    """UsageError when a folder on the way to `path` is a symbolic link another user owns (not this user, not root):
    a link planted in a shared folder (`shared/sub -> victim/`) would take the job's lock, predictions and outputs
    somewhere else. This user's own links, and the system's, are followed: the rule of Linux's protected_symlinks."""
    here = Path(os.path.abspath(path)).parent
    for folder in [*reversed(here.parents), here]:
        try:
            info = os.lstat(folder)
        except OSError:
            return  # not there yet: created by the job, as a real folder
        if stat.S_ISLNK(info.st_mode) and info.st_uid not in (os.getuid(), 0):
            raise UsageError(f"{folder} is a symbolic link owned by another user (uid {info.st_uid}): accel-opt run "
                             "never writes through one (choose another --out)")


class PinnedFolder:
    """A folder held open by a descriptor, found from the root one component at a time without following a link
    (the path resolved first: this user's and the system's links, which refuse_foreign_links allows). Every file of
    the job is opened relative to it, its own name never through a link, so a folder on the way swapped for a link
    after the checks (`shared/sub -> victim/` mid-job) is refused, never written through."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def of(cls, path: Path) -> PinnedFolder:
        fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in Path(os.path.realpath(path)).parts[1:]:
                try:
                    inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a link (or a file) where a folder was resolved
                        raise UsageError(f"{path}: the folder {part!r} on the way changed into a symbolic link or a "
                                         "file: accel-opt run never writes through one (choose another "
                                         "--out)") from None
                    raise
                os.close(fd)
                fd = inner
        except BaseException:
            os.close(fd)
            raise
        return cls(Path(path), fd)

    def open(self, name: str, flags: int, mode: int = 0o644) -> int:
        """os.open of `name` in this folder, never following a link there (a planted one: exit 2 naming it)."""
        try:
            return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise planted_link(self.path / name) from None
            raise

    def exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def folder(self, name: str) -> PinnedFolder:
        """The folder `name` in this one, created if absent; a link or a file there: exit 2."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, dir_fd=self.fd)
        try:
            return PinnedFolder(self.path / name, self.open(name, os.O_RDONLY | os.O_DIRECTORY))
        except NotADirectoryError:
            raise UsageError(f"{self.path / name} is not a folder: accel-opt run writes its outputs into a folder "
                             "there (remove it, or choose another --out)") from None

    def remove_tree(self, name: str) -> None:
        shutil.rmtree(name, dir_fd=self.fd, ignore_errors=True)  # a link there is removed, never followed

    def unlink(self, name: str) -> None:
        os.unlink(name, dir_fd=self.fd)

    def write_whole(self, name: str, write: Callable[[Any], None], temporary: str | None = None,
                    sync_folder: bool = True) -> None:
        """`write(file)` into a new temporary file here (`temporary`, or a random name), synced, then renamed over
        `name` (a link there is replaced, never written through): the file is whole or absent. `sync_folder`: the
        rename itself synced too (it survives a crash)."""
        temporary = temporary or f".{name[:200]}.{secrets.token_hex(4)}.tmp"
        try:
            with os.fdopen(self.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=self.fd)
            raise
        if sync_folder:
            os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)
