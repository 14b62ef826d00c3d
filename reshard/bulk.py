"""Columns of an output tensor list, for copying 100k small tensors without Python work per tensor.

An output file whose entries come as columns (``entries.columns()``: the tensors, the
rank, and arrays of offsets and sizes, as :mod:`reshard.formats.safetensors` lays them
out) is written by the executor a buffer at a time: the entries of each geometry in the
buffer are moved with a few numpy copies. What it needs per tensor is here, shared by
the sibling files of one tensor list: each tensor's geometry (tensors of one geometry
have the same copies, so the same runs) and, per geometry and source piece, the pieces'
files and offsets as arrays, made once when first asked for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from .checkpoint import TensorSource, offset_columns
from .dtypes import DTYPE_SIZES
from .io.reader import Run
from .plan import Copy, OutFile, TargetTensor

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    Ints = npt.NDArray[np.int64]
else:
    Ints = Any

__all__ = ["Geometries", "Column", "shared_sources"]

EntryRuns = Callable[[TensorSource, tuple[Copy, ...], int], "tuple[Run, ...] | None"]

_SRC, _OFFSETS, _FILES = attrgetter("src"), attrgetter("piece_offsets"), attrgetter("piece_files")

Column = tuple[int | Ints, Ints]
"""One source piece of every tensor of a geometry: its file (one for all, or per tensor) and offset."""


class Geometries:
    """The tensors of one output tensor list, by geometry.

    Attributes:
        tensors: the list (entry ``i`` of each file of it is ``tensors[i]``'s block).
        group: per tensor, its geometry's number (int32).
        row: per tensor, its position among its geometry's tensors (int32).
        members: per geometry, its tensors' positions in the list.
    """

    def __init__(self, tensors: Sequence[TargetTensor], entry_runs: EntryRuns) -> None:
        """``entry_runs``: an entry's copies as runs (:func:`reshard.execute.entry_runs`)."""
        import numpy as np

        self.tensors = tensors
        self._entry_runs = entry_runs
        keys: dict[tuple[object, ...], int] = {}
        group: list[int] = []
        firsts: list[TargetTensor] = []
        for t in tensors:
            src = t.src
            # identities: tensors of one geometry share their copies and piece blocks (the
            # planner's and the reader's caches), which the list holds while this lives
            key = (id(t.copies), id(src.piece_blocks), t.dtype, src.dtype, t.groups)
            g = keys.get(key)
            if g is None:
                g = keys[key] = len(firsts)
                firsts.append(t)
            group.append(g)
        self.firsts = firsts
        self.group = np.array(group, dtype=np.int32)
        # int32 positions: a DCP target has a list per rank file (each holds its own replicated
        # tensors), 8 of 200k tensors: as int64, 12 MB more
        order = np.argsort(self.group, kind="stable").astype(np.int32)
        bounds = np.searchsorted(self.group[order], np.arange(len(firsts) + 1))
        self.members = [order[bounds[g] : bounds[g + 1]] for g in range(len(firsts))]
        self.row = np.empty(len(tensors), dtype=np.int32)
        for m in self.members:
            self.row[m] = np.arange(len(m))
        self._offsets: dict[int, tuple[Ints, Sequence[int], tuple[int, ...] | Ints]] = {}
        self._columns: dict[tuple[int, int], Column] = {}  # of geometries whose files vary
        self._runs: dict[tuple[int, int], tuple[Run, ...] | None] = {}
        self._lock = threading.Lock()

    def runs(self, g: int, rank: int) -> tuple[Run, ...] | None:
        """Geometry ``g``'s runs for target rank ``rank`` (None: its entries are gathered)."""
        key = (g, rank)
        if key not in self._runs:
            t = self.firsts[g]
            src = t.src
            ok = t.groups == 1 and t.dtype == src.dtype
            self._runs[key] = self._entry_runs(src, t.copies[rank], DTYPE_SIZES[src.dtype]) if ok else None
        return self._runs[key]

    def column(self, g: int, k: int) -> Column:
        """Source piece ``k`` of geometry ``g``'s tensors: its file (an int when one for all) and
        offsets, in the order of :attr:`members` (a view of the geometry's offsets)."""
        values, picks, files = self._pieces(g)
        offsets = values[:, picks[k]]
        if isinstance(files, tuple):
            return files[k], offsets
        hit = self._columns.get((g, k))
        if hit is None:
            col = files[:, k]
            fi: int | Ints = int(col[0]) if len(col) and (col == col[0]).all() else col
            with self._lock:
                hit = self._columns.setdefault((g, k), (fi, offsets))
        return hit

    def sources(self, rank: int) -> set[int]:
        """The source files target rank ``rank``'s entries read by runs (the column paths'
        reads; entries gathered one by one read elsewhere)."""
        import numpy as np

        out: set[int] = set()
        for g in range(len(self.firsts)):
            for _, k, *_ in self.runs(g, rank) or ():
                fi, _ = self.column(g, k)
                out.update([fi] if isinstance(fi, int) else np.unique(fi).tolist())
        return out

    def _pieces(self, g: int) -> tuple[Ints, Sequence[int], tuple[int, ...] | Ints]:
        """Geometry ``g``'s piece offsets (:func:`offset_columns`: a few columns for 64 rank files,
        not one per rank: 100k tensors, 50 MB) and files (one tuple for all, or an array)."""
        hit = self._offsets.get(g)
        if hit is not None:
            return hit
        import numpy as np

        srcs = list(map(_SRC, map(self.tensors.__getitem__, self.members[g].tolist())))
        first = srcs[0]
        values, picks = offset_columns(list(map(_OFFSETS, srcs)), len(first.piece_offsets))
        row = first.piece_files
        same = all(s.piece_files is row for s in srcs)  # a reader's tuple per geometry
        files = row if same else np.array(list(map(_FILES, srcs)), dtype=np.int64).reshape(len(srcs), -1)
        with self._lock:
            return self._offsets.setdefault(g, (values, picks, files))


def shared_sources(
    files: Sequence[OutFile], geometries: Callable[[OutFile], Geometries | None]
) -> frozenset[int]:
    """The source files that two or more of ``files`` (siblings written in lockstep) read by runs
    (``geometries``: a file's :class:`Geometries`, None when it is not written by columns).

    Their windows are worth reading whole and keeping for the next sibling; the rest are read
    as asked (TP-64 -> TP-8: each target rank reads 8 rank files of its own).
    """
    seen: set[int] = set()
    shared: set[int] = set()
    for f in files:
        geos = geometries(f)
        if geos is None:
            continue
        mine = geos.sources(f.local_rank)
        shared |= seen & mine
        seen |= mine
    return frozenset(shared)
