"""Reading boxes of source pieces: the one way convert, verify, check and load_dtensors read data.

A source piece is a row-major local tensor at an absolute byte offset of a file
(:class:`reshard.checkpoint.TensorSource`). :func:`read_box` returns the items of
one box of it as a numpy array of unsigned integers of the item size (so every
bit pattern survives, NaN payloads and ``-0.0`` included):

* with a :class:`RowCache`, when the box's span holds at most :data:`DENSE` times
  the bytes needed, the whole rows around it are read with one ``pread`` into the
  cache, and a strided view of them is returned (no page faults, no mapped pages;
  sibling output files asking for other columns of the same rows hit the cache);
* otherwise a view of the file's read-only memory map, the pages recorded in a
  :class:`~reshard.io.pages.PageWindow` that releases them as reading goes on.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from ..checkpoint import TensorSource
from ..dtypes import DTYPE_SIZES
from ..errors import SourceChangedError
from ..intervals import box_span, row_major_strides
from .pages import PageWindow, SourceFiles

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    Items = npt.NDArray[np.unsignedinteger[Any]]
else:
    Items = Any

__all__ = ["DENSE", "Items", "uint_dtype", "Piece", "RowCache", "read_box", "MappedFiles"]

DENSE = 8
"""A strided source span is read whole with one pread when it holds at most this many
times the bytes needed: cheaper than the page faults of reading it through the map
(measured: HF -> TP-8, 1/8-width columns, 0.88 s against 1.04 s, and less RSS)."""


@cache
def uint_dtype(itemsize: int) -> Any:
    """The numpy unsigned integer type of an item size (items are moved as raw bits)."""
    import numpy as np

    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]


@dataclass(frozen=True, slots=True)
class Piece:
    """Piece ``k`` of a tensor as read: its file, byte offset, shape, strides and mapped view."""

    fi: int
    base: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    count: int
    arr: Items

    @classmethod
    def of(
        cls, sources: SourceFiles, src: TensorSource, k: int, shape: tuple[int, ...] | None = None
    ) -> Piece:
        """Map piece ``k`` of ``src`` (``shape``: its local shape, when the caller has it)."""
        import numpy as np

        if shape is None:
            shape = src.piece_shape(k)
        isz = DTYPE_SIZES[src.dtype]
        fi = src.piece_files[k]
        base = src.piece_offsets[k]
        count = 1
        for x in shape:
            count *= x
        arr = np.frombuffer(sources.map(fi), dtype=uint_dtype(isz), count=count, offset=base).reshape(shape)
        return cls(fi, base, shape, row_major_strides(shape), isz, count, arr)


class RowCache:
    """Source spans read whole with one ``pread``, kept for the next reader of the same rows.

    ``window`` says what ``buf`` holds, ``(file, lo, hi)`` in file bytes, so writers of
    sibling files that need other columns of the same rows take them from it.
    """

    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)
        self.window: tuple[int, int, int] | None = None

    def read(self, fd: int, fi: int, lo: int, hi: int, wlo: int, whi: int) -> int | None:
        """Make file bytes ``[lo, hi)`` of file ``fi`` available in ``buf``; returns where they start.

        A hit costs nothing. A miss reads the window ``[wlo, whi)`` (the whole rows around
        ``[lo, hi)``) when it fits in ``buf``, else just ``[lo, hi)``; None when even that
        does not fit (the caller reads through the map instead).
        """
        w = self.window
        if w is not None and w[0] == fi and w[1] <= lo and hi <= w[2]:
            return lo - w[1]
        if whi - wlo > len(self.buf):
            wlo, whi = lo, hi
            if hi - lo > len(self.buf):
                return None
        self.window = None
        n = whi - wlo
        got = os.preadv(fd, [memoryview(self.buf)[:n]], wlo)
        if got != n:
            raise SourceChangedError(
                f"a source file ended early: {got} of {n} bytes at offset {wlo}; it changed while being read"
            )
        self.window = (fi, wlo, whi)
        return lo - wlo


def read_box(pages: PageWindow, piece: Piece, key: tuple[slice, ...], rows: RowCache | None = None) -> Items:
    """The items of box ``key`` (one slice per dim, local to the piece) of a source piece.

    The result is a view (of ``rows.buf`` or of the map): use it before the next read.
    """
    if rows is not None and key:
        isz = piece.itemsize
        starts = [s.start for s in key]
        sizes = [s.stop - s.start for s in key]
        used = isz
        for x in sizes:
            used *= x
        first, stop = box_span(piece.strides, starts, sizes)
        if (stop - first) * isz <= DENSE * used:
            # dense enough: the span read whole with one pread, widened to whole rows
            row = _row_elems(piece.shape, piece.strides, sizes)
            wfirst = first - first % row
            wstop = min(piece.count, -(-stop // row) * row)
            base = piece.base
            try:
                at = rows.read(
                    pages.sources.fd(piece.fi),
                    piece.fi,
                    base + first * isz,
                    base + stop * isz,
                    base + wfirst * isz,
                    base + wstop * isz,
                )
            except SourceChangedError:
                pages.sources.check(piece.fi)  # names the file when its size changed
                raise
            if at is not None:
                import numpy as np

                dense: Items = np.ndarray(
                    tuple(sizes),
                    dtype=piece.arr.dtype,
                    buffer=rows.buf,
                    offset=at,
                    strides=tuple(st * isz for st in piece.strides),
                )
                return dense
    # sparse (a narrow column of wide rows): touch only the pages needed
    pages.touch_slices(piece.fi, piece.base, piece.strides, piece.itemsize, key)
    part: Items = piece.arr[key] if key else piece.arr[...]
    return part


def _row_elems(shape: Sequence[int], strides: Sequence[int], sizes: Sequence[int]) -> int:
    """Elements per "row" of a box's source: the stride of the dim just outside its innermost
    partial dim (1 when the box is whole or only its outermost dim is cut)."""
    j = len(shape) - 1
    while j >= 0 and sizes[j] == shape[j]:
        j -= 1
    return strides[j - 1] if j >= 1 else 1


class MappedFiles(PageWindow):
    """Read-only maps of a checkpoint's files whose touched pages are released as we go.

    Args:
        files: the checkpoint's file paths.
        release_every: bytes of touched pages to hold before releasing them (at least 1 MiB).
    """

    def __init__(self, files: Sequence[str], release_every: int) -> None:
        super().__init__(SourceFiles(files), max(1 << 20, release_every))

    def piece(self, src: TensorSource, k: int, shape: tuple[int, ...] | None = None) -> Piece:
        """Piece ``k`` of ``src``, mapped."""
        return Piece.of(self.sources, src, k, shape)

    def raw(self, fi: int, offset: int, count: int) -> Items:
        """``count`` bytes of file ``fi`` at ``offset`` as a read-only uint8 numpy array."""
        import numpy as np

        arr = np.frombuffer(self.sources.map(fi), dtype=np.uint8, count=count, offset=offset)
        self.touch_range(fi, offset, offset + count)
        return arr

    def close(self) -> None:
        """Release pages and close maps and file descriptors."""
        self.release()
        self.sources.close()
