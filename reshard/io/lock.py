"""One conversion per output directory: an advisory lock on ``DST/.reshard.lock``.

Two conversions writing one directory would replace each other's files and remove
each other's temporaries on failure. The lock is ``flock(2)`` on a file opened
without following links; it holds the owner's pid, host and command, so a second
run says who holds it. The kernel drops a lock when its holder dies (even on
SIGKILL), so a stale lock file never blocks: only a live holder does.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
from pathlib import Path

from ..errors import UsageError
from ..text import shown
from .safe import file_kind

__all__ = ["LOCK", "DirLock"]

LOCK = ".reshard.lock"


class DirLock:
    """Hold ``DIR/.reshard.lock`` exclusively while converting into ``DIR``.

    Raises (from :meth:`acquire`):
        UsageError: another live process holds the lock (naming it), or the lock
            path is a link or not a regular file.
    """

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK
        self.fd: int | None = None

    def acquire(self) -> DirLock:
        for _ in range(10):  # the holder may remove the file between our open and flock
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise UsageError(
                    f"{self.path.parent}: another reshard run is writing into this directory ({holder}); "
                    "wait for it to finish, or choose another destination",
                    path=str(self.path),
                ) from None
            st = os.fstat(fd)
            try:
                now = os.stat(self.path, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                os.ftruncate(fd, 0)
                os.pwrite(fd, _description().encode("utf-8", "backslashreplace"), 0)  # argv: any bytes
                self.fd = fd
                return self
            os.close(fd)  # locked a file its holder unlinked: try the new one
        raise UsageError(f"{self.path}: cannot take the lock (it keeps changing)", path=str(self.path))

    def _open(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | os.O_NONBLOCK
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UsageError(
                    f"{self.path}: is a symbolic link; reshard does not write through links in the "
                    "destination: remove it",
                    path=str(self.path),
                ) from None
            if e.errno == errno.EISDIR:
                raise UsageError(
                    f"{self.path}: is a directory, not reshard's lock file: remove it", path=str(self.path)
                ) from None
            # a read-only file system, a directory this user cannot write: nothing written yet
            raise UsageError(
                f"{self.path.parent}: cannot write into the destination ({e.strerror or e})",
                path=str(self.path.parent),
            ) from None
        kind = file_kind(os.fstat(fd).st_mode)
        if kind is not None:
            os.close(fd)
            raise UsageError(
                f"{self.path}: is {kind}, not reshard's lock file: remove it", path=str(self.path)
            )
        return fd

    def release(self) -> None:
        """Remove the lock file (while still holding it) and unlock."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None


def _description() -> str:
    cmd = " ".join(sys.argv)[:400]
    return f"pid {os.getpid()} on {socket.gethostname()}: {cmd}\n"


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 1024, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return f"held by {shown(text)}" if text else "lock held"
