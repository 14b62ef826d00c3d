"""A reader's spool: one scratch file under ``$TMPDIR`` holding row-major copies of tensors a
checkpoint stores otherwise (a transposed view, a stepped slice, a zstd-compressed chunk), so the
copy path reads every piece as row-major bytes at an offset.

The spool is lazy. A reader opening a checkpoint only *reserves* a region per such tensor
(:meth:`LazySpool.reserve`: its size is known from the metadata, so every piece's offset is
fixed before any byte is made) with a :data:`Fill` that makes its bytes. Nothing is written
then: the file (sparse, at its full size) and its directory are made when a reader of the
copy path first needs one of its bytes, and a region is filled when a read first covers it
(:meth:`LazySpool.ensure`, called by :class:`~reshard.io.pages.SourceFiles` before every read
of the spool; once per region, whichever thread asks first, the others waiting for it). So
``inspect`` and ``plan`` decompress and write nothing, and ``convert --include`` makes only
the selected tensors' regions.

Each region remembers where its bytes come from (:attr:`LazySpool.origins`: the checkpoint
file and byte range), so reports name the checkpoint's own files, never the spool
(:attr:`reshard.checkpoint.Checkpoint.spooled`). The directory is a
:func:`~reshard.io.pages.reserve_scratch` one (removed at exit, under torchrun too).
"""

from __future__ import annotations

import mmap
import os
import threading
from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import product
from pathlib import Path
from typing import BinaryIO

from ..errors import HeaderError, WriteError
from ..intervals import row_major_strides
from .pages import make_scratch, register_lazy, reserve_scratch

__all__ = ["LazySpool", "Fill", "SpoolCheckError", "strided_span", "SPOOL_TILE", "FAULT_AROUND"]
#: Bytes of the destination (and at most of the source's touched pages) copied per tile.
SPOOL_TILE = 8 << 20
#: What one touched element of a file map may bring into memory: the kernel maps the cached
#: pages around a faulting one (``fault_around_bytes``, 64 KiB by default).
FAULT_AROUND = 64 << 10
_BLOCK = 1 << 20


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def strided_span(size: Sequence[int], stride: Sequence[int]) -> int:
    """Elements from a strided tensor's first element to its last, plus one (0 when empty).

    >>> strided_span((3, 4), (12, 1)), strided_span((4, 6), (1, 4)), strided_span((2, 0), (1, 1))
    (28, 24, 0)
    """
    if any(s == 0 for s in size):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(size, stride, strict=True))


