"""Source files opened once, and the window of mapped pages released as reading goes on.

Pages read through a memory map count in the process's RSS until released;
:class:`PageWindow` records what was read and drops whole mappings
(``MADV_DONTNEED``; the page cache keeps the data) every ``every`` bytes, so
memory stays bounded however large the source files are.

A mapped page past the end of a file that shrank (another job rewriting the
source) kills the process with SIGBUS, and no check before the read can close
the race with a truncation in between. So ``convert`` never reads source bytes
through a map: every byte comes from :meth:`SourceFiles.pread`, which fails with
a :class:`~reshard.errors.SourceChangedError` (exit 2) naming the file when it
ends early. A file's size is taken when it is opened (or given: the size its
header was read at); :meth:`SourceFiles.check` compares it with ``fstat`` (the
mapped readers of ``verify`` and ``inspect --check`` call it before each read).
Every byte :meth:`SourceFiles.pread` reads is shown to the ``seen`` hook, if
set: source verification hashes the bytes as the copy reads them.

A reader's lazy spool (:class:`~reshard.io.spool.LazySpool`, registered by its path with
:func:`register_lazy`) is a file whose regions are made when first read: before every
``pread`` of it, and before a mapped read (:meth:`SourceFiles.ready`), its regions under the
bytes read are filled.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from ..errors import HeaderError, SourceChangedError
from ..intervals import box_span
from .safe import open_regular

__all__ = [
    "SourceFiles",
    "PageWindow",
    "Seen",
    "Lazy",
    "scratch_dir",
    "reserve_scratch",
    "make_scratch",
    "is_scratch",
    "remove_scratch",
    "register_lazy",
    "lazy_file",
]


Seen = Callable[[int, int, memoryview], None]
"""A hook shown every span :meth:`SourceFiles.pread` reads: (file, offset, bytes)."""


class Lazy(Protocol):
    """A file made as it is read (:class:`~reshard.io.spool.LazySpool`)."""

    def open(self) -> int: ...  # makes the file, at its full size

    def ensure(self, lo: int, hi: int) -> None: ...  # makes bytes [lo, hi)


_LAZY: weakref.WeakValueDictionary[str, Lazy] = weakref.WeakValueDictionary()


def register_lazy(path: str, lazy: Lazy) -> None:
    """Make readers of ``path`` (a reader's spool) ask ``lazy`` for its bytes before reading them,
    for as long as ``lazy`` lives (its checkpoint holds it)."""
    _LAZY[path] = lazy


def lazy_file(path: str | os.PathLike[str]) -> Lazy | None:
    """The :class:`Lazy` registered for ``path``, or None for a plain file."""
    return _LAZY.get(os.fspath(path)) if _LAZY else None


class SourceFiles:
    """Open source files once: a file descriptor and a read-only map each, shared by threads.

    Args:
        paths: the files.
        sizes: the size each was read at (default: its size when first opened).
        seen: called with every span :meth:`pread` reads (from the reading thread).
    """

    def __init__(
        self, paths: Sequence[str], sizes: Sequence[int] | None = None, seen: Seen | None = None
    ) -> None:
        self._paths = list(paths)
        self._sizes: dict[int, int] = dict(enumerate(sizes)) if sizes is not None else {}
        self._fds: dict[int, int] = {}
        self._maps: dict[int, mmap.mmap] = {}
        self._lock = threading.Lock()
        self.seen = seen
        self._lazy = {i: z for i, p in enumerate(self._paths) if (z := lazy_file(p)) is not None}

    def fd(self, i: int) -> int:
        fd = self._fds.get(i)
        if fd is None:
            with self._lock:
                fd = self._fds.get(i)
                if fd is None:
                    lazy = self._lazy.get(i)
                    if lazy is not None:
                        lazy.open()  # a spool: made (sparse, at its full size) on first use
                    fd, st = open_regular(self._paths[i], what="source file", error=HeaderError)
                    self._sizes.setdefault(i, st.st_size)
                    self._fds[i] = fd
                    self.check(i)
        return fd

    def size(self, i: int) -> int:
        """The size file ``i`` was read at (its size when opened, unless given)."""
        self.fd(i)
        return self._sizes[i]

    def check(self, i: int) -> None:
        """Raise if file ``i`` no longer has the size it was read at (before a mapped read).

        Raises:
            SourceChangedError: naming the file and both sizes.
        """
        now = os.fstat(self.fd(i)).st_size
        if now != self._sizes[i]:
            path = self._paths[i]
            raise SourceChangedError(
                f"{path}: the source file changed while it was being read (size {self._sizes[i]} -> {now} "
                "bytes); is another job rewriting it? Convert again once it is finished",
                path=path,
            )

    def pread(self, i: int, buf: memoryview, offset: int) -> None:
        """Fill ``buf`` with the bytes of file ``i`` at ``offset`` (and show them to ``seen``).

        Raises:
            SourceChangedError: the file ends before ``offset + len(buf)``: it shrank since
                it was opened (named, with both sizes), or its header lied (caught earlier).
        """
        fd = self.fd(i)
        want = len(buf)
        if self._lazy:
            self.ready(i, offset, offset + want)
        got = os.preadv(fd, [buf], offset)
        while 0 < got < want:  # a short read that is not the end of the file
            n = os.preadv(fd, [buf[got:]], offset + got)
            if n <= 0:
                break
            got += n
        if got != want:
            self.check(i)  # names the file when its size changed
            path = self._paths[i]
            raise SourceChangedError(
                f"{path}: the source file ended early ({got} of {want} bytes at offset {offset}); "
                "it changed while being read",
                path=path,
            )
        if self.seen is not None:
            self.seen(i, offset, buf)

    def ready(self, i: int, lo: int, hi: int) -> None:
        """Make sure bytes ``[lo, hi)`` of file ``i`` are there: a lazy spool's regions under them
        are filled (call it before reading them through the map).

        Raises:
            ReshardError: a region could not be made (naming the checkpoint's file and tensor).
        """
        lazy = self._lazy.get(i)
        if lazy is not None:
            lazy.ensure(lo, hi)

    def map(self, i: int) -> mmap.mmap:
        mm = self._maps.get(i)
        if mm is None:
            fd = self.fd(i)
            with self._lock:
                mm = self._maps.get(i)
                if mm is None:
                    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                    self._maps[i] = mm
        return mm

    def release(self, i: int) -> None:
        """Drop every mapped page of file ``i`` from this process (the page cache keeps them).

        The whole mapping, not just the ranges read: the kernel maps neighbours of
        each faulting page too (fault-around, read-around), and those would pile up
        run after run. Walking the page tables of a mostly unmapped range is cheap.
        """
        mm = self._maps.get(i)
        if mm is not None and len(mm):
            mm.madvise(mmap.MADV_DONTNEED, 0, len(mm))

    def close(self) -> None:
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:  # a numpy view still alive; the map goes with it
                pass
        for fd in self._fds.values():
            os.close(fd)
        self._maps.clear()
        self._fds.clear()


FAULT_AROUND = 64 << 10
"""Bytes the kernel maps around a faulting page of a file map (Linux ``fault_around_bytes``)."""


class PageWindow:
    """Source pages read through the maps, released (whole mappings) every ``every`` bytes."""

    def __init__(self, sources: SourceFiles, every: int) -> None:
        self.sources = sources
        self.every = every
        self._touched: set[int] = set()
        self._touched_bytes = 0

    def touch_slices(
        self, fi: int, base: int, strides: Sequence[int], isz: int, key: Sequence[slice]
    ) -> None:
        """Record reading slices ``key`` of the row-major array at byte ``base`` of file ``fi``."""
        first, stop = box_span(strides, [s.start for s in key], [s.stop - s.start for s in key])
        self.touch_range(fi, base + first * isz, base + stop * isz)

    def touch_range(self, fi: int, lo: int, hi: int) -> None:
        """Record that bytes ``[lo, hi)`` of file ``fi`` were read through its map.

        A read counts at least :data:`FAULT_AROUND` bytes: the kernel maps that much around
        a faulting page, so small reads far apart (the pieces of 200k small tensors) map far
        more than they read (measured: 100 MiB of a file in RSS for a 16 MiB window).
        """
        self.sources.check(fi)
        self.sources.ready(fi, lo, hi)
        self._touched.add(fi)
        self._touched_bytes += max(hi - lo, FAULT_AROUND)
        if self._touched_bytes >= self.every:
            self._drop()

    def _drop(self) -> None:
        """Drop the mapped pages of the files touched since the last :meth:`release`, and keep
        them listed: a caller touches a range before it reads it, so the pages of the reads
        just recorded (this one, and one before it, e.g. the other side of a comparison) come
        in after the drop and must be dropped by the next one. (Forgetting them made every
        file's last read stay mapped: ``inspect --check`` of 8 DCP files of 128 MiB chunks
        held 8 x 32 MiB.)"""
        for fi in self._touched:
            self.sources.release(fi)
        self._touched_bytes = 0

    def release(self) -> None:
        """Drop every mapped page of the files read since the last release (call it after the
        reads, not before them)."""
        self._drop()
        self._touched.clear()


_SCRATCH: list[str] = []


def scratch_dir(prefix: str) -> Path:
    """A new private directory under ``$TMPDIR`` for files a reader makes (DCP's spool),
    removed when the process ends.

    At interpreter exit (``atexit``), and by :func:`remove_scratch`, which the command line
    calls itself before it leaves with ``os._exit`` under torchrun (that skips ``atexit``).
    """
    import atexit
    import tempfile

    if not _SCRATCH:
        atexit.register(remove_scratch)
    d = tempfile.mkdtemp(prefix=prefix)
    _SCRATCH.append(d)
    return Path(d)


def reserve_scratch(prefix: str) -> Path:
    """A name for a private directory under ``$TMPDIR`` that :func:`make_scratch` makes when it is
    first needed (nothing is made now), removed when the process ends as :func:`scratch_dir`'s."""
    import atexit
    import secrets
    import tempfile

    if not _SCRATCH:
        atexit.register(remove_scratch)
    d = os.path.join(tempfile.gettempdir(), prefix + secrets.token_hex(8))
    _SCRATCH.append(d)
    return Path(d)


def make_scratch(path: Path) -> None:
    """Make the directory :func:`reserve_scratch` named (private: mode 0700; an existing one, made
    by someone else, is refused: ``FileExistsError``)."""
    os.mkdir(path, 0o700)


def is_scratch(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is in a directory :func:`scratch_dir` made (a reader's file, not the source's)."""
    parent = os.path.dirname(os.fspath(path))
    return any(parent == d or parent.startswith(d + os.sep) for d in _SCRATCH)


def remove_scratch() -> None:
    """Remove every directory :func:`scratch_dir` made (open files in them go when closed)."""
    import shutil

    while _SCRATCH:
        shutil.rmtree(_SCRATCH.pop(), ignore_errors=True)
