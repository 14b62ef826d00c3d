"""Opening the pieces of a transformed source: strided views of the real pieces' bytes.

A :class:`~reshard.transform_plan.TransformedSource` piece is a view of a real
source piece in the target's dim order (new dims of size 1, pinned dims folded
into the offset, transposed strides); :func:`open_piece` maps it as a
:class:`~reshard.io.reader.Piece` whose ``strides`` are the view's, so
:func:`~reshard.io.reader.read_box` reads its boxes like any piece's. Zero
pieces (transform padding) have no bytes: None.
"""

from __future__ import annotations

from ..checkpoint import TensorSource
from ..dtypes import DTYPE_SIZES
from ..transform_plan import TransformedSource
from .pages import SourceFiles
from .reader import Piece, uint_dtype

__all__ = ["open_piece"]


def open_piece(sources: SourceFiles, src: TensorSource, k: int, *, mapped: bool = True) -> Piece | None:
    """Piece ``k`` of ``src`` (``mapped``: with a view of the file's map), or None for zeros.

    A transform's view whose strides do not decrease (a ``transpose``) is always mapped:
    read by ``pread``, its boxes would take one system call per few items, so ``read_box``
    reads it through the map, after the file's size is checked. Any other view is read
    like a plain piece (``pread`` of the span its box covers, when not ``mapped``).
    """
    if not isinstance(src, TransformedSource):
        return Piece.of(sources, src, k, mapped=mapped)
    fi = src.piece_files[k]
    if fi < 0:
        return None
    shape = src.piece_shape(k)
    strides = src.piece_strides[k]
    isz = DTYPE_SIZES[src.dtype]
    base = src.piece_offsets[k]
    # elements from the view's first to past its last (every dim non-empty: the planner's pieces)
    count = 1 + sum((n - 1) * st for n, st in zip(shape, strides)) if all(shape) else 0
    walked = [st for n, st in zip(shape, strides) if n > 1]
    if not mapped and all(a >= b for a, b in zip(walked, walked[1:])):
        return Piece(fi, base, shape, strides, isz, count, None)
    sources.check(fi)
    sources.ready(fi, base, base + count * isz)  # (a lazy spool's region: made now)
    import numpy as np

    flat = np.frombuffer(sources.map(fi), dtype=uint_dtype(isz), count=count, offset=base)
    arr = np.lib.stride_tricks.as_strided(
        flat, shape=shape, strides=tuple(st * isz for st in strides), writeable=False
    )
    return Piece(fi, base, shape, strides, isz, count, arr)