def _footprint(tile: Sequence[int], stride: Sequence[int], isz: int) -> int:
    """About the bytes of a map a copy of ``tile`` elements at ``stride`` brings into memory: its
    span, or less when its contiguous runs are far apart (each run, and the :data:`FAULT_AROUND`
    bytes the kernel maps around a faulting page of a file map)."""
    n = _numel(tile)
    if n == 0:
        return 0
    inner = [d for d in range(len(tile)) if stride[d] == 1 and tile[d] > 1]
    run = tile[inner[0]] if inner else 1
    return min(strided_span(tile, stride) * isz, n // run * (run * isz + FAULT_AROUND))


def _tile(size: Sequence[int], stride: Sequence[int], isz: int, budget: int) -> list[int]:
    """Tile sizes whose copy brings at most about ``budget`` bytes of the source's map and of the
    destination's (row-major) into memory: a transposed copy goes in squares, a column of a big
    matrix (stride ``n``) a few thousand elements a tile."""
    dst = row_major_strides(size)
    tile = list(size)
    while any(t > 1 for t in tile):
        fs, fd = _footprint(tile, stride, isz), _footprint(tile, dst, isz)
        if max(fs, fd) <= budget:
            break
        st = stride if fs >= fd else dst  # halve the dim that spans the most bytes of the worse side
        k = max((d for d in range(len(tile)) if tile[d] > 1), key=lambda d: ((tile[d] - 1) * st[d], tile[d]))
        tile[k] = (tile[k] + 1) // 2
    return tile


Fill = Callable[["LazySpool", int], None]
"""Makes a region's bytes: called with the spool and the region's start (its size is the one
reserved); writes them with :meth:`LazySpool.write_stream` or :meth:`LazySpool.write_strided`.
Raises a :class:`~reshard.errors.ReshardError` naming the checkpoint's file and tensor."""


class SpoolCheckError(HeaderError):
    """The stored bytes a spooled region is made from fail the CRC32 their file recorded
    (``inspect --check`` reports it as a ``crc32`` problem; any other command exits 2)."""


class LazySpool:
    """A scratch file of row-major copies, each region reserved when the checkpoint is opened and
    filled when first read.

    Args:
        prefix: the scratch directory's name prefix (``reshard-dcp-``).

    Attributes:
        path: where the file is (made on first use), reserved at once so a checkpoint can list it.
        size: the bytes reserved so far: the file's size once made.
        origins: per region, ``(start, stop, file, origin_start, origin_stop)``: bytes
            ``[start, stop)`` of the spool are made from bytes ``[origin_start, origin_stop)`` of
            the caller's file number ``file``; in increasing ``start``.
    """

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._path: Path | None = None
        self.fd = -1
        self.size = 0
        self.origins: list[tuple[int, int, int, int, int]] = []
        self._starts = array("q")
        self._stops = array("q")
        self._fills: list[Fill | None] = []  # None once filled (what it held is freed)
        self._errors: dict[int, BaseException] = {}
        self._pending = 0
        self._lock = threading.Lock()
        self._locks: dict[int, threading.Lock] = {}
        self.filled = 0  # regions filled (for tests and reports)

    @property
    def path(self) -> Path:
        if self._path is None:
            self._path = reserve_scratch(self._prefix) / "spool.bin"
            register_lazy(str(self._path), self)
        return self._path

    def __len__(self) -> int:
        return len(self._fills)

    def reserve(self, nbytes: int, origin: tuple[int, int, int], fill: Fill) -> int:
        """Reserve ``nbytes`` for a region that ``fill`` makes from ``origin`` (``(file, start,
        stop)`` of the caller's files); its offset in the spool (64-byte aligned)."""
        self.path  # noqa: B018 - the path is reserved with the first region
        start = -(-self.size // 64) * 64
        self.size = start + max(nbytes, 1)  # an empty region has a start of its own, too
        self._starts.append(start)
        self._stops.append(start + nbytes)
        self._fills.append(fill)
        self._pending += 1
        self.origins.append((start, start + nbytes, *origin))
        return start

    def open(self) -> int:
        """The spool's descriptor: the directory and the (sparse) file at its full size are made
        on first use.

        Raises:
            WriteError: the file cannot be made under ``$TMPDIR``.
        """
        if self.fd >= 0:
            return self.fd
        with self._lock:
            if self.fd < 0:
                path = self.path
                try:
                    make_scratch(path.parent)
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                except OSError as e:
                    raise self.full(e) from None
                try:
                    os.ftruncate(fd, self.size)
                except OSError as e:
                    os.close(fd)
                    raise self.full(e) from None
                self.fd = fd
        return self.fd

    def ensure(self, lo: int, hi: int) -> None:
        """Fill every region overlapping bytes ``[lo, hi)`` not filled yet (each once, whichever
        thread asks first; the others wait for it).

        Raises:
            ReshardError: a region's fill failed (the same error for every later read of it).
        """
        if not self._pending or hi <= lo:
            return
        starts, stops = self._starts, self._stops
        k = max(bisect_right(starts, lo) - 1, 0)
        n = len(starts)
        while k < n and starts[k] < hi:
            if stops[k] > lo and self._fills[k] is not None:
                self._fill(k)
            k += 1

    def ensure_piece(self, at: int, nbytes: int) -> None:
        """:meth:`ensure` of a piece of ``nbytes`` at ``at``; an empty one (a chunk of no element,
        which no read asks for) is filled too: its region is the one starting at ``at``.

        Raises:
            ReshardError: a region's fill failed.
        """
        if nbytes:
            self.ensure(at, at + nbytes)
            return
        k = bisect_right(self._starts, at) - 1
        if k >= 0 and self._starts[k] == at == self._stops[k] and self._fills[k] is not None:
            self._fill(k)

    def fill_all(self, on_check: Callable[[SpoolCheckError], None] | None = None) -> None:
        """Fill every region not filled yet (``inspect --check``); a region whose stored bytes fail
        their CRC32 is given to ``on_check`` (when set) and the others are filled still.

        Raises:
            ReshardError: a region's fill failed otherwise.
        """
        for k in range(len(self._fills)):
            if self._fills[k] is None:
                continue
            try:
                self._fill(k)
            except SpoolCheckError as e:
                if on_check is None:
                    raise
                on_check(e)

    def _fill(self, k: int) -> None:
        with self._lock:
            lock = self._locks.setdefault(k, threading.Lock())
        with lock:
            err = self._errors.get(k)
            if err is not None:
                raise err
            fill = self._fills[k]
            if fill is None:  # another thread filled it while this one waited
                return
            sfd = self.open()
            start, nbytes = self._starts[k], self._stops[k] - self._starts[k]
            if nbytes:
                try:  # room first: a store through the map into a full file system is SIGBUS
                    os.posix_fallocate(sfd, start, nbytes)
                except OSError as e:
                    raise self.full(e) from None
            try:
                fill(self, start)
            except BaseException as e:
                self._errors[k] = e
                raise
            with self._lock:
                self._fills[k] = None
                self._pending -= 1
                self.filled += 1
                del self._locks[k]

    def write_stream(self, src: BinaryIO, at: int, nbytes: int) -> int:
        """Write what ``src`` reads (at most ``nbytes``) at byte ``at`` of the spool; the bytes read.

        Raises:
            WriteError: no room under ``$TMPDIR``.
        """
        sfd = self.open()
        pos, end = at, at + nbytes
        while pos < end and (block := src.read(min(_BLOCK, end - pos))):
            self.pwrite_all(sfd, memoryview(block), pos)
            pos += len(block)
        return pos - at

    def pwrite_all(self, fd: int, view: memoryview, at: int) -> None:
        """Write all of ``view`` at byte ``at`` of file ``fd`` (the spool, or a fill's temporary
        beside it).

        Raises:
            WriteError: no room under ``$TMPDIR``.
        """
        while view:  # a short write (a file system filling up) writes the rest next
            try:
                n = os.pwrite(fd, view, at)
            except OSError as e:
                raise self.full(e) from None
            at += n
            view = view[n:]

    def write_strided(
        self,
        at: int,
        src_fd: int,
        first: int,
        size: tuple[int, ...],
        stride: tuple[int, ...],
        isz: int,
        tile_bytes: int = SPOOL_TILE,
    ) -> None:
        """Write the row-major copy of a strided tensor whose element 0 is at byte ``first`` of
        ``src_fd`` (strides in elements, none negative; the caller checked every element lies in
        the file) at byte ``at`` of the spool (a region reserved for it).

        Tile by tile through memory maps, released as it goes, so memory stays bounded (about
        ``tile_bytes`` of each map) whatever the tensor's size and strides.
        """
        import numpy as np

        sfd = self.open()
        numel = _numel(size)
        nbytes = numel * isz
        if not numel:
            return
        npt = np.dtype(f"u{isz}") if isz in (1, 2, 4, 8) else np.dtype(f"V{isz}")
        tile = _tile(size, stride, isz, tile_bytes)
        span = strided_span(size, stride)
        lo = first - first % mmap.ALLOCATIONGRANULARITY  # map only what the tensor spans
        src_mm = mmap.mmap(src_fd, first + span * isz - lo, access=mmap.ACCESS_READ, offset=lo)
        dlo = at - at % mmap.ALLOCATIONGRANULARITY
        dst_mm = mmap.mmap(sfd, at + nbytes - dlo, offset=dlo)
        try:
            flat = np.frombuffer(src_mm, npt, span, first - lo)
            logical = np.lib.stride_tricks.as_strided(flat, size, [s * isz for s in stride], writeable=False)
            out = np.frombuffer(dst_mm, npt, numel, at - dlo).reshape(size)
            for corner in product(*(range(0, n, t) for n, t in zip(size, tile, strict=True))):
                key = tuple(slice(c, c + t) for c, t in zip(corner, tile, strict=True))
                out[key] = logical[key]
                src_mm.madvise(mmap.MADV_DONTNEED)  # the page cache keeps them; RSS stays bounded
                dst_mm.madvise(mmap.MADV_DONTNEED)  # a shared file map: written pages live on in the cache
            del flat, logical, out
        finally:
            for mm in (src_mm, dst_mm):
                try:
                    mm.close()
                except BufferError:  # a numpy view still alive (an error mid-copy): it goes with it
                    pass

    def scratch_file(self) -> int:
        """A new unnamed read-write file beside the spool (a fill's temporary: it goes when closed).

        Raises:
            WriteError: it cannot be made under ``$TMPDIR``.
        """
        import tempfile

        self.open()
        try:
            fd, name = tempfile.mkstemp(dir=self.path.parent, prefix="part-")
            os.unlink(name)
        except OSError as e:
            raise self.full(e) from None
        return fd

    def full(self, e: OSError) -> WriteError:
        p = self.path
        return WriteError(
            f"{p}: cannot write the spool of decompressed or row-major tensor copies "
            f"({e.strerror or e}); set TMPDIR to a directory with more room",
            path=str(p),
        )

    def close(self) -> None:
        """Close the file (the reader's copy of it: the registry keeps the spool for the copy)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
