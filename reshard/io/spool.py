"""A reader's spool: one scratch file under ``$TMPDIR`` holding row-major copies of tensors a
checkpoint stores otherwise (a transposed view, a stepped slice, a zstd-compressed chunk), so the
copy path reads every piece as row-major bytes at an offset.

Each region written remembers where its bytes came from (:attr:`Spool.origins`: the checkpoint
file and byte range), so reports name the checkpoint's own files, never the spool
(:attr:`reshard.checkpoint.Checkpoint.spooled`). The file is made on first use in a
:func:`~reshard.io.pages.scratch_dir` (removed at exit, under torchrun too).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from itertools import product
from pathlib import Path
from typing import BinaryIO

from ..errors import WriteError
from ..intervals import row_major_strides
from .pages import scratch_dir

__all__ = ["Spool", "strided_span", "SPOOL_TILE", "FAULT_AROUND"]

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


class Spool:
    """A scratch file of row-major copies; ``origins`` lists each region's source.

    Attributes:
        origins: per region written, ``(start, stop, file, origin_start, origin_stop)``: bytes
            ``[start, stop)`` of the spool came from bytes ``[origin_start, origin_stop)`` of the
            caller's file number ``file``; in increasing ``start``.
    """

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self.path: Path | None = None
        self.fd = -1
        self.origins: list[tuple[int, int, int, int, int]] = []

    def open(self) -> int:
        """The spool's descriptor (the file is made on first use)."""
        if self.fd < 0:
            self.path = scratch_dir(self._prefix) / "spool.bin"  # removed at exit, under torchrun too
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        return self.fd

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size if self.fd >= 0 else 0

    def strided(
        self,
        src_fd: int,
        first: int,
        size: tuple[int, ...],
        stride: tuple[int, ...],
        isz: int,
        origin: tuple[int, int, int],
        tile_bytes: int = SPOOL_TILE,
    ) -> int:
        """Append the row-major copy of a strided tensor whose element 0 is at byte ``first`` of
        ``src_fd`` (strides in elements, none negative; the caller checked every element lies in
        the file); its offset in the spool.

        Tile by tile through memory maps, released as it goes, so memory stays bounded (about
        ``tile_bytes`` of each map) whatever the tensor's size and strides.

        Raises:
            WriteError: no room under ``$TMPDIR``.
        """
        import numpy as np

        sfd = self.open()
        start = os.fstat(sfd).st_size
        numel = _numel(size)
        nbytes = numel * isz
        if numel:
            try:  # room first: a store through the map into a full file system is SIGBUS
                os.posix_fallocate(sfd, start, nbytes)
            except OSError as e:
                raise self.full(e) from None
            os.ftruncate(sfd, start + nbytes)
            npt = np.dtype(f"u{isz}") if isz in (1, 2, 4, 8) else np.dtype(f"V{isz}")
            tile = _tile(size, stride, isz, tile_bytes)
            span = strided_span(size, stride)
            lo = first - first % mmap.ALLOCATIONGRANULARITY  # map only what the tensor spans
            src_mm = mmap.mmap(src_fd, first + span * isz - lo, access=mmap.ACCESS_READ, offset=lo)
            dlo = start - start % mmap.ALLOCATIONGRANULARITY
            dst_mm = mmap.mmap(sfd, start + nbytes - dlo, offset=dlo)
            try:
                flat = np.frombuffer(src_mm, npt, span, first - lo)
                logical = np.lib.stride_tricks.as_strided(
                    flat, size, [s * isz for s in stride], writeable=False
                )
                out = np.frombuffer(dst_mm, npt, numel, start - dlo).reshape(size)
                for corner in product(*(range(0, n, t) for n, t in zip(size, tile, strict=True))):
                    key = tuple(slice(c, c + t) for c, t in zip(corner, tile, strict=True))
                    out[key] = logical[key]
                    src_mm.madvise(mmap.MADV_DONTNEED)  # the page cache keeps them; RSS stays bounded
                    dst_mm.madvise(
                        mmap.MADV_DONTNEED
                    )  # a shared file map: written pages live on in the cache
                del flat, logical, out
            finally:
                for mm in (src_mm, dst_mm):
                    try:
                        mm.close()
                    except BufferError:  # a numpy view still alive (an error mid-copy): it goes with it
                        pass
        self.origins.append((start, start + nbytes, *origin))
        return start

    def stream(self, src: BinaryIO, origin: tuple[int, int, int]) -> tuple[int, int]:
        """Append what ``src`` reads to its end (a decompressor); its (offset, size) in the spool.

        Raises:
            WriteError: no room under ``$TMPDIR``.
        """
        sfd = self.open()
        start = pos = os.fstat(sfd).st_size
        while block := src.read(_BLOCK):
            view = memoryview(block)
            while view:  # a short write (a file system filling up) writes the rest next
                try:
                    n = os.pwrite(sfd, view, pos)
                except OSError as e:
                    raise self.full(e) from None
                pos += n
                view = view[n:]
        self.origins.append((start, pos, *origin))
        return start, pos - start

    def full(self, e: OSError) -> WriteError:
        p = self.path
        return WriteError(
            f"{p}: cannot write the spool of decompressed or row-major tensor copies "
            f"({e.strerror or e}); set TMPDIR to a directory with more room",
            path=str(p),
        )

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
